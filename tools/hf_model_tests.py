"""Run transformers' own model tests (its ``ModelTesterMixin``) with multihead standing in for sdpa.

    python tools/hf_model_tests.py <transformers tests folder> [--reference] [families...] [-- pytest args]

The tests folder comes from transformers' source distribution at the locked version (``make hf-model-tests``
downloads it with pip; it is not in the wheel, and not copied here). That distribution holds the mixins
(``tests/test_modeling_common.py``) but not the per-family test files (``tests/models/<family>/``), nor two
modules ``test_modeling_common`` imports (``tests/generation/test_utils.py``: ``GenerationTesterMixin``;
``tests/exporters/test_export.py``: ``ExportTesterMixin``, a base of ``ModelTesterMixin``). So here each family
gets a minimal model tester (a tiny config, ``input_ids`` and a padded ``attention_mask``) and the two missing
mixins are empty (no generate or export tests: transformers' generation tests live in the missing module).
Where a folder holds ``models/<family>/test_modeling_<family>.py`` (a git checkout at the same version), that file
runs instead.

multihead stands in for sdpa under sdpa's name: transformers' registry entries for ``"sdpa"`` (the attention
function and its mask function) are multihead's, so every test that builds a model with sdpa, or compares eager
with sdpa, runs multihead; a test that checks the implementation's name sees ``"sdpa"``. ``--reference`` runs the
same tests on transformers' own sdpa: a test that fails in both runs fails for the minimal tester, not for
multihead. The report lists the tests that differ between the two runs.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import sys
import tempfile
import types
import unittest
from pathlib import Path

#: family -> (its configuration's keywords beyond the shared ones, the model classes tested)
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2),
              ("LlamaModel", "LlamaForCausalLM", "LlamaForSequenceClassification", "LlamaForTokenClassification")),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=4),
                ("MistralModel", "MistralForCausalLM", "MistralForSequenceClassification")),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2), ("Qwen2Model", "Qwen2ForCausalLM",
                                                           "Qwen2ForSequenceClassification")),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=8, sliding_window=4),
               ("Gemma2Model", "Gemma2ForCausalLM")),
    "gpt2": ("GPT2Config", dict(n_positions=64), ("GPT2Model", "GPT2LMHeadModel",
                                                  "GPT2ForSequenceClassification")),
    "bert": ("BertConfig", dict(max_position_embeddings=64),
             ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification")),
}
SHARED = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
              pad_token_id=0)
GPT2 = dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_inner=37, pad_token_id=0)


class TinyModelTester:
    """What ``ModelTesterMixin`` reads of a model tester (``self.model_tester``)."""

    batch_size, seq_length, is_training, num_labels, num_choices, type_sequence_label_size = 3, 7, True, 3, 4, 2

    def __init__(self, parent, config_cls, extra: dict):
        self.parent, self.config_cls, self.extra = parent, config_cls, extra
        shared = GPT2 if config_cls.__name__ == "GPT2Config" else SHARED
        self.kwargs = {**shared, **extra}
        self.vocab_size, self.num_hidden_layers = 99, 2
        self.hidden_size, self.num_attention_heads = 32, 4
        self.encoder_seq_length = self.seq_length

    def get_config(self):
        return self.config_cls(**self.kwargs, num_labels=self.num_labels)

    def prepare_config_and_inputs_for_common(self):
        import torch
        from transformers.testing_utils import torch_device

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, self.vocab_size, (self.batch_size, self.seq_length), generator=g)  # (B, L)
        am = torch.ones_like(ids)
        am[1, :3] = 0  # one left-padded row: padding reaches every test that compares implementations
        return self.get_config(), {"input_ids": ids.to(torch_device), "attention_mask": am.to(torch_device)}


def _stand_in(reference: bool, calls: str) -> None:
    """multihead's attention and mask functions under transformers' name "sdpa" (not with ``--reference``), in
    every process that runs tests; each counts the calls multihead computed into a file of folder ``calls``."""
    import atexit

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import multihead.hf.attention as mha

    if reference or getattr(AttentionInterface._global_mapping["sdpa"], "multihead_stand_in", False):
        return

    @functools.wraps(mha.attention_forward)
    def counted(*args, **kwargs):
        COUNT[0] += 1
        return mha.attention_forward(*args, **kwargs)

    counted.multihead_stand_in = True
    AttentionInterface._global_mapping["sdpa"] = counted
    AttentionMaskInterface._global_mapping["sdpa"] = AttentionMaskInterface._global_mapping[mha.NAME]
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker: its count for the process that reports
        atexit.register(lambda: (Path(calls) / str(os.getpid())).write_text(str(COUNT[0])))


COUNT = [0]  # the attention calls multihead computed under sdpa's name in this process


def _package(tests: Path) -> str:
    """Import transformers' tests folder as a package, with the two mixins its source distribution lacks empty."""
    name = "transformers_tests"
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(tests)]
    sys.modules[name] = pkg
    for sub, cls in (("generation.test_utils", "GenerationTesterMixin"), ("exporters.test_export", "ExportTesterMixin")):
        if (tests / (sub.replace(".", "/") + ".py")).exists():
            continue
        for part in (sub.split(".")[0], sub):
            sys.modules.setdefault(f"{name}.{part}", types.ModuleType(f"{name}.{part}"))
        sys.modules[f"{name}.{sub.split('.')[0]}"].__path__ = []
        setattr(sys.modules[f"{name}.{sub}"], cls, type(cls, (), {}))
    return name


def _test_classes(tests: Path, families: list[str]) -> dict[str, type]:
    import transformers

    pkg = _package(tests)
    common = importlib.import_module(f"{pkg}.test_modeling_common")
    classes = {}
    for fam in families:
        config, extra, models = FAMILIES[fam]
        config_cls = getattr(transformers, config)

        def set_up(self, config_cls=config_cls, extra=extra):
            self.model_tester = TinyModelTester(self, config_cls, extra)

        classes[f"Test{fam.capitalize()}"] = type(
            f"Test{fam.capitalize()}", (common.ModelTesterMixin, unittest.TestCase),
            {"all_model_classes": tuple(getattr(transformers, m) for m in models), "setUp": set_up,
             "test_torch_exportable": False, "__module__": __name__})
    return classes


def main(argv: list[str]) -> int:
    import pytest

    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    args, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    tests, rest = Path(args[0]), args[1:]
    reference = "--reference" in rest
    families = [f for f in rest if f != "--reference"] or list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not (tests / "test_modeling_common.py").exists():
        print(f"hf_model_tests: {tests} holds no test_modeling_common.py (transformers' tests folder)" if not unknown
              else f"hf_model_tests: unknown families {unknown}; known: {sorted(FAMILIES)}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    calls = tempfile.mkdtemp(prefix="hf-model-tests-")
    # every process pytest starts (xdist's workers too) loads this file as a plugin: the stand-in is made there
    os.environ[_ENV] = f"{tests}|{','.join(families)}|{int(reference)}|{calls}"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(Path(__file__).parent))
    own = [tests / "models" / f / f"test_modeling_{f}.py" for f in families]
    checkout = all(p.exists() for p in own)  # a checkout: the families' own test files; else the minimal testers
    code = pytest.main([*map(str, own if checkout else [__file__]), "-p", Path(__file__).stem, "-p", "no:cacheprovider",
                        "-q", "-rfE", *extra])
    plugin = sys.modules.get(Path(__file__).stem)
    n = sum(int(f.read_text()) for f in Path(calls).iterdir()) + (plugin.COUNT[0] if plugin else 0)
    shutil.rmtree(calls)
    print("transformers' sdpa computed every attention call" if reference else
          f"multihead computed {n} attention calls under the name 'sdpa'")
    return code if reference or n else 1


_ENV = "MULTIHEAD_HF_MODEL_TESTS"
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
elif os.environ.get(_ENV):  # loaded by pytest (as the plugin, and collected): the stand-in, one class per family
    _folder, _families, _reference, _calls = os.environ[_ENV].split("|")
    _stand_in(_reference == "1", _calls)
    if not all((Path(_folder) / "models" / f / f"test_modeling_{f}.py").exists() for f in _families.split(",")):
        globals().update(_test_classes(Path(_folder), _families.split(",")))

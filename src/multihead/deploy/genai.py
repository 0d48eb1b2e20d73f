"""ONNX Runtime GenAI: a (pruned) decoder language model written as ONNX Runtime GenAI's model folder at its pruned
size, with GenAI's own builder run on the standard transformers folder (:func:`multihead.deploy.llama.standard_folder`).
The ``decoder`` extra.

    from multihead.deploy import genai
    genai.export_genai(model, "genai", tokenizer=tokenizer)  # ONNX Runtime GenAI's builder, then generate

It takes a ``LlamaForCausalLM``; GenAI's builder holds one head count for every layer, so ``export_genai`` refuses a
cut that differs between layers, naming the layers. A ``Gemma3ForCausalLM`` is refused in one line: the builder has a
Gemma 3 class, but it reads transformers 4's Gemma 3 config and fails on the one transformers 5 writes
(:func:`_builder_refusal`). The model is read back through ``onnxruntime_genai`` and compared
with the torch model before it is returned (:mod:`multihead.deploy.check`: the prompt's logits within fp32 rounding,
greedy tokens equal); a model that differs is deleted and a ValueError says by how much.

The peer's file is made here too: the builder run on the unpruned checkpoint as GenAI's users run it
(:func:`standard_genai`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from multihead.deploy.check import QUANTIZED, TOLERANCE, Served, _compare, _greedy, _prompt
from multihead.deploy.llama import _check, standard_folder
from multihead.extras import require

__all__ = ["GENAI_PRECISIONS", "export_genai", "genai_model", "standard_genai"]


GENAI_PRECISIONS = ("fp32", "int4")


def _builder_refusal(architecture: str) -> str | None:
    """Why GenAI's builder cannot build a folder of ``architecture`` as transformers writes it, or None. Gemma 3: the
    builder's Gemma3Model reads ``rope_theta``/``rope_local_base_freq`` and ``rope_parameters["rope_type"]``
    (transformers 4's config); transformers 5 holds ``rope_parameters`` per kind of layer, and the builder stops on
    it (KeyError 'rope_type', onnxruntime-genai 0.18.0 with transformers 5.24)."""
    if architecture != "Gemma3ForCausalLM":
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        built = f"onnxruntime-genai {version('onnxruntime-genai')}, transformers {version('transformers')}"
    except PackageNotFoundError:
        built = "not installed"
    return (f"ONNX Runtime GenAI's builder ({built}) fails on Gemma3ForCausalLM: it reads transformers 4's Gemma 3 "
            "config (rope_theta, rope_local_base_freq), transformers 5 writes rope_parameters per kind of layer "
            "(KeyError 'rope_type'); write gguf-* or keep the transformers folder")


def export_genai(model: nn.Module, folder: str | Path, *, tokenizer, precision: str = "fp32", prompt_ids=None,
                 new_tokens: int = 8) -> Served:
    """Write ``model`` (a LlamaForCausalLM, pruned or not; a Gemma 3 is refused, :func:`_builder_refusal`) as ONNX
    Runtime GenAI's model folder (model.onnx with GroupQueryAttention, genai_config.json, the tokenizer) with GenAI's
    own builder (``python -m onnxruntime_genai.models.builder``, CPU) run on :func:`standard_folder`'s plain
    transformers folder at the pruned size. ``tokenizer``: the model's transformers tokenizer (the builder copies
    it). ``precision``: "fp32" (the one a comparison can hold to the weights' rounding) or "int4" (the builder's
    MatMulNBits int4, what GenAI's CPU users run: its greedy tokens and last logits' difference are reported,
    :data:`QUANTIZED`).

    Checked before it is returned (else deleted, ValueError): ``onnxruntime_genai`` runs ``prompt_ids`` (default:
    16 fixed random ids) with greedy search: the prompt's last logits within fp32 rounding and ``new_tokens`` greedy
    tokens equal to the torch model's (fewer when GenAI stops at the end-of-text token, the torch model's token
    there being the same)."""
    counts = _check(model, "export_genai")
    why = _builder_refusal(type(model).__name__)
    if why is not None:
        raise ValueError(f"export_genai: {why}.")
    if precision not in GENAI_PRECISIONS:
        raise ValueError(f"export_genai: precision={precision!r}; use one of {GENAI_PRECISIONS}.")
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"export_genai: tokenizer must be the model's transformers tokenizer (GenAI's builder reads "
                        f"it); got {type(tokenizer).__name__}.")
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"export_genai writes a new folder; {folder} exists and is not an empty directory.")
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ValueError(f"export_genai: new_tokens must be a whole number >= 1; got {new_tokens!r}.")
    ids = _prompt(model, prompt_ids, new_tokens, "export_genai")
    og = require("onnxruntime_genai", "multihead.deploy.genai.export_genai")

    with tempfile.TemporaryDirectory() as d:
        src = standard_folder(model, Path(d) / "hf", tokenizer=tokenizer)
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(folder),
               "-p", precision, "-e", "cpu", "-c", str(Path(d) / "cache")]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"export_genai: GenAI's builder failed ({' '.join(cmd[1:4])}): {' | '.join(tail)}")

    ref_logits, ref_tokens = _greedy(model, ids, new_tokens)
    got_last, got_tokens = _genai_greedy(og, folder, ids, new_tokens)
    diff = float(np.abs(got_last - ref_logits[0, -1].numpy()).max())
    if precision in QUANTIZED:
        same = sum(a == b for a, b in zip(got_tokens, ref_tokens))
        return Served(folder, "onnxruntime-genai", diff, float("inf"), got_tokens, counts,
                      [f"onnxruntime_genai greedy ({precision}): last logits max |diff| {diff:.3g} (quantized: not held "
                       f"to a tolerance), {same} of {len(got_tokens)} greedy tokens equal"])
    tol = TOLERANCE[precision] * max(1.0, float(ref_logits.abs().max()))
    _compare("export_genai", folder, diff, tol, got_tokens, ref_tokens[: len(got_tokens)])
    return Served(folder, "onnxruntime-genai", diff, tol, got_tokens, counts,
                  [f"onnxruntime_genai greedy: last logits max |diff| {diff:.3g} (tolerance {tol:.3g}), "
                   f"{len(got_tokens)} greedy tokens equal"])


def _genai_greedy(og, folder: Path, ids: Tensor, n: int) -> tuple[np.ndarray, list[int]]:
    """(GenAI's logits after the prompt (V,), its greedy tokens, at most n)."""
    m = og.Model(str(folder))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=ids.shape[1] + n, do_sample=False)
    gen = og.Generator(m, params)
    gen.append_tokens(ids.numpy().astype(np.int32))
    last = np.asarray(gen.get_output("logits"), dtype=np.float32)[0, -1]  # (V,)
    tokens = []
    while not gen.is_done() and len(tokens) < n:
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
    return last, tokens


class _GenAIModel(nn.Module):
    """A GenAI folder called like a transformers causal LM for scoring text: ``forward(input_ids, attention_mask)``
    gives ``.logits`` (B, L, V), each row's real tokens (a right-padded batch) run as one prompt by
    ``onnxruntime_genai``; the padded positions' logits are zeros (nothing scores them)."""

    def __init__(self, folder: Path):
        super().__init__()
        og = require("onnxruntime_genai", "multihead.deploy.genai.genai_model")
        self.folder, self._og, self._model = folder, og, og.Model(str(folder))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None):
        from types import SimpleNamespace

        B, L = input_ids.shape
        lens = attention_mask.sum(-1).tolist() if attention_mask is not None else [L] * B
        rows = []
        for b in range(B):
            n = int(lens[b])
            params = self._og.GeneratorParams(self._model)
            params.set_search_options(max_length=n + 1, do_sample=False)
            gen = self._og.Generator(self._model, params)
            gen.append_tokens(input_ids[b:b + 1, :n].numpy().astype(np.int32))  # (1, n) the row's real tokens
            got = np.asarray(gen.get_output("logits"), dtype=np.float32)[0]  # (n, V)
            if got.shape[0] != n:
                raise RuntimeError(f"genai_model: {self.folder} gave logits for {got.shape[0]} of the prompt's {n} "
                                   "positions; it scores text only where it returns every position's.")
            rows.append(torch.nn.functional.pad(torch.from_numpy(got), (0, 0, 0, L - n)))  # (L, V)
        return SimpleNamespace(logits=torch.stack(rows))  # (B, L, V)


def genai_model(folder: str | Path) -> nn.Module:
    """A GenAI folder (:func:`export_genai`, :func:`standard_genai`) as a module scoring text like the torch model:
    ``genai_model(folder)(input_ids=..., attention_mask=...).logits`` is (B, L, V), each row run by
    ``onnxruntime_genai`` on its real tokens (so :func:`multihead.apps.prune.causal.fidelity` measures what
    quantizing cost the file's perplexity)."""
    folder = Path(folder)
    if not (folder / "genai_config.json").is_file():
        raise ValueError(f"genai_model: {folder} holds no genai_config.json; give a folder export_genai or "
                         "standard_genai wrote.")
    return _GenAIModel(folder)


def standard_genai(src: str | Path, out: str | Path, precision: str = "fp32") -> Path:
    """The peer's GenAI folder: GenAI's builder on the unpruned checkpoint folder ``src``, as its users run it (CPU,
    ``precision`` fp32 or int4: the builder's own quantizer), into ``out``; kept where ``out`` already holds it
    (built once)."""
    if precision not in GENAI_PRECISIONS:
        raise ValueError(f"standard_genai: precision={precision!r}; use one of {GENAI_PRECISIONS}.")
    src, out = Path(src), Path(out)
    if not (out / "genai_config.json").is_file():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out),
                        "-p", precision, "-e", "cpu", "-c", str(out.parent / "cache")], check=True,
                       capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out

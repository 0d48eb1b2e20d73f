"""Activation patching checked against TransformerLens on the same weights (the `lens` extra: transformer-lens 4.3 at
the lock): a tiny GPT-2 built here, wrapped by TransformerLens' bridge offline and attached to multihead; every
head's patch (all positions, and per position) equal within 1e-4."""

from __future__ import annotations

import copy

import pytest
import torch

T = pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")

import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402


def _diff(logits):  # (B,): the last position's logit of token 3 minus token 5
    return logits[:, -1, 3] - logits[:, -1, 5]


def test_patching_equals_transformer_lens_on_the_same_gpt2(tmp_path):
    import transformer_lens.patching as tl_patching
    from transformer_lens.model_bridge import TransformerBridge

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval()
    model.save_pretrained(tmp_path)
    bridge = TransformerBridge.boot_transformers(str(tmp_path), hf_model=copy.deepcopy(model), device="cpu")
    ours = mhf.attach(copy.deepcopy(model))
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 50, (3, 8), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2:4] = torch.randint(0, 50, (3, 2), generator=g)
    with torch.no_grad():
        assert (bridge(clean) - model(clean).logits).abs().max() < 1e-5  # the same model in both
    _, cache = bridge.run_with_cache(clean)

    def metric(logits):
        return _diff(logits).mean()

    theirs = tl_patching.get_act_patch_attn_head_out_all_pos(bridge, corrupted, cache, metric)  # (layers, H)
    r = heads.patch(ours, {"input_ids": clean}, {"input_ids": corrupted}, lambda out: _diff(out.logits))
    assert r.grid().shape == theirs.shape == (2, 4)
    assert (r.grid() - theirs.double()).abs().max() < 1e-4
    assert (r.grid() - r.base).abs().max() > 1e-3  # the patches moved the metric: the comparison is not of constants
    theirs = tl_patching.get_act_patch_attn_head_out_by_pos(bridge, corrupted, cache, metric)  # (layers, L, H)
    per = heads.patch(ours, {"input_ids": clean}, {"input_ids": corrupted}, lambda out: _diff(out.logits),
                      positions=True)
    assert (per.grid().transpose(1, 2) - theirs.double()).abs().max() < 1e-4  # (layers, H, L) -> (layers, L, H)


def test_the_patching_bench_against_transformer_lens_runs_small_and_loads_back(tmp_path):
    """bench/patching_vs_lens.py: both tools' results on the same weights agree, and the row it writes loads back."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("pvl", Path(__file__).parent.parent / "bench" / "patching_vs_lens.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.main(["--tiny", "--max-seconds", "1", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "patching_vs_lens.json").read_text()) == row
    assert row["max_abs_diff"] < 1e-5 and row["lens_ms"] > 0 and row["multihead_ms"] > 0
    assert row["multihead_last_logits_ms"] > 0
    assert "| GPT-2 2 layers x 4 heads, E=32, vocabulary 50 | 2 x 8 |" in (tmp_path / "patching_vs_lens.md").read_text()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_patches_with_the_shared_prefix_equal_the_whole_forwards(family, monkeypatch):
    """heads.patch runs the blocks before a chunk's first patch once, at the base batch: its values equal the
    experiment with every chunk run whole (the blocks not found), on GPT-2 and on Llama (rotary embeddings and a
    causal mask handed to every layer as per-row inputs), all positions and per position."""
    from multihead.heads import patching

    torch.manual_seed(0)
    if family == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=3, n_head=4))
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    model = mhf.attach(model.eval())
    g = torch.Generator().manual_seed(2)
    clean = {"input_ids": torch.randint(0, 50, (2, 7), generator=g)}
    corrupted = {"input_ids": clean["input_ids"].roll(1, 1)}

    def metric(out):
        return out.logits[:, -1, 3] - out.logits[:, -1, 5]

    calls, parts, replays = [], [], []
    real = patching._ChunkRun.values
    monkeypatch.setattr(patching._ChunkRun, "values", lambda self, part, start=None: calls.append(start) or
                        parts.append({n.split(".")[-2] for n, _, _ in part}) or
                        replays.append((start, sorted(self.state["outputs"]))) or real(self, part, start))
    for positions in (False, True):
        shared = heads.patch(model, clean, corrupted, metric, chunk=5, positions=positions)
        assert any(s is not None and s > 0 for s in calls)  # later blocks' chunks did start past block 0
        assert all(len(layers) == 1 for layers in parts), parts  # no chunk spans two blocks (chunk 5 > 4 heads)
        past = [i for i, s in enumerate(calls) if s]  # chunks past block 0: the first repeats rows, the next
        for first in past[:2]:  # replays block 0's recorded output; each checked against the same patches run whole
            assert calls[first + 1] is None, calls
        assert (2, [0]) in replays, replays  # block 0's output recorded by the chunk starting at block 1, replayed
        calls.clear()  # by the one at block 2
        parts.clear()
        replays.clear()
        with monkeypatch.context() as m:
            m.setattr(patching, "_blocks", lambda model, mods: [])
            whole = heads.patch(model, clean, corrupted, metric, chunk=5, positions=positions)
        assert all(s is None for s in calls)
        calls.clear()
        parts.clear()
        assert (shared.grid() - whole.grid()).abs().max() < 1e-5


def test_a_shared_prefix_that_disagrees_with_the_whole_forward_is_dropped(monkeypatch):
    """The check on the first chunk past block 0 compares its first and last patches with the same run whole: when
    the shared prefix gives other values (here: the repeated rows deliberately scaled), every chunk runs whole and
    the record equals the experiment without blocks."""
    from multihead.heads import patching

    torch.manual_seed(0)
    model = mhf.attach(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=3,
                                                      n_head=4)).eval())
    g = torch.Generator().manual_seed(3)
    clean = {"input_ids": torch.randint(0, 50, (2, 7), generator=g)}
    corrupted = {"input_ids": clean["input_ids"].roll(1, 1)}

    def metric(out):
        return out.logits[:, -1, 3] - out.logits[:, -1, 5]

    with monkeypatch.context() as m:
        m.setattr(patching, "_blocks", lambda model, mods: [])
        whole = heads.patch(model, clean, corrupted, metric, chunk=3)
    real = patching._repeat_rows
    monkeypatch.setattr(patching, "_repeat_rows", lambda x, c, B: _skewed(real(x, c, B)))
    starts = []
    run_values = patching._ChunkRun.values
    monkeypatch.setattr(patching._ChunkRun, "values", lambda self, part, start=None: starts.append(start) or
                        run_values(self, part, start))
    got = heads.patch(model, clean, corrupted, metric, chunk=3)
    first_past = next(i for i, s in enumerate(starts) if s)
    assert starts[first_past + 1] is None and starts[first_past + 2] is None  # checked, disagreed, ran whole
    assert all(s is None for s in starts[first_past + 3:])  # and every later chunk whole
    assert (got.grid() - whole.grid()).abs().max() < 1e-5


def _skewed(x):  # every floating tensor's rows after the first scaled: a repeat that is wrong
    if isinstance(x, torch.Tensor):
        return torch.cat([x[:1], 1.5 * x[1:]]) if x.is_floating_point() and x.dim() > 0 else x
    if isinstance(x, tuple | list):
        return type(x)(_skewed(v) for v in x)
    if isinstance(x, dict):
        return {k: _skewed(v) for k, v in x.items()}
    return x


def _gpt2(layers: int):
    torch.manual_seed(0)
    return mhf.attach(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=layers,
                                                     n_head=4, initializer_range=0.3)).eval())  # heads that matter


def _pair():
    g = torch.Generator().manual_seed(4)
    clean = {"input_ids": torch.randint(0, 50, (2, 7), generator=g)}
    return clean, {"input_ids": clean["input_ids"].roll(1, 1)}


def _diff_metric(out):
    return out.logits[:, -1, 3] - out.logits[:, -1, 5]


def test_a_block_with_a_forward_hook_runs_every_time_and_its_hook_once(monkeypatch):
    """A user's forward hook that changes a block's output (a steering vector on layer 1 of 5): that block is never
    replayed (replaying its output would apply the hook twice), and the record equals the experiment run whole."""
    from multihead.heads import patching

    model = _gpt2(5)
    v = torch.randn(32) * 0.5
    model.transformer.h[1].register_forward_hook(lambda m, a, out: out + v)
    clean, corrupted = _pair()
    shared = heads.patch(model, clean, corrupted, _diff_metric, chunk=4)
    with monkeypatch.context() as m:
        m.setattr(patching, "_blocks", lambda model, mods: [])
        whole = heads.patch(model, clean, corrupted, _diff_metric, chunk=4)
    assert (shared.grid() - whole.grid()).abs().max() < 1e-5
    assert (whole.grid() - whole.base).abs().max() > 1e-3  # the patches moved the metric


def test_an_error_in_a_patched_run_leaves_the_model_as_it_was():
    """A metric that raises in the middle of the experiment (after blocks were recorded and replayed): no block keeps
    a replaced forward, no hook is left, and the model computes what it did."""
    model = _gpt2(4)
    clean, corrupted = _pair()
    with torch.no_grad():
        before = model(**clean).logits
    calls = []

    def metric(out):
        calls.append(1)
        if len(calls) > 20:
            raise RuntimeError("metric failed")
        return _diff_metric(out)

    with pytest.raises(RuntimeError, match="metric failed"):
        heads.patch(model, clean, corrupted, metric, chunk=2)
    for blk in model.transformer.h:
        assert "forward" not in blk.__dict__ and not blk._forward_hooks and not blk._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(model(**clean).logits, before)


def test_a_metric_reading_the_batchs_loss_is_refused():
    """The loss transformers computes from labels= is one value over the batch: batched patches would share it."""
    model = _gpt2(2)
    clean, corrupted = _pair()
    clean["labels"], corrupted["labels"] = clean["input_ids"], clean["input_ids"]
    with pytest.raises(ValueError, match="computed over the whole batch"):
        heads.patch(model, clean, corrupted, lambda out: out.loss)
    with pytest.raises(ValueError, match="computed over the whole batch"):
        heads.path_patch(model, clean, corrupted, lambda out: out.loss, {"transformer.h.1.attn": [0]})
    r = heads.patch(model, clean, corrupted, _diff_metric)  # per-row metrics of the same outputs run
    assert r.grid().shape == (2, 4)

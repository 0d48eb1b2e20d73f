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
    assert "| GPT-2 2 layers x 4 heads, E=32 | 2 x 8 |" in (tmp_path / "patching_vs_lens.md").read_text()

"""The decoder command's recovery (multihead.apps.prune.causal.recover) on PyTorch's own engine: two CPU processes over gloo,
each distilling its share of every batch through DistributedDataParallel, and again fully sharded (FSDP2), keep the
model one process makes on the whole batches, within the rounding of the gradients' sum. A tiny grouped Llama cut by
one key/value group."""

from __future__ import annotations

import copy
import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from test_distributed import _spawn

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DEADLINE_S = 480  # the whole spawn (on a busy 2-core machine: 205 s seen at a load of 8)
STEPS, LR = 6, 3e-3


def _models():
    """(the unpruned tiny Llama, a copy with key/value group 1's query heads cut in every layer), both attached."""
    import multihead.hf as mhf
    from multihead import heads

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = mhf.attach(transformers.LlamaForCausalLM(cfg).eval())
    cut = copy.deepcopy(ref)
    heads.prune(cut, {n: [2, 3] for n in mhf.attention_modules(cut)})
    return ref, cut


def _batches():
    """Three batches of 4 packed windows of 24 token ids each (every token real)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        x = torch.randint(0, 128, (4, 24), generator=g)  # (B, L)
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x)})
    return out


def _rank(rank: int, world: int, store: str, out: str) -> None:
    from multihead.apps.prune import causal

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        assert causal.process_group() == (rank, world)
        for shard in (False, True):
            ref, cut = _models()
            losses = causal.recover(cut, ref, _batches(), STEPS, lr=LR, shard=shard)
            torch.save({"state": cut.state_dict(), "losses": losses}, f"{out}.{'fsdp' if shard else 'ddp'}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks_over_gloo_keep_the_model_one_process_makes(tmp_path: Path):
    from multihead.apps.prune import causal

    _spawn(_rank, 2, tmp_path, str(tmp_path / "kept"), seconds=DEADLINE_S)  # test_distributed's: ranks that hang fail
    torch.set_num_threads(1)
    ref, cut = _models()
    start = {k: v.clone() for k, v in cut.state_dict().items()}
    losses = causal.recover(cut, ref, _batches(), STEPS, lr=LR)  # one process, the whole batches
    assert any(not torch.equal(cut.state_dict()[n], start[n]) for n in start)  # the recovery moved the weights
    for how in ("ddp", "fsdp"):
        ranks = [torch.load(tmp_path / f"kept.{how}.{r}") for r in (0, 1)]
        for name, want in cut.state_dict().items():
            a, b = ranks[0]["state"][name], ranks[1]["state"][name]
            assert torch.equal(a, b), (how, name)  # the ranks hold one model
            moved = (want - start[name]).abs().max()
            assert (a - want).abs().max() <= 1e-3 * max(float(moved), 1e-6), (how, name, float((a - want).abs().max()),
                                                                               float(moved))
        # each rank's loss is its half's; their mean is the one process's loss on the whole batch (equal token counts)
        for s in range(STEPS):
            assert abs((ranks[0]["losses"][s] + ranks[1]["losses"][s]) / 2 - losses[s]) <= 1e-5 * max(losses[s], 1.0)


def test_a_sharded_recovery_outside_torchrun_is_refused():
    from multihead.apps.prune import causal

    ref, cut = _models()
    with pytest.raises(ValueError, match="needs a process group of two ranks or more: launch with torchrun"):
        causal.recover(cut, ref, _batches(), 1, shard=True)

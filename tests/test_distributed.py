"""Context parallel (multihead.distributed) on real process groups: 2 and 4 processes with the
gloo backend on this machine's loopback, every rank checked against the single-process float64
reference. Every spawn has a deadline: a hung rank fails the test in seconds, it never hangs it."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from multihead import MultiHeadAttention, masks, reference_attention
from multihead import distributed as cp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

COLLECTIVE_TIMEOUT_S = int(os.environ.get("CP_TEST_TIMEOUT", 30))  # a rank waiting longer than this on another raises
DEADLINE_S = 240  # the whole spawn (on a busy 2-core machine)


def _spawn(fn, N: int, tmp_path: Path, *args, seconds: float = DEADLINE_S) -> None:
    """Run fn(rank, N, store, *args) in N fresh processes; raise what any rank raised; fail
    (killing them) if they are not done within ``seconds``."""
    store = tmp_path / f"store{N}"
    ctx = mp.start_processes(fn, args=(N, str(store), *args), nprocs=N, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ranks still running after {seconds} s: a rank hung")


def _init(rank: int, N: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=N,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _close(err: float, what: str, tol: float = 1e-5) -> None:
    assert err <= tol, f"{what}: max error {err:.2e} > {tol}"


def _cases(B: int, Lq: int, Lk: int):
    """(name, mask over the whole sequence, mask as each rank passes it given its shard function)."""
    lens = torch.tensor([Lk - 5, 0, Lk])[:B]  # a sequence with no valid key: zeros, not NaN
    qlens = torch.randint(0, Lk + 1, (B, Lq), generator=torch.Generator().manual_seed(3))
    keep = torch.rand(B, Lk, generator=torch.Generator().manual_seed(4)) > 0.3
    keep[:, 0] = True
    out = [
        ("none", None, lambda sh: None),
        ("causal", masks.Causal(), lambda sh: masks.Causal()),
        ("causal bottom-right", masks.Causal("bottom-right"), lambda sh: masks.Causal("bottom-right")),
        ("sliding window", masks.SlidingWindow(3), lambda sh: masks.SlidingWindow(3)),
        ("two-sided window", masks.SlidingWindow(2, 3), lambda sh: masks.SlidingWindow(2, 3)),
        ("valid lens (B,)", masks.ValidLens(lens), lambda sh: masks.ValidLens(lens)),
        ("valid lens (B, Lq)", masks.ValidLens(qlens), lambda sh: masks.ValidLens(sh(qlens, 1, "q"))),
        ("key padding", masks.KeyPadding(keep), lambda sh: masks.KeyPadding(sh(keep, 1, "k"))),
        ("causal & key padding", masks.Causal() & masks.KeyPadding(keep),
         lambda sh: masks.Causal() & masks.KeyPadding(sh(keep, 1, "k"))),
        ("window & valid lens", masks.SlidingWindow(4) & masks.ValidLens(lens),
         lambda sh: masks.SlidingWindow(4) & masks.ValidLens(lens)),
    ]
    if Lq == Lk:
        out.append(("padding", masks.Padding(lens), lambda sh: masks.Padding(lens)))
    return out


def _against_reference(rank: int, N: int, store: str) -> None:
    """Outputs and gradients of every mask, both layouts, GQA, D != Dv, self- and cross-attention
    lengths, default and given scale, equal the float64 reference on the whole sequence within 1e-5 (fp32)."""
    _init(rank, N, store)
    B, H, Hkv, D, Dv = 3, 4, 2, 5, 7
    for layout in cp.LAYOUTS:
        for Lq, Lk in ((8 * N, 8 * N), (4 * N, 6 * N)):
            g = torch.Generator().manual_seed(Lq * 100 + Lk)
            q, k, v = torch.randn(B, H, Lq, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g), \
                torch.randn(B, Hkv, Lk, Dv, generator=g)
            dout = torch.randn(B, H, Lq, Dv, generator=g)
            for name, whole, local in _cases(B, Lq, Lk):
                def sh(t, dim, _which, layout=layout):
                    return cp.shard(t, dim=dim, layout=layout)

                ql, kl, vl = (sh(t, 2, "").requires_grad_() for t in (q, k, v))
                scale = None if Lq == Lk else 0.37  # the default 1/sqrt(D), and a given one
                out = cp.ring_attention(ql, kl, vl, local(sh), layout=layout, scale=scale)
                out.backward(sh(dout, 2, ""))
                q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
                ref = reference_attention(q64, k64, v64, whole, scale=scale)
                ref.backward(dout.double())
                what = f"N={N} {layout} Lq={Lq} Lk={Lk} {name}"
                got = cp.gather(out.detach(), dim=2, layout=layout)
                assert not torch.isnan(got).any(), what
                _close((got.double() - ref).abs().max().item(), what + " output")
                for t, r, n in ((ql, q64, "dq"), (kl, k64, "dk"), (vl, v64, "dv")):
                    _close((cp.gather(t.grad, dim=2, layout=layout).double() - r.grad).abs().max().item(),
                           f"{what} {n}")
    dist.destroy_process_group()


@pytest.mark.parametrize("N", [2, 4])
def test_ring_attention_equals_the_reference(N, tmp_path):
    _spawn(_against_reference, N, tmp_path)


def _work_and_traffic(rank: int, N: int, store: str) -> None:
    """Zigzag balances causal work (max/min <= 1.1, contiguous does not); a sliding window's
    far pieces are neither sent nor computed."""
    _init(rank, N, store)
    B, H, D, L = 1, 2, 4, 64 * N

    def run(mask, layout):
        q, k, v = (cp.shard(torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(i)), dim=2,
                            layout=layout) for i in range(3))
        cp.ring_attention(q, k, v, mask, layout=layout)
        s = cp.last_stats()
        got = [torch.zeros(2, dtype=torch.int64) for _ in range(N)]
        dist.all_gather(got, torch.tensor([s.entries, s.pieces_sent]))
        return [t.tolist() for t in got]

    full = run(None, "contiguous")
    zig = run(masks.Causal(), "zigzag")
    work = [r[0] for r in zig]
    assert max(work) / min(work) <= 1.1, f"zigzag causal work per rank {work}"
    assert sum(work) <= 0.6 * sum(r[0] for r in full), "causal blocks above the diagonal were computed"
    contiguous = [r[0] for r in run(masks.Causal(), "contiguous")]
    assert max(contiguous) / min(contiguous) > 2, f"contiguous causal work {contiguous} should be unbalanced"
    window = run(masks.SlidingWindow(8), "contiguous")  # a window inside one shard: only rank r-1's last piece
    sent = [r[1] for r in window]
    assert sum(sent) <= N - 1, f"pieces sent per rank under a window of 8: {sent}"
    # each rank computes its own block and rank r-1's (rank 0: its own only); the N*N - (2N-1) others are skipped
    assert sum(r[0] for r in window) == (2 * N - 1) * sum(r[0] for r in full) // (N * N)
    dist.destroy_process_group()


@pytest.mark.parametrize("N", [4])
def test_zigzag_balances_causal_work_and_windows_send_little(N, tmp_path):
    _spawn(_work_and_traffic, N, tmp_path)


def _bad_inputs(rank: int, N: int, store: str) -> None:
    """Every bad input raises a clear ValueError on every rank, before anything is sent; afterwards
    the group still works."""
    _init(rank, N, store)
    B, H, D = 2, 2, 4
    x = torch.randn(B, 7, 3)
    with pytest.raises(ValueError, match=r"length 7.*multiple of 2.*Pad the sequence by 1.*ValidLens"):
        cp.shard(x)
    with pytest.raises(ValueError, match=r"length 6.*'zigzag'.*multiple of 4"):
        cp.shard(torch.randn(B, 6, 3), layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard(x, layout="striped")

    q = torch.randn(B, H, 6 if rank == 0 else 8, D)  # unequal shards
    with pytest.raises(ValueError, match=r"disagree.*rank 0: B=2, H=2, Lq=6.*rank 1: B=2, H=2, Lq=8"):
        cp.ring_attention(q, q, q)
    q = torch.randn(B, H, 8, D)
    bad = masks.Dense(torch.ones(8, 8, dtype=torch.bool)) if rank == 1 else None  # only rank 1 is wrong
    expect = r"cannot be sharded.*Dense" if rank == 1 else r"rank\(s\) \[1\] of 2 rejected"
    with pytest.raises(ValueError, match=expect):
        cp.ring_attention(q, q, q, bad)
    with pytest.raises(ValueError, match=r"disagree.*global lengths digest"):  # (B,) lengths are global: equal
        cp.ring_attention(q, q, q, masks.ValidLens(torch.tensor([5, 9 + rank])))
    with pytest.raises(ValueError, match=r"valid_lens must be <= Lk=16"):
        cp.ring_attention(q, q, q, masks.ValidLens(torch.tensor([17, 3])))
    with pytest.raises(ValueError, match=r"KeyPadding mask must have shape \(B, Lk\) = \(2, 8\)"):
        cp.ring_attention(q, q, q, masks.KeyPadding(torch.ones(B, 16, dtype=torch.bool)))  # the whole, not a shard

    # a group of one runs locally, and says so
    solo = [dist.new_group([r]) for r in range(N)][rank]
    got = cp.ring_attention(q, q, q, masks.Causal(), group=solo)
    assert torch.allclose(got, reference_attention(q, q, q, masks.Causal()), atol=1e-6)
    assert "group of size 1" in cp.explain(q, q, q, group=solo)
    dense = masks.Dense(torch.rand(8, 8) > 0.3)  # a mask of pairs: refused by the ring, fine on one rank
    got = cp.ring_attention(q, q, q, dense, group=solo)
    assert torch.allclose(got, reference_attention(q, q, q, dense), atol=1e-6)

    # the group still works, and the padding recipe of the length error holds: L=7 padded to 8
    g = torch.Generator().manual_seed(0)
    qw, kw, vw = (torch.randn(B, H, 7, D, generator=g) for _ in range(3))
    pad = [torch.nn.functional.pad(t, (0, 0, 0, 1)) for t in (qw, kw, vw)]  # (B, H, 8, D)
    out = cp.ring_attention(*(cp.shard(t, dim=2) for t in pad), masks.ValidLens(torch.tensor([7, 7])))
    whole = cp.gather(out, dim=2)[:, :, :7]
    assert (whole - reference_attention(qw, kw, vw)).abs().max() < 1e-5
    text = cp.explain(*(cp.shard(t, dim=2) for t in pad), masks.Causal(), layout="contiguous")
    assert "ring attention over N=2 ranks" in text
    dist.destroy_process_group()


def test_bad_inputs_raise_on_every_rank_without_hanging(tmp_path):
    _spawn(_bad_inputs, 2, tmp_path)


def _module(rank: int, N: int, store: str) -> None:
    """A whole module (GQA, bias) on sequence-sharded inputs under context_parallel equals the same
    module on the whole sequence: outputs and (summed over ranks) parameter gradients."""
    _init(rank, N, store)
    torch.manual_seed(0)  # the same weights and inputs on every rank
    mha = MultiHeadAttention(24, 4, bias=True, num_kv_heads=2, query_size=24, key_size=24, value_size=24)
    B, L = 2, 8 * N
    x = torch.randn(B, L, 24)
    lens = torch.tensor([L - 3, L // 2])
    for layout in cp.LAYOUTS:
        for kw in ({"valid_lens": lens}, {"mask": masks.Causal()}, {"mask": masks.Padding(lens)}):
            mha.zero_grad()
            want = mha(x, **kw)
            want.square().sum().backward()
            grads = {n: p.grad.clone() for n, p in mha.named_parameters()}
            mha.zero_grad()
            xs = cp.shard(x, layout=layout)
            with cp.context_parallel(mha, layout=layout) as sharded:
                out = mha(xs, **kw)
                out.square().sum().backward()
                if "mask" in kw and isinstance(kw["mask"], masks.Causal):
                    ex = mha.explain(xs, **kw, sharded=sharded)  # the same plan forward executes
                    text = str(ex)
                    assert text.startswith("path: sharded (sequence-sharded inputs: ring attention over 2 ranks")
                    assert ex.chosen == ("ring",) and f"layout {layout!r}, rank {rank}" in text
                    ring = ex.decisions[0][1]
                    assert "```\n" + ring + "\n```" in ex._repr_markdown_()  # shown as written, never re-parsed
            assert not mha._forward_pre_hooks  # the block's injection is gone
            again = mha(xs, **kw, sharded=cp.Sharded(layout=layout))  # the same, passed by hand
            assert torch.equal(again, out)
            what = f"{layout} {kw}"
            assert (cp.gather(out.detach(), layout=layout) - want).abs().max() < 1e-5, what
            for n, p in mha.named_parameters():
                dist.all_reduce(p.grad)
                assert (p.grad - grads[n]).abs().max() < 1e-4, f"{what} grad {n}"
    mha.train()
    mha.dropout = 0.1
    with cp.context_parallel(mha), pytest.raises(ValueError, match="dropout=0.1.*not supported on sequence-sharded"):
        mha(cp.shard(x))
    dist.destroy_process_group()


def test_module_runs_sharded_under_context_parallel(tmp_path):
    _spawn(_module, 2, tmp_path)


def test_torchrun_example_runs(tmp_path):
    """The README's example, as torchrun launches it (2 processes, small)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "multihead.examples.long_context", "--length", "256", "--hidden", "64", "--heads", "4",
         "--check", "--out", str(tmp_path / "out.safetensors")],
        capture_output=True, text=True, timeout=DEADLINE_S, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max |sharded - one process|" in proc.stdout
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "out.safetensors")
    assert saved["output"].shape == (1, 256, 64)
    assert saved["reference"].shape == (1, 256, 64)
    assert (saved["output"] - saved["reference"]).abs().max() < 1e-4


def test_bench_w6_writes_a_report_that_loads_back(tmp_path):
    """`multihead bench --workloads W6` (small): the JSON it writes loads back, agrees with itself and with the
    markdown table it wrote, and shows zigzag's balanced causal work."""
    import json

    from multihead.apps.bench import cp_bench
    from multihead_cli import main

    assert main(["bench", "--workloads", "W6", "--ranks", "2", "--cp-length", "1024", "--cp-reps", "1",
                 "--out", str(tmp_path)]) == 0
    out = tmp_path / "context_parallel"
    data = json.loads((out / "cp.json").read_text())
    assert data["config"]["ranks"] == 2 and data["config"]["L"] == 1024
    assert {(r["mask"], r["mode"]) for r in data["rows"]} == {(m, mode) for m in ("none", "causal")
                                                              for mode in ("fwd", "fwd+bwd")}
    for r in data["rows"]:
        mine = [x for x in data["ranks"] if x["mask"] == r["mask"] and x["mode"] == r["mode"]]
        assert len(mine) == 2 and r["ring_peak_mib_per_rank"] == max(x["peak_mib"] for x in mine)
        assert r["ring_s"] > 0 and r["sdpa_s"] > 0 and 0 <= r["comm_wait_share"] <= 1
    causal = [r for r in data["rows"] if r["mask"] == "causal"]
    assert all(r["layout"] == "zigzag" and r["work_max_over_min"] <= 1.1 for r in causal)
    assert (out / "cp.md").read_text() == cp_bench.table(data)

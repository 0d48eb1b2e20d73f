"""A long sequence across processes: one Transformer encoder block (causal self-attention
and a feed-forward) on a sequence sharded over every process, with ring attention.

    torchrun --nproc-per-node 2 -m multihead.examples.long_context [--length 8192] [--check]

Each rank makes the same weights and input (a real job would load its own shard), keeps its
shard of the sequence (zigzag layout: every rank does the same causal work), adds the
position encodings of its global positions, and runs the block inside
``multihead.distributed.context_parallel``: everything but attention acts token by token,
attention runs over the whole sequence through the ring. Rank 0 prints the time and, with
``--check``, the largest difference from the same block run on the whole sequence in one
process; ``--out FILE`` saves both outputs (safetensors). gloo on CPUs, NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from multihead import masks
from multihead.core import ring as cp
from multihead.models.layers import EncoderBlock, sinusoidal_positions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=8192, help="L, the whole sequence's length")
    p.add_argument("--hidden", type=int, default=256, help="E")
    p.add_argument("--heads", type=int, default=8, help="H")
    p.add_argument("--layout", choices=cp.LAYOUTS, default="zigzag")
    p.add_argument("--check", action="store_true", help="also run the whole sequence in one process and compare")
    p.add_argument("--out", help="save the gathered output (and the reference with --check) to this safetensors file")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=cp.TIMEOUT_S))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    rank, N = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights and input on every rank
    E, L = args.hidden, args.length
    block = EncoderBlock(E, args.heads, 4 * E).to(device).eval()
    x = torch.randn(1, L, E, device=device)  # (1, L, E)
    pe = sinusoidal_positions(L, E).to(device)  # (L, E)

    xs = cp.shard(x, layout=args.layout)  # (1, L/N, E)
    pos = cp.local_positions(xs.shape[1], layout=args.layout, device=device)  # (L/N,) global positions
    with torch.no_grad(), cp.context_parallel(block, layout=args.layout):
        t0 = time.perf_counter()
        ys = block(xs + pe[pos], mask=masks.Causal())  # (1, L/N, E)
        elapsed = time.perf_counter() - t0
    y = cp.gather(ys, layout=args.layout)  # (1, L, E) on every rank
    if rank == 0:
        print(f"L={L} over N={N} ranks ({args.layout}, {dist.get_backend()}): {elapsed:.2f} s; output {tuple(y.shape)}")
    tensors = {"output": y.cpu()}
    if args.check and rank == 0:
        with torch.no_grad():
            ref = block(x + pe, mask=masks.Causal())  # (1, L, E), one process
        print(f"max |sharded - one process| = {(y - ref).abs().max().item():.2e}")
        tensors["reference"] = ref.cpu()
    if args.out and rank == 0:
        from safetensors.torch import save_file

        save_file(tensors, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The ``multihead`` command."""

from __future__ import annotations

import argparse
import sys

import torch


def format_weights(w: torch.Tensor, *, digits: int = 2) -> str:
    """One head's weights (Lq, Lk) as a text grid: rows are queries, columns keys."""
    Lq, Lk = w.shape
    width = digits + 2
    head = " " * 5 + " ".join(f"{'k' + str(j):>{width}}" for j in range(Lk))
    rows = [f"q{i:<4} " + " ".join(f"{x:{width}.{digits}f}" for x in w[i].tolist()) for i in range(Lq)]
    return "\n".join([head, *rows])


def demo(args) -> int:
    from multihead import MultiHeadAttention, explain, masks
    from multihead.functional import attention_weights

    torch.manual_seed(args.seed)
    print("== the course's toy example: batch 2, 4 queries, 6 key-value pairs, 100 hiddens, 5 heads")
    num_hiddens, num_heads = 100, 5
    mha = MultiHeadAttention(num_hiddens, num_heads, dropout=0.5).eval()
    B, Lq, Lk = 2, 4, 6
    valid_lens = torch.tensor([3, 2])
    X = torch.randn(B, Lq, num_hiddens)  # (B, Lq, E)
    Y = torch.randn(B, Lk, num_hiddens)  # (B, Lk, E)
    with torch.no_grad():
        out = mha(X, Y, Y, valid_lens)
    print(f"output shape: {tuple(out.shape)}  (B, Lq, num_hiddens)")

    print("\n== which backend runs, and why (multihead.explain)")
    H, D = num_heads, num_hiddens // num_heads
    with torch.no_grad():
        q = mha.q_proj(X).view(B, Lq, H, D).transpose(1, 2)  # (B, Lq, H*D) -> (B, H, Lq, D)
        k = mha.k_proj(Y).view(B, Lk, H, D).transpose(1, 2)  # (B, Lk, H*D) -> (B, H, Lk, D)
        v = mha.v_proj(Y).view(B, Lk, H, D).transpose(1, 2)  # (B, Lk, H*D) -> (B, H, Lk, D)
        mask = masks.ValidLens(valid_lens)
        print(explain(q, k, v, mask))
        print("\n== the mask, sequence 1 (valid length 2)")
        print(mask.to_string(Lq, Lk, batch=1))
        w = attention_weights(q, k, mask)  # (B, H, Lq, Lk)
    print("\n== sequence 1, head 0: attention weights (rows sum to 1; keys >= 2 get 0)")
    print(format_weights(w[1, 0]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multihead", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the course's example and show what multihead does")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

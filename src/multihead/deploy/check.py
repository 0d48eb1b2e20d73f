"""The checks every room runs before it keeps a file: the written file run and compared with the torch model, in one
place.

Encoders (ONNX Runtime's and OpenVINO's files): :func:`verify` runs a file on two padded batches of sizes and lengths
the export never saw and holds it to float rounding on the real tokens; :func:`_refuse_full_size` refuses, before any
work, a model whose heads are cut by gates or stored as zeros. Decoders (GGUF, ONNX Runtime GenAI): the prompt checked
(:func:`_prompt`), the torch model's logits and greedy tokens with no cache (:func:`_greedy`), a file that differs
deleted with a ValueError saying by how much (:func:`_compare`); each file returned as a :class:`Served`, held to
:data:`TOLERANCE` or, for a block-quantized type (:data:`QUANTIZED`), its difference reported.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from multihead.hf.attention import attention_modules


def _refuse_full_size(model: nn.Module) -> None:
    """ValueError naming the first attention module whose heads are cut by something the weights do not hold (gates
    or other hooks that change its heads), or whose heads are stored as zeros (a pruned model read at full size):
    either would be written as the full-size model with zeros."""
    from multihead.heads.surgery import out_in

    for name, m in attention_modules(model).items():
        hooks = m.attention_hooks
        if hooks.transforms:
            raise ValueError(f"export: {name} ({type(m).__name__}) has hooks that change its heads (heads.gated or a "
                             "transform): the file would compute the full-size model with them; cut the heads with "
                             "heads.prune (or leave the hooks' context) before exporting.")
        layout = hooks.layout
        if layout is None:
            continue
        o = layout.projections(m, hooks.parent)[3]
        H, D = out_in(o).shape[1] // layout.head_dim(m), layout.head_dim(m)
        if H < 2:  # no head, or the one a family that cannot run without heads keeps (zero columns, by design)
            continue
        cols = out_in(o).detach().reshape(-1, H, D)  # (E, H, D): head h's output columns
        zero = [h for h in range(H) if not bool(cols[:, h].any())]
        if zero:
            raise ValueError(f"export: {name} ({type(m).__name__}) holds heads {zero} of {H} whose output weights are "
                             "all zero (a pruned model read at full size, as AutoModel.from_pretrained reads a prune "
                             "--hf folder): load it with multihead.hf.load(DIR), which cuts them, to export it at its "
                             "pruned size.")


def verify(model: nn.Module, run, names: list[str], what: str) -> float:
    """Run ``run`` ({name: ndarray (B, L)} -> ndarray) on two padded batches of sizes and lengths the export never
    saw and compare with the torch model on the real tokens: the largest difference, which must stay within
    float rounding (1e-4 of the output's scale, at least 1e-4) or RuntimeError names the file and the figure."""
    worst = 0.0
    vocab = int(getattr(model.config, "vocab_size", 100) or 100)
    for B, L in ((3, 11), (1, 5)):
        g = torch.Generator().manual_seed(B * 100 + L)
        ids = torch.randint(3, min(vocab, 1000), (B, L), generator=g)  # (B, L)
        am = torch.ones(B, L, dtype=torch.long)  # (B, L)
        am[B - 1, max(1, L // 3):] = 0
        x = {"input_ids": ids, "attention_mask": am}
        if "token_type_ids" in names:
            x["token_type_ids"] = (torch.arange(L) >= L // 2).long().expand(B, L).contiguous()  # (B, L)
        got = torch.from_numpy(run({n: x[n].numpy() for n in names}))
        with torch.no_grad():
            want = model(**x)[0]  # (B, L, E) or (B, L, V)
        keep = am.bool()
        err = float((got[keep] - want[keep]).abs().max())
        scale = float(want[keep].abs().max())
        if not err <= 1e-4 * max(1.0, scale):
            raise RuntimeError(f"export: {what} computes outputs {err:.3g} away from the torch model's (scale "
                               f"{scale:.3g}) at batch {B}, length {L}: the file is not the model; please report it.")
        worst = max(worst, err)
    return worst


# --- decoders: a file's logits and greedy tokens against the torch model's ---


#: the largest |logit difference| accepted, relative to the largest |logit| of the torch model: fp32 files hold
#: the weights exactly (the difference is summation order); fp16 rounds each weight to 11 bits
TOLERANCE = {"f32": 1e-4, "f16": 2e-2, "fp32": 1e-4}


#: GGUF types quantized in blocks (gguf's own quantizer): the file's logits move by the quantization, so
#: export_gguf reports their difference and the greedy tokens that agree instead of holding them to a tolerance; a
#: caller judges the file by its perplexity beside the unpruned model's at the same type (``multihead prune`` does)
QUANTIZED = {"q8_0": "Q8_0", "int4": "int4"}


@dataclass
class Served:
    """A runtime's file, checked: ``max_logit_diff`` = max |logits - torch logits| over the prompt's positions
    (GenAI: its last position, the logits its generator gives), ``tolerance`` the bound it was held to, ``tokens`` the
    greedy tokens the runtime produced (equal to the torch model's), ``counts`` (H, Hkv, D) written: a list of them,
    one per layer, for an uneven cut's GGUF file (then no runtime ran it: ``max_logit_diff`` and ``tolerance`` are
    NaN, ``tokens`` empty, and ``checks`` says where it loads)."""

    path: Path
    runtime: str
    max_logit_diff: float
    tolerance: float
    tokens: list[int]
    counts: tuple[int, int, int] | list[tuple[int, int, int]]
    checks: list[str] = field(default_factory=list)


def _prompt(model: nn.Module, prompt_ids, new_tokens: int, what: str) -> Tensor:
    cfg = model.config
    if prompt_ids is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, int(cfg.vocab_size), (1, 16), generator=g)  # (1, L)
    ids = torch.as_tensor(prompt_ids)
    if ids.dtype not in (torch.int32, torch.int64) or ids.ndim not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(f"{what}: prompt_ids must be token ids, shape (L,) or (1, L); got {tuple(ids.shape)} "
                         f"{ids.dtype}.")
    ids = ids.reshape(1, -1).long()  # (1, L)
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"{what}: prompt_ids hold ids outside the vocabulary 0..{cfg.vocab_size - 1}.")
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] + new_tokens > limit:
        raise ValueError(f"{what}: a prompt of {ids.shape[1]} tokens plus {new_tokens} new ones is longer than the "
                         f"model's {limit} positions; give a shorter prompt.")
    return ids


@torch.no_grad()
def _greedy(model: nn.Module, ids: Tensor, n: int) -> tuple[Tensor, list[int]]:
    """(the prompt's logits (1, L, V) in float32, the next n greedy tokens): every step runs the whole sequence, no
    cache, no end-of-text stop, so the reference depends on nothing but the weights."""
    logits = model(input_ids=ids).logits.float()  # (1, L, V)
    seq, out = ids, []
    last = logits[:, -1]  # (1, V)
    for _ in range(n):
        t = int(last.argmax(-1))
        out.append(t)
        seq = torch.cat([seq, seq.new_tensor([[t]])], dim=1)  # (1, L + step)
        last = model(input_ids=seq).logits[:, -1].float()  # (1, V)
    return logits, out


def _compare(what: str, path: Path, diff: float, tol: float, got: list[int], want: list[int]) -> None:
    if diff > tol or got != want:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        raise ValueError(f"{what}: the file differs from the torch model (max |logit difference| {diff:.3g}, "
                         f"tolerance {tol:.3g}; greedy tokens {got} vs {want}); it was deleted.")

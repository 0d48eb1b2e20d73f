"""Decoding speed in the runtimes decoders are served by: a written file against its peer (the unpruned model made
into the same format by the runtime's own tools), decode tokens/s at batch 1 after a prompt of n tokens, prefill
time, peak memory, beside the bound of the work removed.

    bound = lambda n: decode_macs(shape, [(9, 3)] * 30, n) / decode_macs(shape, [(6, 2)] * 30, n)
    rows = decode_table({"gguf-q8_0": ("llama.cpp", peer_file, pruned_file)}, [256, 2048, 8192], vocab=49152,
                        bound=bound)
    print(markdown(rows))

Each measurement is one fresh process (this file run by its path: it imports neither torch nor multihead, so the
runtime alone is in it and its peak resident memory, its VmHWM, is the runtime's): load, one untimed warm-up, then
the prompt (random ids, seeded by n) prefilled, then ``decode`` tokens decoded one at a time, greedy, each step timed;
a measurement's tokens/s is one over its median step (a step slowed by another process on the machine does not move
it, where the total over ``decode`` steps would). The peer and the pruned file alternate within each round (their
order swapped every round), every format and context in every round; a row gives the median over rounds and the
spread (min-max), and the speed-up is the ratio of the medians.

The bound (:func:`decode_macs`): a decoded token's multiply-adds -- per layer the projections E*(H*D) + 2*E*(Hkv*D)
+ (H*D)*E, the MLP 3*E*F, attention over a cache of n tokens 2*n*H*D (a sliding-window layer's over its last
w: :func:`attention_windows`) -- plus the output head E*V; "of bound" is the
measured gain's share of the bound's gain ((speed-up - 1) / (bound - 1)).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["RUNTIMES", "attention_windows", "decode_macs", "decode_table", "markdown", "measure"]

#: the runtimes a decoder file is timed in: {name: the Python module that runs it}
RUNTIMES = {"llama.cpp": "llama_cpp", "genai": "onnxruntime_genai"}


def decode_macs(shape: Mapping[str, int], counts: Sequence[tuple[int, int]], n: int,
                windows: Sequence[int | None] | None = None) -> float:
    """Multiply-adds of one decoded token at a cache of ``n`` tokens, the output head included, for a decoder of
    ``shape`` ({"E", "F", "V", "D"}: width, MLP width, vocabulary, head size) whose layers keep ``counts``: one
    (H, Hkv) a layer, query and key/value heads. ``windows``: a layer's sliding window (it attends to the last w
    tokens: min(n, w) of the cache), None for a full layer; one a layer (Gemma 3: five sliding layers to a full one),
    None: every layer full."""
    E, F, V, D = (shape[k] for k in ("E", "F", "V", "D"))
    windows = [None] * len(counts) if windows is None else list(windows)
    if len(windows) != len(counts):
        raise ValueError(f"windows: {len(windows)} given for {len(counts)} layers; give one a layer (None: full).")
    spans = [n if w is None else min(n, w) for w in windows]
    return sum(E * H * D + 2 * E * Hkv * D + H * D * E + 3 * E * F + 2 * m * H * D
               for (H, Hkv), m in zip(counts, spans)) + E * V


def attention_windows(config) -> list[int | None]:
    """Each layer's sliding window from a transformers config whose ``layer_types`` name its sliding layers
    ("sliding_attention": Gemma 3's, llama.cpp's ``gemma3`` architecture too), None for a layer that attends to the
    whole cache. A config without ``layer_types`` counts every layer full (Mistral's ``sliding_window``: its GGUF is
    llama.cpp's ``llama`` architecture, which attends to the whole cache)."""
    w, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if not types:
        return [None] * config.num_hidden_layers
    return [w if t == "sliding_attention" and w else None for t in types]


def measure(runtime: str, path: str | Path, n: int, *, decode: int, vocab: int, threads: int) -> dict:
    """One measurement in a fresh process: {"prefill_ms", "decode_tps", "peak_mb"} of ``path`` run by ``runtime``
    (:data:`RUNTIMES`): a prompt of ``n`` tokens, then ``decode`` tokens; RuntimeError naming the file when the
    process fails."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime={runtime!r}; the decoder runtimes are {', '.join(RUNTIMES)}.")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, __file__, runtime, str(path), str(n), str(decode), str(vocab), str(threads)],
                         capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{runtime} on {path} at {n} tokens failed: {run.stderr.strip()[-600:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def decode_table(pairs: Mapping[str, tuple[str, Path, Path]], contexts: Sequence[int], *, vocab: int,
                 bound: Callable[[int], float], rounds: int = 3, decode: int = 16, threads: int = 2,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
    """``pairs``: {label: (runtime, the peer's file, the pruned file)} timed at every context of ``contexts`` (the
    cache's length when the last of ``decode`` tokens is decoded: a prompt of n - ``decode`` tokens) for ``rounds``
    interleaved rounds (:func:`measure`); ``bound(n)``: the work removed at a cache of n tokens, as a speed-up
    (unpruned multiply-adds over pruned). Returns a row a label and context: the medians and spreads of both, the
    speed-up, the bound and its share."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a whole number >= 1; got {rounds!r}.")
    if isinstance(decode, bool) or not isinstance(decode, int) or decode < 1:
        raise ValueError(f"decode must be a whole number of tokens >= 1; got {decode!r}.")
    if not contexts or any(isinstance(n, bool) or not isinstance(n, int) or n <= decode for n in contexts):
        raise ValueError(f"contexts must be whole numbers of tokens above decode={decode} (the prompt is n - decode); "
                         f"got {list(contexts)!r}.")
    got: dict[tuple[str, int, str], list[dict]] = {}
    for r in range(rounds):
        order = ("peer", "pruned") if r % 2 == 0 else ("pruned", "peer")
        for n in contexts:
            for label, (runtime, peer, pruned) in pairs.items():
                for variant in order:
                    m = measure(runtime, peer if variant == "peer" else pruned, n - decode, decode=decode,
                                vocab=vocab, threads=threads)
                    got.setdefault((label, n, variant), []).append(m)
                    if progress is not None:
                        progress(f"round {r + 1} {label} {variant} {n}: {m['decode_tps']:.1f} tok/s, "
                                 f"prefill {m['prefill_ms']:.0f} ms")
    rows = []
    for label, (runtime, _, _) in pairs.items():
        for n in contexts:
            p, q = got[label, n, "peer"], got[label, n, "pruned"]
            speed = (statistics.median(x["decode_tps"] for x in q) / statistics.median(x["decode_tps"] for x in p))
            b = float(bound(n))
            rows.append({"format": label, "runtime": runtime, "context": n, "rounds": rounds, "decode": decode,
                         "threads": threads, "peer": _stats(p), "pruned": _stats(q), "speedup": speed, "bound": b,
                         "of_bound": (speed - 1) / (b - 1) if b > 1 else None})
    return rows


def _stats(ms: list[dict]) -> dict:
    return {k: {"median": statistics.median(x[k] for x in ms), "min": min(x[k] for x in ms),
                "max": max(x[k] for x in ms)} for k in ("decode_tps", "prefill_ms", "peak_mb")}


def markdown(rows: Sequence[dict], kv_bytes: Mapping[str, tuple[int, int]] | None = None) -> str:
    """The table of :func:`decode_table`'s rows; ``kv_bytes``: {label: (the peer's, the pruned file's) KV-cache
    bytes a token} where known."""
    def cell(s: dict, key: str, fmt: str) -> str:
        v = s[key]
        return f"{format(v['median'], fmt)} ({format(v['min'], fmt)}-{format(v['max'], fmt)})"

    out = ["| format | runtime | context | model | decode tok/s | prefill ms | KV bytes/token | peak MB | speed-up | "
           "bound | of bound |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kv = (kv_bytes or {}).get(r["format"])
        for i, variant in enumerate(("peer", "pruned")):
            s = r[variant]
            extra = (f"{r['speedup']:.2f}x | {r['bound']:.2f}x | "
                     + ("" if r["of_bound"] is None else f"{r['of_bound']:.0%}")) if variant == "pruned" else " | | "
            out.append(f"| {r['format']} | {r['runtime']} | {r['context']} | "
                       f"{'the peer (unpruned)' if variant == 'peer' else 'pruned'} | {cell(s, 'decode_tps', '.1f')} | "
                       f"{cell(s, 'prefill_ms', '.0f')} | {'' if kv is None else format(kv[i], ',')} | "
                       f"{cell(s, 'peak_mb', '.0f')} | {extra} |")
    return "\n".join(out)


# --- the worker: this file run by its path, one measurement ---


def _peak_mb() -> float:
    """This process's peak resident memory: VmHWM (its own address space's high-water mark; ru_maxrss would carry
    the parent's peak across fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _genai(path: str, ids, decode: int, threads: int) -> tuple[float, list[float]]:
    import onnxruntime_genai as og

    cfg = og.Config(path)
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(cfg)
    warm = og.GeneratorParams(model)
    warm.set_search_options(max_length=24, min_length=24, do_sample=False)
    w = og.Generator(model, warm)  # the session's first run (allocations, kernel choice) is not timed
    w.append_tokens(ids[None, :16])
    for _ in range(4):
        w.generate_next_token()
    del w
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + decode, min_length=len(ids) + decode, do_sample=False)
    gen = og.Generator(model, params)
    t = time.perf_counter()
    gen.append_tokens(ids[None])  # (1, n)
    prefill = time.perf_counter() - t
    steps = []
    for _ in range(decode):
        t = time.perf_counter()
        gen.generate_next_token()
        steps.append(time.perf_counter() - t)
    return prefill, steps


def _llama(path: str, ids, decode: int, threads: int, vocab: int) -> tuple[float, list[float]]:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=len(ids) + decode, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    llm.eval(ids[:16].tolist())  # the first run (allocations) is not timed
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids.tolist())
    prefill = time.perf_counter() - t
    steps = []
    for _ in range(decode):
        t = time.perf_counter()
        # the last token's logits from the context (without logits_all, 0.3.36 keeps none in llm.scores)
        tok = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))
        llm.eval([tok])
        steps.append(time.perf_counter() - t)
    return prefill, steps


def _worker(runtime: str, path: str, n: int, decode: int, vocab: int, threads: int) -> dict:
    import numpy as np

    ids = np.random.default_rng(n).integers(100, vocab, n).astype(np.int32)  # (n,) the prompt
    prefill, steps = (_genai(path, ids, decode, threads) if runtime == "genai"
                      else _llama(path, ids, decode, threads, vocab))
    return {"prefill_ms": prefill * 1e3, "decode_tps": 1 / statistics.median(steps), "peak_mb": _peak_mb()}


if __name__ == "__main__":  # one measurement: runtime path n decode vocab threads
    rt, p, n_, d_, v_, t_ = sys.argv[1:7]
    print(json.dumps(_worker(rt, p, int(n_), int(d_), int(v_), int(t_))))

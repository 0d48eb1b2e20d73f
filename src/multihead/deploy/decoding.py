"""Decoding speed in the runtimes decoders are served by: a written file against its peer (the unpruned model made
into the same format by the runtime's own tools), decode tokens/s at batch 1 after a prompt of n tokens, prefill
time, peak memory, beside the bound of the work removed.

    bound = lambda n: decode_macs(shape, [(9, 3)] * 30, n) / decode_macs(shape, [(6, 2)] * 30, n)
    rows = decode_table({"gguf-q8_0": ("llama.cpp", peer_file, pruned_file)}, [256, 2048, 8192], vocab=49152,
                        bound=bound)
    print(markdown(rows))

Each file runs in a fresh process of its own (this file run by its path: it imports neither torch nor multihead, so
the runtime alone is in it and its peak resident memory, its VmHWM, is the runtime's): load, one untimed warm-up,
then the prompt (random ids, seeded by n) prefilled, then ``decode`` tokens decoded one at a time, greedy, each step
timed; a file's tokens/s is one over its median step (a step slowed by another process on the machine does not move
it, where the total over ``decode`` steps would).

The peer and the pruned file are timed as a pair (:func:`measure_pair`): both processes loaded and prefilled, one
after the other, then their decode steps in alternation (peer, pruned, pruned, peer, ...), one step at a time, so
each step of one has a step of the other beside it under the same load on the machine. The pair's speed-up is the
median over the decode steps of the peer's step over the pruned file's: a load that comes and goes slows both sides
of a pair alike, where two measurements a minute apart (a prefill of 8192 tokens takes that) see different loads.
Every format and context is measured in every round, the pair's order swapped every round; a row gives the medians
over rounds with their spread (min-max), the speed-up the median of the rounds' paired speed-ups with theirs.

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

__all__ = ["RUNTIMES", "attention_windows", "decode_macs", "decode_table", "markdown", "measure", "measure_pair"]

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


_MARK = "@multihead.decoding "

#: seconds between one process's decode step and the other's: a runtime's threads spin a while after their work
#: (llama.cpp's OpenMP threads: libgomp's 300,000 spins), which would take the other process's cores. Measured with
#: a file paired with itself (SmolLM2's Q8_0 and GenAI int4, 2048 tokens, 2 threads, 2 rounds): with no gap llama.cpp
#: read 1.23x and 1.22x, at 48-65 tok/s where the file alone ran 68-81; with 50 ms, 1.000x and 0.995x at 69-73
#: tok/s; GenAI 1.01x and 1.00x at 52-54 tok/s (alone 94), with 50 ms 1.00x and 0.99x at 85-90
GAP = 0.05


class _Stepper:
    """One file in its worker process (``serve`` mode), prefilled, stepped one decoded token at a time on request."""

    def __init__(self, runtime: str, path: str | Path, n: int, *, decode: int, vocab: int, threads: int, log: Path):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        self.path, self.err = path, log.open("w+")
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", runtime, str(path), str(n), str(decode),
                                      str(vocab), str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=env)
        self.prefill_ms = self._read()["prefill_ms"]  # loaded, warmed up and prefilled

    def _read(self):
        for line in self.proc.stdout:  # the runtime's own prints pass by: the worker's lines carry its mark
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK):])
        self.proc.wait()
        self.err.seek(0)
        raise RuntimeError(f"the worker on {self.path} failed: {self.err.read().strip()[-600:]}")

    def step(self) -> float:
        """Seconds of one decode step, timed in the worker."""
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._read()["step_s"]

    def end(self) -> float:
        """The worker's peak resident memory in MB; it exits."""
        self.proc.stdin.write("end\n")
        self.proc.stdin.flush()
        peak = self._read()["peak_mb"]
        self.proc.stdin.close()
        self.proc.wait(timeout=60)  # it returns after that line
        self.kill()
        return peak

    def kill(self) -> None:
        """The worker ended (killed if it still runs), its pipes and log closed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.err):
            if not f.closed:
                f.close()


def measure_pair(runtime: str, peer: str | Path, pruned: str | Path, n: int, *, decode: int, vocab: int,
                 threads: int, first: str = "peer", gap: float = GAP) -> dict:
    """The peer and the pruned file, each in a fresh process of its own, prefilled one after the other (``first``
    first) with the same prompt of ``n`` tokens, then decoding ``decode`` tokens in alternation, one step at a time
    (the pair's order swapped every step: peer, pruned, pruned, peer, ...). {"peer": m, "pruned": m, "speedup"}:
    each m {"prefill_ms", "decode_tps" (one over the median step), "peak_mb" (that process's own)}; the speed-up is
    the median over the steps of the peer's step over the pruned file's beside it. ``gap``: seconds waited before each
    step (:data:`GAP`), so that the other process's threads, spinning a while after its step, are asleep when this
    one runs. RuntimeError naming the file when a worker fails."""
    import tempfile

    if runtime not in RUNTIMES:
        raise ValueError(f"runtime={runtime!r}; the decoder runtimes are {', '.join(RUNTIMES)}.")
    if first not in ("peer", "pruned"):
        raise ValueError(f"first={first!r}; give 'peer' or 'pruned'.")
    files = {"peer": peer, "pruned": pruned}
    order = (first, "pruned" if first == "peer" else "peer")
    workers: dict[str, _Stepper] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for side in order:  # one prefill at a time: the other process waits, idle
                workers[side] = _Stepper(runtime, files[side], n, decode=decode, vocab=vocab, threads=threads,
                                         log=Path(tmp) / side)
            steps: dict[str, list[float]] = {"peer": [], "pruned": []}
            for i in range(decode):
                for side in (order if i % 2 == 0 else order[::-1]):
                    time.sleep(gap)  # the other process's threads, spinning after its step, gone to sleep
                    steps[side].append(workers[side].step())
            peaks = {side: workers[side].end() for side in order}
        finally:
            for w in workers.values():
                w.kill()
    out = {side: {"prefill_ms": workers[side].prefill_ms, "decode_tps": 1 / statistics.median(steps[side]),
                  "peak_mb": peaks[side]} for side in ("peer", "pruned")}
    out["speedup"] = statistics.median(a / b for a, b in zip(steps["peer"], steps["pruned"]))
    return out


def decode_table(pairs: Mapping[str, tuple[str, Path, Path]], contexts: Sequence[int], *, vocab: int,
                 bound: Callable[[int], float], rounds: int = 3, decode: int = 16, threads: int = 2,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
    """``pairs``: {label: (runtime, the peer's file, the pruned file)} timed at every context of ``contexts`` (the
    cache's length when the last of ``decode`` tokens is decoded: a prompt of n - ``decode`` tokens) for ``rounds``
    rounds, each file beside its peer (:func:`measure_pair`); ``bound(n)``: the work removed at a cache of n tokens,
    as a speed-up (unpruned multiply-adds over pruned). Returns a row a label and context: the medians and spreads of
    both, the speed-up (the median of the rounds' paired speed-ups) and its spread, the bound and its share."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a whole number >= 1; got {rounds!r}.")
    if isinstance(decode, bool) or not isinstance(decode, int) or decode < 1:
        raise ValueError(f"decode must be a whole number of tokens >= 1; got {decode!r}.")
    if not contexts or any(isinstance(n, bool) or not isinstance(n, int) or n <= decode for n in contexts):
        raise ValueError(f"contexts must be whole numbers of tokens above decode={decode} (the prompt is n - decode); "
                         f"got {list(contexts)!r}.")
    got: dict[tuple[str, int], list[dict]] = {}
    for r in range(rounds):
        for n in contexts:
            for label, (runtime, peer, pruned) in pairs.items():
                m = measure_pair(runtime, peer, pruned, n - decode, decode=decode, vocab=vocab, threads=threads,
                                 first="peer" if r % 2 == 0 else "pruned")
                got.setdefault((label, n), []).append(m)
                if progress is not None:
                    progress(f"round {r + 1} {label} {n}: the peer {m['peer']['decode_tps']:.1f} tok/s, pruned "
                             f"{m['pruned']['decode_tps']:.1f} tok/s, paired {m['speedup']:.2f}x; prefill "
                             f"{m['peer']['prefill_ms']:.0f} and {m['pruned']['prefill_ms']:.0f} ms")
    rows = []
    for label, (runtime, _, _) in pairs.items():
        for n in contexts:
            ms = got[label, n]
            speeds = [m["speedup"] for m in ms]
            speed, b = statistics.median(speeds), float(bound(n))
            rows.append({"format": label, "runtime": runtime, "context": n, "rounds": rounds, "decode": decode,
                         "threads": threads, "peer": _stats([m["peer"] for m in ms]),
                         "pruned": _stats([m["pruned"] for m in ms]), "speedup": speed,
                         "speedup_spread": {"min": min(speeds), "max": max(speeds)}, "bound": b,
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
            spread = r.get("speedup_spread")
            rng = "" if not spread else f" ({spread['min']:.2f}-{spread['max']:.2f})"
            extra = (f"{r['speedup']:.2f}x{rng} | {r['bound']:.2f}x | "
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


def _genai(path: str, ids, decode: int, threads: int) -> tuple[float, Callable[[], float]]:
    """Loaded, warmed up and ``ids`` prefilled: (the prefill's seconds, one decode step returning its seconds)."""
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

    def step() -> float:
        t = time.perf_counter()
        gen.generate_next_token()
        return time.perf_counter() - t
    return prefill, step


def _llama(path: str, ids, decode: int, threads: int, vocab: int) -> tuple[float, Callable[[], float]]:
    """As :func:`_genai`, in llama.cpp."""
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

    def step() -> float:
        t = time.perf_counter()
        # the last token's logits from the context (without logits_all, 0.3.36 keeps none in llm.scores)
        tok = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))
        llm.eval([tok])
        return time.perf_counter() - t
    return prefill, step


def _prepare(runtime: str, path: str, n: int, decode: int, vocab: int, threads: int):
    import numpy as np

    ids = np.random.default_rng(n).integers(100, vocab, n).astype(np.int32)  # (n,) the prompt
    return _genai(path, ids, decode, threads) if runtime == "genai" else _llama(path, ids, decode, threads, vocab)


def _worker(runtime: str, path: str, n: int, decode: int, vocab: int, threads: int) -> dict:
    prefill, step = _prepare(runtime, path, n, decode, vocab, threads)
    steps = [step() for _ in range(decode)]
    return {"prefill_ms": prefill * 1e3, "decode_tps": 1 / statistics.median(steps), "peak_mb": _peak_mb()}


def _serve(runtime: str, path: str, n: int, decode: int, vocab: int, threads: int) -> None:
    """:class:`_Stepper`'s side: prefilled, then one line in, one line out: "step" (its seconds), "end" (the peak)."""
    prefill, step = _prepare(runtime, path, n, decode, vocab, threads)
    print(_MARK + json.dumps({"prefill_ms": prefill * 1e3}), flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            print(_MARK + json.dumps({"step_s": step()}), flush=True)
        elif line.strip() == "end":
            print(_MARK + json.dumps({"peak_mb": _peak_mb()}), flush=True)
            return


if __name__ == "__main__":  # one measurement: runtime path n decode vocab threads; or "serve" and the same
    if sys.argv[1] == "serve":
        rt, p, n_, d_, v_, t_ = sys.argv[2:8]
        _serve(rt, p, int(n_), int(d_), int(v_), int(t_))
    else:
        rt, p, n_, d_, v_, t_ = sys.argv[1:7]
        print(json.dumps(_worker(rt, p, int(n_), int(d_), int(v_), int(t_))))

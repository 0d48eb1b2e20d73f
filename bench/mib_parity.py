"""MIB's own evaluation code against the library's, on the same graph file (issue 81, point 3).

For a GPT-2-shaped and a Qwen2-shaped model (tiny random configs, SmolLM2's tokenizer): the library scores the edges
of MIB's graph over a small IOI-style dataset (``heads.dataset_attribution``, EAP), writes them with
``heads.write_mib_graph``, and computes f at MIB's budgets, CPR and CMD (``heads.dataset_faithfulness_curve``, the pruned
construction). MIB's ``evaluate_area_under_curve`` (MIB-circuit-track, on EAP-IG's ``eap`` package and TransformerLens'
HookedTransformer built from the same weights) reads the same file and computes the same figures. Writes a markdown
table of both sides and their difference.

MIB's code is never part of the project: it is imported from the snapshot paths given on the command line, in a
separate environment (an older transformer_lens 2.x). Run as:

    PYTHONPATH=src /work/mib-venv/bin/python bench/mib_parity.py --eap /work/mib-src/EAP-IG/src \\
        --mib /work/mib-src/MIB --out bench/results/mib_parity.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

NAMES = [" Mary", " John", " Tom", " James", " Anna", " Sarah", " David", " Paul"]
TEMPLATES = ["When{a} and{b} went to the store,{b} gave a drink to",
             "After{a} and{b} met at the park,{b} handed the ball to",
             "Then{a} and{b} had a long talk at the old house;{b} passed the book to"]


def pairs_text(n: int = 8):
    """IOI-style pairs of several lengths: clean (A and B, B gave to -> A) and corrupted (the names replaced by two
    others, the same token count); answers (A, B)."""
    clean, corrupted, answers = [], [], []
    for i in range(n):
        t = TEMPLATES[i % len(TEMPLATES)]
        a, b = NAMES[i % 8], NAMES[(i + 3) % 8]
        c, d = NAMES[(i + 5) % 8], NAMES[(i + 6) % 8]
        clean.append(t.format(a=a, b=b))
        corrupted.append(t.format(a=c, b=d))
        answers.append((a, b))
    return clean, corrupted, answers


def models(family: str, vocab: int):
    """(the transformers model, TransformerLens' HookedTransformerConfig, its weight conversion) of a tiny config."""
    import transformers as T
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained import weight_conversions as W

    torch.manual_seed(0)
    if family == "gpt2":
        hf = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=3, n_head=4))
        cfg = HookedTransformerConfig(d_model=64, d_head=16, n_heads=4, d_mlp=256, n_layers=3, n_ctx=64,
                                      d_vocab=vocab, act_fn="gelu_new", normalization_type="LN", eps=1e-5,
                                      positional_embedding_type="standard", original_architecture="GPT2LMHeadModel",
                                      default_prepend_bos=True)
        return hf.eval(), cfg, W.convert_gpt2_weights
    hc = T.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)
    hf = T.Qwen2ForCausalLM(hc)
    cfg = HookedTransformerConfig(d_model=64, d_head=16, n_heads=4, n_key_value_heads=2, d_mlp=128, n_layers=3,
                                  n_ctx=64, d_vocab=vocab, act_fn="silu", normalization_type="RMS",
                                  eps=hc.rms_norm_eps, positional_embedding_type="rotary", rotary_dim=16,
                                  rotary_base=int(getattr(hc, "rope_theta", None) or hc.rope_parameters["rope_theta"]),
                                  rotary_adjacent_pairs=False, gated_mlp=True, final_rms=True,
                                  original_architecture="Qwen2ForCausalLM", default_prepend_bos=True)
    return hf.eval(), cfg, W.convert_qwen2_weights


def hooked(hf, cfg, convert, tok):
    """TransformerLens' HookedTransformer with ``hf``'s weights, no folding, configured as MIB runs it."""
    from transformer_lens import HookedTransformer

    tl = HookedTransformer(cfg, tokenizer=tok)
    tl.load_and_process_state_dict(convert(hf, cfg), fold_ln=False, center_writing_weights=False,
                                   center_unembed=False, fold_value_biases=False,
                                   refactor_factored_attn_matrices=False)
    tl.set_use_attn_result(True)
    tl.set_use_split_qkv_input(True)
    tl.set_use_hook_mlp_in(True)
    if cfg.n_key_value_heads is not None:
        tl.set_ungroup_grouped_query_attention(True)
    return tl.eval()


def one(family: str, tok, out_dir: Path) -> dict:
    from eap.graph import Graph
    from MIB_circuit_track.evaluation import evaluate_area_under_curve
    from MIB_circuit_track.metrics import get_metric

    import multihead.hf as mhf
    from multihead import heads

    hf, cfg, convert = models(family, len(tok))
    tl = hooked(hf, cfg, convert, tok)
    clean, corrupted, answers = pairs_text()
    pairs = heads.prompt_pairs(clean, corrupted, answers, tokenizer=tok, bos=True)
    toks = tl.to_tokens(clean, prepend_bos=True, padding_side="right")
    assert torch.equal(toks.cpu(), pairs.clean[:, :toks.shape[1]]), "the two sides tokenize differently"
    mask = (torch.arange(toks.shape[1])[None] < pairs.lengths[:, None]).long()  # (N, L)
    with torch.no_grad():
        off = float((tl(toks, attention_mask=mask) - hf(input_ids=toks, attention_mask=mask).logits).abs()
                    .mul(mask[..., None]).max())
    assert off < 1e-3, f"{family}: TransformerLens' logits differ from transformers' by {off}"
    model = mhf.attach(hf)
    t0 = time.perf_counter()
    scores = heads.dataset_attribution(model, pairs, method="eap", ungroup=True, batch_size=len(pairs))
    ours = heads.dataset_faithfulness_curve(model, pairs, scores, how="pruned", batch_size=len(pairs))
    t_ours = time.perf_counter() - t0
    path = heads.write_mib_graph(scores, out_dir / f"{family}.json", scores.circuit(0.05))
    labels = [[int(a), int(b)] for a, b in pairs.answers.tolist()]
    loader = [(clean, corrupted, labels)]  # one batch: MIB's mean of batch means is the mean over the pairs
    graph = Graph.from_json(str(path))
    t0 = time.perf_counter()
    counts, cpr, cmd, _, faith = evaluate_area_under_curve(tl, graph, loader, get_metric("logit_diff", "ioi"),
                                                           quiet=True, absolute=True, intervention="patching")
    t_mib = time.perf_counter() - t0
    c = ours["pruned"]
    same = []  # per budget: MIB's circuit as evaluate_graph runs it (apply_topn, pruned, prune again) == ours
    for b in heads.MIB_BUDGETS:
        mine = heads.write_mib_graph(scores, out_dir / "budget.json", scores.circuit(b))
        want = {n for n, e in json.loads(mine.read_text())["edges"].items() if e["in_graph"]}
        graph.apply_topn(int(b * len(graph.edges)), True, prune=True)
        graph.prune()
        same.append({n for n, e in graph.edges.items() if e.in_graph} == want)
    return {"family": family, "edges": len(scores.edges), "mib_edges": int(graph.real_edge_mask.sum()),
            "logits_off": off, "same_circuits": same, "ours": {"kept": c.kept, "f": c.f, "cpr": c.cpr, "cmd": c.cmd, "s": t_ours},
            "mib": {"kept": [int(x) for x in counts], "f": [float(x) for x in faith], "cpr": float(cpr),
                    "cmd": float(cmd), "s": t_mib}}


def markdown(rows: list[dict], argv: list[str]) -> str:
    lines = ["# MIB's evaluation code against the library's, on the same graph file", "",
             f"Command: `{' '.join(argv)}` ({platform.processor() or platform.machine()}, torch {torch.__version__}).",
             "Both sides read the same file written by `heads.write_mib_graph` (EAP scores over 8 IOI-style pairs of "
             "3 lengths, padded on the right, SmolLM2's tokenizer, tiny random weights: 3 layers, 4 heads; Qwen2: 2 "
             "key/value heads, MIB's ungrouped graph). MIB: MIB-circuit-track's `evaluate_area_under_curve` on "
             "TransformerLens' HookedTransformer with the same weights (its logits within the `logits off` figure of "
             "transformers'). The library: `heads.dataset_faithfulness_curve(..., how=\"pruned\")`.", "",
             "| model | edges (ours / MIB's) | logits off | CPR ours | CPR MIB | |diff| | CMD ours | CMD MIB | |diff| "
             "| max |f diff| over budgets | circuits equal (edge names, every budget) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, m = r["ours"], r["mib"]
        df = max(abs(a - b) for a, b in zip(o["f"], m["f"], strict=True))
        lines.append(f"| {r['family']} | {r['edges']} / {r['mib_edges']} | {r['logits_off']:.1e} | {o['cpr']:.6f} | "
                     f"{m['cpr']:.6f} | {abs(o['cpr'] - m['cpr']):.1e} | {o['cmd']:.6f} | {m['cmd']:.6f} | "
                     f"{abs(o['cmd'] - m['cmd']):.1e} | {df:.1e} | {sum(r['same_circuits'])} of {len(r['same_circuits'])} |")
    lines += ["", "f at each budget, ours / MIB's (edges kept: ours / MIB's `weighted_edge_count`, which MIB reads after "
              "`apply_topn` and before `evaluate_graph` prunes once more; the circuits evaluated are compared by name "
              "in the table):", ""]
    for r in rows:
        o, m = r["ours"], r["mib"]
        lines.append(f"- {r['family']}: " + "; ".join(f"{a:.4f} / {b:.4f} ({k} / {w})" for a, b, k, w in
                                                       zip(o["f"], m["f"], o["kept"], m["kept"], strict=True)))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--eap", required=True, help="EAP-IG's src folder (holds the eap package)")
    p.add_argument("--mib", required=True, help="MIB-circuit-track's folder (holds MIB_circuit_track)")
    p.add_argument("--out", default="bench/results/mib_parity.md")
    args = p.parse_args(argv)
    sys.path[:0] = [args.eap, args.mib]
    import transformers as T

    from multihead.models import smollm2_path

    tok = T.AutoTokenizer.from_pretrained(smollm2_path())
    with tempfile.TemporaryDirectory() as d:
        rows = [one(f, tok, Path(d)) for f in ("gpt2", "qwen2")]
    text = markdown(rows, ["python", "bench/mib_parity.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

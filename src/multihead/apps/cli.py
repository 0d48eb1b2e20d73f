"""The ``multihead`` command: demo, viz."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from multihead.apps.demo import format_weights  # noqa: F401  (kept importable from here)

#: the workloads ``multihead bench`` knows (W1-W4 in apps.bench, W5 decoding, W6 context parallel)
WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6")


def _in_open_unit(text: str) -> float:
    """An argparse type: a number in (0, 1)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1); got {text!r}") from None
    if not 0.0 < x < 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1) (a share of the heads); got {text}")
    return x


def _positive(kind):
    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}; got {text!r}") from None
        if not x > 0:
            raise argparse.ArgumentTypeError(f"must be > 0; got {text}")
        return x

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _non_negative_int(text: str) -> int:
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0; got {text!r}") from None
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {text}")
    return x


def _demo(args) -> int:
    from multihead.apps import demo

    demo.run(Path(args.out), retrain=args.retrain, seed=args.seed)
    return 0


def _viz(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from multihead.apps import demo

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpts = Path(args.checkpoints) if args.checkpoints else out / "checkpoints"
    if args.hf:
        from multihead.apps import hf_models

        paths = hf_models.draw(args.hf, args.text or "Multi-head attention lets the model look in several places.",
                               out, explain=args.explain)
    elif args.model is None:
        print("multihead viz: give --model {toy,vit,minilm} or --hf DIR", file=sys.stderr)
        return 2
    elif args.index is not None and args.model != "vit":
        print(f"multihead viz: --index picks a test image of --model vit; --model {args.model} draws --text",
              file=sys.stderr)
        return 2
    elif args.model == "toy":
        paths = demo.draw_reverser(demo.reverser(ckpts / "transformer", args.retrain), args.text or "31415926", out)
    elif args.model == "vit":
        n_test = len(demo.digits()[2])
        if (args.index or 0) >= n_test:  # checked before any training
            print(f"multihead viz: --index must be in [0, {n_test - 1}] (the digits test images); got {args.index}",
                  file=sys.stderr)
            return 2
        paths = demo.draw_vit(demo.vit(ckpts / "vit", args.retrain), args.index or 0, out)
    else:
        try:
            paths = demo.draw_minilm(args.text or "Multi-head attention lets the model look in several places.", out)
        except FileNotFoundError as e:
            print(f"multihead viz: {e}", file=sys.stderr)
            return 2
    for p in paths:
        print(p)
    return 0


def _prune(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from multihead.apps import pruning

    out = Path(args.out)
    if args.step > args.fraction:
        print(f"multihead prune: --step ({args.step}) must not exceed --fraction ({args.fraction})", file=sys.stderr)
        return 2
    if args.corpus and not Path(args.corpus).is_file():
        print(f"multihead prune: --corpus {args.corpus} does not exist", file=sys.stderr)
        return 2
    if args.hf:
        from multihead.apps import hf_models

        corpus = None
        if args.corpus:
            corpus = [line.strip() for line in Path(args.corpus).read_text().splitlines() if line.strip()]
        sizes = args.sentences or (128, None)
        setup = hf_models.hf_setup(args.hf, corpus, *sizes, n_recover=args.recover_sentences)
    elif args.model is None:
        print("multihead prune: give --model {toy,minilm} or --hf DIR", file=sys.stderr)
        return 2
    elif args.model == "toy":
        setup = pruning.toy_setup(Path(args.checkpoints) if args.checkpoints else out / "checkpoints" / "transformer")
    else:
        try:
            setup = pruning.minilm_setup(*(args.sentences if args.sentences else ()))
        except FileNotFoundError as e:
            print(f"multihead prune: {e}", file=sys.stderr)
            return 2
    report = pruning.run(setup, args.fraction, out, step=args.step, reestimate=not args.no_reestimate,
                         max_seconds=args.max_seconds, recover=args.recover)
    f = report["final"]
    print(f"{setup.name}: {f['fraction']:.0%} of heads pruned, {report['metric']} {f['metric']:.4f} "
          f"(unpruned {f['metric_unpruned']:.4f})")
    if report.get("recovery"):
        r = report["recovery"]
        print(f"recovery: {r['steps']} steps took it from {r['metric_before']:.4f} to {r['metric_after']:.4f}")
    print(pruning.speed_table(report["speed"]))
    for note in report["timing_notes"]:
        print(f"note: {note}")
    print(f"report: {out / 'report.md'}; pruned model: {out / 'model'}")
    return 0


def _check(args) -> int:
    """multihead check FILE.py:NAME | DIR | GLOB ...: grade one module (its whole report) or a class's
    submissions (a table; --report CSV/JSON). Exit 0 OK, 1 not OK, 2 cannot be graded."""
    from multihead.apps import grade

    mask = None if args.mask == "none" else args.mask
    files = grade.targets(args.target, args.name)
    if not files:
        print(f"multihead check: nothing matches {' '.join(args.target)} (give FILE.py:NAME, a folder or a glob of "
              ".py files)", file=sys.stderr)
        return 2
    if args.call in ("x", "qkv") and mask is not None:
        print(f"multihead check: --call {args.call} with --mask {mask} cannot be honoured: the call passes no mask to "
              "the module; use --call qkv_mask, or --mask none", file=sys.stderr)
        return 2
    try:
        grade.kwargs_of(args.init)
    except (SyntaxError, ValueError) as e:
        print(f"multihead check: --init {args.init!r}: {e}", file=sys.stderr)
        return 2
    opts = dict(init=args.init, call=args.call, mask=mask, causal=args.causal, embed_dim=args.embed_dim,
                strict=args.strict)
    one = args.target[0]
    single = len(args.target) == 1 and (one.rpartition(":")[0].endswith(".py") or Path(one).is_file())
    if single:
        path, name = files[0]
        row = grade.grade_file(path, name or "", timeout=args.timeout, show=print, **opts)
        if row["status"] in ("error", "timeout"):
            print(f"multihead check: {row['finding']}", file=sys.stderr)
            return 2
        rows = [row]
    else:
        if any(n is None for _, n in files):
            print("multihead check: grading a folder or a glob needs --name NAME (the class each file defines)",
                  file=sys.stderr)
            return 2
        rows = grade.grade_many(files, timeout=args.timeout, jobs=args.jobs, **opts)
        print(grade.table(rows))
    if args.report:
        grade.write_report(rows, Path(args.report))
        print(f"report: {args.report}")
    return 0 if all(r["ok"] for r in rows) else 1


def _bench(args) -> int:
    from multihead.apps import bench

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        print(f"multihead bench: unknown workload {', '.join(bad) or '(none given)'}; valid: {', '.join(WORKLOADS)}",
              file=sys.stderr)
        return 2
    peers = [p.strip() for p in args.peers.split(",")] if args.peers else None
    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        print(f"multihead bench: --lengths takes comma-separated integers; got {args.lengths!r}", file=sys.stderr)
        return 2
    if args.memory_only:
        bench.remeasure_memory(Path(args.out), peers)
        return 0
    if "W6" in names:  # context parallel: its own processes
        from multihead.apps import cp_bench

        cp_bench.run(ranks=args.ranks, length=args.cp_length, reps=args.cp_reps,
                     out=Path(args.out) / "context_parallel")
        names.remove("W6")
        if not names:
            return 0
    bench.run(names, reps=args.reps, out=Path(args.out), memory=not args.no_memory, peers=peers, lengths=lengths,
              compile=args.compile, decode_steps=args.decode_steps,
              decode_batches=tuple(int(b) for b in args.decode_batches.split(",")), cpp_wrapper=args.cpp_wrapper,
              decode_rounds=args.decode_rounds)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multihead", description="Multi-head attention: see and cut the heads.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the course's example, two small models trained here, every head drawn")
    p.add_argument("--out", default="out", help="output folder (checkpoints are kept in OUT/checkpoints)")
    p.add_argument("--retrain", action="store_true", help="train again even when checkpoints exist")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo)
    p = sub.add_parser("viz", help="draw every head of a model on an input")
    p.add_argument("--model", choices=["toy", "vit", "minilm"], default=None,
                   help="toy: the digit-reversing Transformer (text = digits); vit: the digits ViT (--index); "
                        "minilm: the pretrained all-MiniLM-L6-v2")
    p.add_argument("--hf", default=None, metavar="DIR", help="a local transformers checkpoint directory (its tokenizer "
                                                            "reads --text)")
    p.add_argument("--text", default=None)
    p.add_argument("--index", type=_non_negative_int, default=None, help="which test image, for --model vit "
                                                                       "(default 0)")
    p.add_argument("--explain", action="store_true", help="with --hf: per attention module, its heads, head layout "
                                                          "(or why none) and the arguments multihead computes")
    p.add_argument("--out", default="out/viz")
    p.add_argument("--checkpoints", default=None, help="where trained checkpoints live (default OUT/checkpoints)")
    p.add_argument("--retrain", action="store_true")
    p.set_defaults(func=_viz)
    p = sub.add_parser("prune", help="head importance, the pruning curve with measured speed, the pruned model")
    p.add_argument("--model", choices=["toy", "minilm"], default=None)
    p.add_argument("--hf", default=None, metavar="DIR",
                   help="a local transformers checkpoint directory (encoders: cosine of mean-pooled hidden states; "
                        "causal LMs: KL of next-token distributions)")
    p.add_argument("--corpus", default=None, metavar="FILE", help="--hf: sentences, one per line (default: Python's "
                                                                  "own docs)")
    p.add_argument("--recover", type=_non_negative_int, default=0, metavar="STEPS",
                   help="--hf: distil the pruned model towards the unpruned one for STEPS steps")
    p.add_argument("--recover-sentences", type=_positive(int), default=None, metavar="N",
                   help="--hf: sentences reserved for recovery (default: a quarter of the corpus, at most 256)")
    p.add_argument("--fraction", type=_in_open_unit, default=0.4, help="share of all heads to prune, in (0, 1) "
                                                                       "(default 0.4)")
    p.add_argument("--step", type=_in_open_unit, default=0.1, help="share of heads pruned per step of the curve, in "
                                                                   "(0, 1) (default 0.1)")
    p.add_argument("--no-reestimate", action="store_true", help="rank the heads once instead of after every step")
    p.add_argument("--checkpoints", default=None, help="the toy model's checkpoint directory")
    p.add_argument("--sentences", type=_positive(int), nargs=2, metavar=("IMPORTANCE", "HELD_OUT"), default=None,
                   help="minilm: sentences for importance and for fidelity (default 256 and all the rest)")
    p.add_argument("--max-seconds", type=_positive(float), default=60.0,
                   help="time allowed per batch size for the interleaved speed table")
    p.add_argument("--out", default="out/prune")
    p.set_defaults(func=_prune)
    p = sub.add_parser("check", help="grade your own multi-head attention module, or a class's submissions, and "
                                     "locate each bug (exit 0 OK, 1 not OK, 2 cannot be graded)")
    p.add_argument("target", nargs="+", help="FILE.py:NAME (one module, whole report), or folders / globs / files "
                                             "with --name (each in its own process, a table)")
    p.add_argument("--name", default=None, help="the class (or function) each file defines that builds the module")
    p.add_argument("--init", default=None, help="keyword arguments for NAME, e.g. 'd_model=32, num_heads=4'")
    p.add_argument("--call", choices=["x", "qkv", "qkv_mask"], default="qkv",
                   help="how the module is called: m(x), m(q, k, v) or m(q, k, v, mask)")
    p.add_argument("--mask", choices=["none", "keep", "block", "additive", "valid_lens"], default="none",
                   help="the module's mask convention (with --call qkv_mask)")
    p.add_argument("--causal", action="store_true", help="the module is meant to be causal")
    p.add_argument("--embed-dim", type=_positive(int), default=None, help="the input size, when no layer tells it")
    p.add_argument("--strict", action="store_true", help="warnings (NaN on fully masked rows, ...) fail too")
    p.add_argument("--timeout", type=_positive(float), default=60.0, help="seconds each submission may take")
    p.add_argument("--jobs", type=_positive(int), default=None, help="submissions graded at once (default: cores, at most 4)")
    p.add_argument("--report", default=None, help="write the table as FILE.csv or FILE.json")
    p.set_defaults(func=_check)
    p = sub.add_parser("bench", help="multihead against torch.nn, SDPA, the course's code, Keras and FlexAttention")
    p.add_argument("--workloads", default="W1,W2,W3,W4",
                   help="comma-separated: W1, W2, W3, W4, W5 (decoding), W6 (context parallel, gloo processes)")
    p.add_argument("--reps", type=_positive(int), default=20, help="timed calls per peer (median, min, max)")
    p.add_argument("--peers", default=None, help="comma-separated peer names (default: all)")
    p.add_argument("--lengths", default="4096,8192", help="W4's sequence lengths")
    p.add_argument("--no-memory", action="store_true", help="skip W4's peak-memory subprocesses")
    p.add_argument("--decode-steps", type=int, default=256, help="W5: tokens decoded")
    p.add_argument("--decode-batches", default="1,16", help="W5: batch sizes, comma-separated")
    p.add_argument("--compile", action="store_true",
                   help="W1-W3: also time torch.nn, SDPA + 4 Linear and multihead under torch.compile, "
                        "and torch.compile's per-call floor (a compiled x[0, 0] + 1)")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="with --compile: also compile with inductor's C++ wrapper (options={'cpp_wrapper': True})")
    p.add_argument("--decode-rounds", type=int, default=3, help="W5: interleaved rounds (median, min-max)")
    p.add_argument("--memory-only", action="store_true", help="re-measure W4's peak memory into OUT/bench.json")
    p.add_argument("--ranks", type=int, default=4, help="W6: processes the sequence is sharded over")
    p.add_argument("--cp-length", type=int, default=16384, help="W6: the whole sequence's length")
    p.add_argument("--cp-reps", type=int, default=3, help="W6: timed calls per case")
    p.add_argument("--out", default="bench/results")
    p.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # our own checks on the user's input: one line, no traceback
        print(f"multihead {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

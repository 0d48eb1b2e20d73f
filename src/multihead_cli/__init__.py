"""The ``multihead`` command's arguments, parsed without importing torch (``multihead --help``
answers at once); the work is done by the command's folder in :mod:`multihead.apps`, reached through
:func:`multihead.apps.cli.run`, imported after parsing. The parser imports nothing of ``multihead`` at import time, and
``multihead.apps`` never imports the parser: this package is the top floor."""

from __future__ import annotations

import argparse
import re
import sys

#: the workloads ``multihead bench`` knows (W1-W4 in apps.bench, W5 decoding, W6 context parallel,
#: W7 a transformers sentence encoder in apps.hf_bench)
WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7")
#: the dtypes ``prune --quantize`` takes (multihead.quantize.DTYPES; a test keeps the two equal)
QUANTIZE = ("int8",)


def _in_open_unit(text: str) -> float:
    """An argparse type: a number in (0, 1)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1); got {text!r}") from None
    if not 0.0 < x < 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1) (a share of the heads); got {text}")
    return x


def _up_to_one(what: str, example: str, meaning: str):
    """An argparse type: a number in (0, 1] -- ``what`` (e.g. "a cosine"), refused with ``example`` and ``meaning``."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} in (0, 1], e.g. {example}; got {text!r}") from None
        if not 0.0 < x <= 1.0:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in (0, 1] ({meaning}); got {text}")
        return x

    parse.__name__ = what
    return parse


_cosine = _up_to_one("a cosine", "0.95", "a mean cosine to the unpruned model")


#: ``prune --formats`` (multihead.apps.prune.decoder.FORMATS; a test keeps the two equal)
DECODER_FORMATS = ("gguf-f16", "gguf-q8_0", "gguf-q4_k_m", "genai-fp32", "genai-int4")


def _contexts(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated whole numbers of tokens, each at least 1."""
    try:
        ns = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        ns = ()
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated whole numbers of tokens, e.g. 256,2048,8192")
    return ns


def _formats(text: str) -> tuple[str, ...]:
    """An argparse type: a comma-separated list of :data:`DECODER_FORMATS`."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in names if x not in DECODER_FORMATS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown format(s) {bad or [text]}; choose from {','.join(DECODER_FORMATS)}")
    return names


def _ratio(text: str) -> float:
    """An argparse type: a ratio >= 1 (a perplexity at most this many times the unpruned model's)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a ratio >= 1, e.g. 1.1; got {text!r}") from None
    if not 1.0 <= x < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a ratio >= 1 (the unpruned model's perplexity is 1); got {text}")
    return x
_share_of_one = _up_to_one("an accuracy", "0.9", "an accuracy")
_similar_share = _up_to_one("a share", "0.5", "a share of a submission's code")


def _positive_number(what: str):
    """An argparse type: a number > 0 (``what`` names it in the refusal)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} > 0; got {text!r}") from None
        if not x > 0 or x == float("inf"):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be {what} > 0; got {text}")
        return x

    parse.__name__ = what
    return parse


def _workloads(text: str) -> list[str]:
    """'W1, W2' -> ['W1', 'W2']; an unknown or empty list is argparse's one-line refusal."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown workload {', '.join(bad) or '(none given)'}; valid: "
                                         f"{', '.join(WORKLOADS)}")
    return names


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


def _duration(text: str) -> float:
    """An argparse type: a duration in seconds -- 300, 300s, 5m, 4.5m, 1h, 2m30s."""
    t = text.strip().lower()
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", t)
    if not t or parts is None:
        raise argparse.ArgumentTypeError(f"must be a duration: seconds (300) or 300s, 5m, 1h30m; got {text!r}")
    h, m, s = (float(x) if x else 0.0 for x in parts.groups())
    seconds = 3600 * h + 60 * m + s
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be longer than 0 s; got {text!r}")
    return seconds


def _non_negative_int(text: str) -> int:
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0; got {text!r}") from None
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {text}")
    return x


#: one or two examples per subcommand, and where its output goes (shown by --help)
EXAMPLES = {
    "demo": (
        'examples:\n'
        "  multihead demo                      # out/: the course's example, two trained models, every head drawn"
    ),
    "viz": (
        'examples:\n'
        '  multihead viz --model toy --text 31415       # reuses out/checkpoints from make demo\n'
        '  multihead viz --hf DIR --explain             # a local transformers checkpoint\n'
        '  multihead viz --timm vit_small_patch16_224 --checkpoint vit.safetensors --image cat.png\n'
        'pictures and explorers go to --out (default out/viz)'
    ),
    "prune": (
        'examples:\n'
        '  multihead prune --model toy --fraction 0.4\n'
        '  multihead prune --hf DIR --fraction 0.5 --recover 400 --quantize int8\n'
        '  multihead prune --hf DIR --target-cosine 0.95 --recover 200 --quantize int8 --time-budget 15m\n'
        'report.md, report.json, curve.png and the pruned model go to --out (default out/prune)'
    ),
    "check": (
        'examples:\n'
        "  multihead check my_attention.py:MultiHeadAttention --init 'd_model=32, num_heads=4' --call qkv_mask --mask block\n"
        '  multihead check submissions/ --name MultiHeadAttention --call x --report grades.csv\n'
        '  multihead check submissions/ --name MHA --call x --points points.json --feedback fb/ --summary class/\n'
        '  multihead check submissions/ --name MHA --seed 7 --shard 2/3 --report shard2.csv   # slice 2 of 3\n'
        '  multihead check --merge shard1.csv shard2.csv shard3.csv --report all.csv --summary class/\n'
        '  multihead check submissions/ --name MHA --similarity --starter starter.py --summary class/   # similar pairs\n'
        'exit 0 OK, 1 not OK, 2 cannot be graded'
    ),
    "patch": (
        'examples:\n'
        '  multihead patch --hf DIR --clean "When Mary and John went out, John gave a drink to" \\\n'
        '      --corrupted "When Mary and John went out, Mary gave a drink to" --metric logit-diff:Mary,John\n'
        'patching.md, patching.json and patching.png go to --out (default out/patch)'
    ),
    "circuit": (
        'examples:\n'
        '  multihead circuit --hf DIR --clean "When Mary and John went out, John gave a drink to" \\\n'
        '      --corrupted "When Mary and John went out, Mary gave a drink to" --metric logit-diff:Mary,John \\\n'
        '      --method eap-ig --steps 5 --budget 1%\n'
        '  multihead circuit --hf DIR --pairs ioi.jsonl --mib --budget 5%   # a dataset, MIB\'s graph and file\n'
        'circuit.json, circuit.md, circuit.png, circuit.html, curve.png and explorer.html go to --out (default out/circuit);\n'
        'with --mib also importances.json (MIB\'s graph file)'
    ),
    "bench": (
        'examples:\n'
        '  multihead bench --workloads W1 --reps 5\n'
        '  multihead bench --workloads W1,W2,W3 --compile\n'
        '  multihead bench --workloads W7 --pruned out/prune/model\n'
        'bench.md, summary.md, bench.json and bench.png go to --out (default bench/results)'
    ),
}


class _Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Examples kept as written, defaults shown (an option whose help states its own default is left as written)."""

    def _get_help_string(self, action):
        return action.help if "(default:" in (action.help or "") else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each subcommand's ``func`` names its command, dispatched by multihead.apps.cli.run."""
    parser = argparse.ArgumentParser(prog="multihead", description="Multi-head attention: see and cut the heads.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_, options in (
            ("demo", "the course's example, two small models trained here, every head drawn", _demo_options),
            ("viz", "draw every head of a model on an input", _viz_options),
            ("prune", "head importance, the pruning curve with measured speed, the pruned model", _prune_options),
            ("check", "grade your own multi-head attention module, or a class's submissions, and locate each bug "
                      "(exit 0 OK, 1 not OK, 2 cannot be graded)", _check_options),
            ("bench", "multihead against torch.nn, SDPA, the course's code, Keras and FlexAttention", _bench_options),
            ("patch", "activation patching: which heads carry a behaviour (a causal LM, two texts)", _patch_options),
            ("circuit", "the circuit of a behaviour: edges between heads scored (EAP, EAP-IG), kept and checked by "
                        "intervention (a causal LM, two texts)", _circuit_options)):
        p = sub.add_parser(name, epilog=EXAMPLES[name], formatter_class=_Fmt, help=help_)
        options(p)
        p.set_defaults(func=name)
    return parser


def _demo_options(p: argparse.ArgumentParser) -> None:
    """The options of ``multihead demo``."""
    p.add_argument("--out", default="out", help="output folder (checkpoints are kept in OUT/checkpoints)")
    p.add_argument("--retrain", action="store_true", help="train again even when checkpoints exist")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=_positive(float), default=20.0,
                   help="at most this long per batch size for the pruned models' interleaved speed tables")
    p.add_argument("--recover", type=_non_negative_int, default=150, metavar="STEPS",
                   help="fine-tuning steps after each cut of the pruning curves (default 150; 0: the cut alone)")


def _viz_options(p: argparse.ArgumentParser) -> None:
    """The options of ``multihead viz``."""
    p.add_argument("--model", choices=["toy", "vit", "minilm"], default=None,
                   help="toy: the digit-reversing Transformer (text = digits); vit: the digits ViT (--index); "
                        "minilm: the pretrained all-MiniLM-L6-v2")
    p.add_argument("--hf", default=None, metavar="DIR", help="a local transformers checkpoint directory (its tokenizer "
                                                            "reads --text)")
    p.add_argument("--timm", default=None, metavar="NAME", help="a timm model (vit_small_patch16_224, ...) with "
                                                              "--checkpoint and --image")
    p.add_argument("--torchvision", default=None, metavar="NAME", help="a torchvision model (vit_b_16, ...) with "
                                                                     "--checkpoint and --image")
    p.add_argument("--checkpoint", default=None, metavar="FILE", help="--timm/--torchvision: its weights, a "
                                                                      ".safetensors file (default: random weights)")
    p.add_argument("--model-args", default=None, metavar="JSON", help="--timm/--torchvision: the model's sizes, e.g. "
                                                                      '\'{"img_size": 32, "depth": 2}\'')
    p.add_argument("--image", default=None, metavar="FILE", help="--timm/--torchvision: the picture, at the model's "
                                                                 "input size")
    p.add_argument("--text", default=None)
    p.add_argument("--index", type=_non_negative_int, default=None, help="which test image, for --model vit "
                                                                       "(default 0)")
    p.add_argument("--explain", action="store_true", help="with --hf: per attention module, its heads, head layout "
                                                          "(or why none) and the arguments multihead computes")
    p.add_argument("--out", default="out/viz")
    p.add_argument("--checkpoints", default=None,
                   help="where trained checkpoints live (default: OUT/checkpoints or the demo's out/checkpoints, "
                        "whichever holds them; trained into out/checkpoints when neither does)")
    p.add_argument("--retrain", action="store_true")


def _prune_options(p: argparse.ArgumentParser) -> None:
    """The options of ``multihead prune``."""
    p.add_argument("--model", choices=["toy", "minilm"], default=None)
    p.add_argument("--hf", default=None, metavar="DIR",
                   help="a local transformers checkpoint directory (encoders: cosine of mean-pooled hidden states; "
                        "causal LMs: KL of next-token distributions)")
    p.add_argument("--corpus", default=None, metavar="FILE", help="--hf: sentences, one per line (default: Python's "
                                                                  "own docs)")
    p.add_argument("--recover", type=_non_negative_int, default=None, metavar="STEPS",
                   help="--hf: distil the pruned model towards the unpruned one for STEPS steps (default: none for "
                        "encoders; 400 at most for causal LMs, cut short to the time budget)")
    p.add_argument("--quantize", choices=QUANTIZE, default=None,
                   help="--hf: quantize the pruned (and recovered) model's Linear layers last; its fidelity and speed "
                        "are reported and multihead.hf.load returns it quantized")
    p.add_argument("--recover-sentences", type=_positive(int), default=None, metavar="N",
                   help="--hf: sentences reserved for recovery (default: a quarter of the corpus, at most 256)")
    p.add_argument("--recover-text", choices=["split", "wide"], default="wide",
                   help="--hf: distil on the corpus' recovery split only, or on it and the standard library's "
                        "docstrings, 16 sentences per step (default wide: it holds better on text of other kinds, "
                        "bench/results/fidelity_unseen.md)")
    p.add_argument("--unseen-sentences", type=_non_negative_int, default=300, metavar="N",
                   help="--hf encoders: also measure fidelity on N sentences of the installed Python packages' "
                        "descriptions (text of another kind, never trained on); the worse kind's figure is the one "
                        "reported and --target-cosine must meet (default 300; 0: the held-out split only)")
    p.add_argument("--passages", type=_non_negative_int, default=32, metavar="N",
                   help="--hf encoders: also measure fidelity on N passages of the held-out sentences joined to "
                        "129-256 tokens (the model's limit if smaller), the length of the paragraphs users embed; "
                        "the worst kind counts (default 32; 0: sentences only)")
    p.add_argument("--fraction", type=_in_open_unit, default=None,
                   help="share of all heads to prune, in (0, 1) (default: 0.4); with a --target-* the furthest "
                        "to try (default: 0.8)")
    goal = p.add_mutually_exclusive_group()
    goal.add_argument("--target-cosine", type=_cosine, default=None, metavar="T",
                      help="prune as far as the fidelity allows: keep the furthest step of the curve (recovered and "
                           "quantized when asked) whose mean cosine's 95%% interval on the held-out sentences starts "
                           "at or above T, in (0, 1] (encoders); exit 1 when no model tried meets it")
    goal.add_argument("--target-kl", type=_positive_number("a KL in nats"), default=None, metavar="K",
                      help="the same for a causal LM: the furthest step whose mean next-token KL to the unpruned "
                           "model is at most K")
    goal.add_argument("--target-perplexity", type=_ratio, default=None, metavar="R",
                      help="causal LMs: the furthest cut whose perplexity on unseen text is at most R times the "
                           "unpruned model's (e.g. 1.1), the behaviour kept too (IOI or --behaviour: 95%% of its "
                           "accuracy); exit 1 when no cut tried meets it")
    goal.add_argument("--target-accuracy", type=_share_of_one, default=None, metavar="A",
                      help="the same for the demo's models (--model toy, vit): the furthest step whose accuracy is "
                           "at least A, in (0, 1]")
    p.add_argument("--ffn", type=_in_open_unit, default=None, metavar="FRACTION",
                   help="--hf: also cut this share of every feed-forward block's neurons (the least important, each "
                        "replaced by its mean, verified) from the model kept, before its recovery: past the heads' "
                        "third of the work")
    p.add_argument("--unit", choices=["auto", "group", "query"], default=None,
                   help="causal LMs: what each layer loses, the same count in every layer -- whole key/value groups "
                        "(the KV cache shrinks) or query heads evenly inside every group (default auto: groups where "
                        "a layer has two key/value heads or more)")
    p.add_argument("--per-layer", action="store_true", default=None,
                   help="causal LMs: as many units over the model as the even cut, placed where they matter least, so "
                        "layers may keep different counts (still whole groups, or even inside each group); the folder "
                        "then loads with multihead.hf.load only (transformers reads one count per model), a Llama's "
                        "GGUF holds the counts (llama.cpp's per-layer layout), GenAI and Gemma 3's GGUF are refused")
    p.add_argument("--fsdp", action="store_true", default=None,
                   help="causal LMs under torchrun: the recovery fully sharded over the ranks (FSDP2: each rank its "
                        "share of the weights and AdamW's moments) instead of data parallel (DDP)")
    p.add_argument("--behaviour", default=None, metavar="FILE",
                   help="causal LMs: the behaviour the cut must keep, instead of IOI: JSON lines "
                        '{"clean": ..., "corrupted": ..., "answer": ..., "wrong": ...} (answers one token each; '
                        "half the pairs choose the cut, the other half judge it)")
    p.add_argument("--formats", type=_formats, default=None, metavar="LIST",
                   help="causal LMs (Llama; Gemma 3: gguf only): the runtimes' files written beside OUT/model, each "
                        f"read back: {','.join(DECODER_FORMATS)} (gguf: llama.cpp's; q4_k_m needs llama.cpp built: "
                        "make decoder-llama-cpp; genai: ONNX Runtime GenAI's builder)")
    p.add_argument("--decode-contexts", type=_contexts, default=None, metavar="LIST",
                   help="causal LMs with --formats: time each file written against its peer (the unpruned model "
                        "made into the same format by the runtime's own tools, in OUT/peers) in llama.cpp or ONNX "
                        "Runtime GenAI, decoding up to each context, comma-separated token counts (e.g. "
                        "256,2048,8192); the table in report.md, costed in --time-budget (default: not timed)")
    p.add_argument("--decode-rounds", type=_positive(int), default=None, metavar="N",
                   help="causal LMs: interleaved rounds of the decode table (median and min-max; default 3)")
    p.add_argument("--lr", type=_positive_number("a learning rate"), default=None,
                   help="causal LMs: the recovery's learning rate (default 3e-4, decaying along a half cosine)")
    p.add_argument("--step", type=_in_open_unit, default=0.1, help="share of heads pruned per step of the curve, in "
                                                                   "(0, 1) (default 0.1)")
    p.add_argument("--no-reestimate", action="store_true", help="rank the heads once instead of after every step")
    p.add_argument("--checkpoints", default=None, help="the toy model's checkpoint directory (default: OUT/checkpoints "
                                                       "or the demo's out/checkpoints, whichever holds it)")
    p.add_argument("--sentences", type=_positive(int), nargs=2, metavar=("IMPORTANCE", "HELD_OUT"), default=None,
                   help="minilm: sentences for importance and for fidelity (default 256 and all the rest)")
    p.add_argument("--max-seconds", type=_positive(float), default=60.0,
                   help="at most this long per batch size for the interleaved speed table")
    p.add_argument("--no-runtime-peers", action="store_true",
                   help="--hf encoders: leave ONNX Runtime int8 and OpenVINO fp32 of the unpruned model (exported, "
                        "~15 s) out of the speed table, and the runtime table (the kept model's OUT/model/onnx and "
                        "OUT/model/openvino files timed against the unpruned model's) out of the report; the files are "
                        "written either way (--no-runtime-files leaves them out)")
    p.add_argument("--serve-batch", default=None, metavar="N",
                   help="--hf encoders: each runtime's file to serve (OUT/model/onnx/serve_int8.onnx, serve.onnx, "
                        "openvino/serve_int8.xml, ...) is the form that runs fastest here at batch size N, a positive "
                        "whole number (default: the best geometric mean over batch 1, 16 and 64)")
    p.add_argument("--runtimes", default=None, metavar="LIST",
                   help="--hf encoders: the runtimes whose files are written, comma-separated: onnx (ONNX Runtime, "
                        "always: the others start from its file), openvino (default: each whose extra is installed); "
                        "one asked for whose extra is missing is refused before any work")
    p.add_argument("--no-runtime-files", action="store_true",
                   help="--hf encoders: write no ONNX Runtime or OpenVINO files of the kept model (OUT/model/onnx, "
                        "OUT/model/openvino: an export and its checks, about a minute and a half for MiniLM on 2 "
                        "cores), only its transformers directory; no runtime table either (report.md says so)")
    p.add_argument("--time-budget", type=_duration, default=None, metavar="DURATION",
                   help="the whole command's time (300, 300s, 5m, 1h30m), the runtime files and tables included. "
                        "The run is costed before any work (printed as 'plan:'): what follows the search (the runtime "
                        "files, their table, the speed table) from the unpruned model's files made and timed before "
                        "the search; a budget that cannot hold one candidate with its recovery and what follows it is "
                        "refused, naming the budget needed. Default: 4m30s, grown to the plan's cost when the plan "
                        "needs more. The heads are re-ranked after every step, and the search tries another candidate, "
                        "only if that leaves what follows the search its time; report.md gives each phase's time. "
                        "Causal LMs: default 15m, the recovery cut short to fit it, a budget that leaves no time beyond "
                        "it refused")
    p.add_argument("--out", default="out/prune", help="output folder: new, empty, or one a prune wrote before")
    p.add_argument("--force", action="store_true", help="write into --out even though it holds other files")


def _check_options(p: argparse.ArgumentParser) -> None:
    """The options of ``multihead check``."""
    p.add_argument("target", nargs="*", help="FILE.py:NAME or FILE.ipynb:NAME (one module, whole report; a notebook "
                                             "on its definitions), or folders / globs / files with --name (each in its "
                                             "own process, a table)")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="grade only slice K of N (1 <= K <= N; needs --seed): the files in order of their path under "
                        "the class folder, every N-th from the K-th, so N machines (a CI matrix, a Slurm array, "
                        "Kubernetes indexed jobs) grade a class; join the reports with --merge")
    p.add_argument("--merge", nargs="+", default=None, metavar="REPORT",
                   help="join the --report files of a class's shards (one seed, one points table) into one table, "
                        "--report and --summary; no grading")
    p.add_argument("--name", default=None, help="the class (or function) each file defines that builds the module")
    p.add_argument("--init", default=None, help="keyword arguments for NAME, e.g. 'd_model=32, num_heads=4'")
    p.add_argument("--call", choices=["x", "x_mask", "qkv", "qkv_mask"], default="qkv",
                   help="how the module is called: m(x), m(x, mask) (self-attention), m(q, k, v) or m(q, k, v, mask)")
    p.add_argument("--mask", choices=["none", "keep", "block", "additive", "valid_lens"], default="none",
                   help="the module's mask convention (with --call x_mask or qkv_mask)")
    p.add_argument("--causal", action="store_true", help="the module is meant to be causal")
    p.add_argument("--embed-dim", type=_positive(int), default=None, help="the input size, when no layer tells it")
    p.add_argument("--scale", type=_positive(float), default=None,
                   help="the score scale the course uses, when it is not 1/sqrt(one head's size): e.g. the Keras "
                        "tutorial's code divides by the square root of its total d_k (h heads x d_k / h)")
    p.add_argument("--strict", action="store_true", help="warnings (NaN on fully masked rows, ...) fail too")
    p.add_argument("--forbid", default=None, metavar="NAMES",
                   help="torch functions and modules the course forbids, comma-separated (e.g. nn.MultiheadAttention,"
                        "F.scaled_dot_product_attention): a submission whose forward uses one is NOT OK, naming it")
    p.add_argument("--timeout", type=_positive(float), default=60.0,
                   help="wall-clock seconds each submission may take (its CPU time: twice that)")
    p.add_argument("--memory", default="4G", help="address space each submission may use, e.g. 4G, 512M")
    p.add_argument("--jobs", type=_positive(int), default=None, help="submissions graded at once (default: cores, at most 4)")
    p.add_argument("--seed", type=int, default=None,
                   help="the probes' random seed (default: new each run, so no submission knows them in advance)")
    p.add_argument("--points", default=None, metavar="FILE",
                   help='partial credit: a JSON file {"check name": points, ...} (the others keep their defaults)')
    p.add_argument("--feedback", default=None, metavar="DIR", help="write one markdown feedback file per submission")
    p.add_argument("--summary", default=None, metavar="DIR",
                   help="write the class summary: each mistake and how many made it (summary.md, summary.png)")
    p.add_argument("--report", default=None,
                   help="write the table as FILE.csv or FILE.json, or the gradebook an LMS imports as FILE.canvas.csv "
                        "or FILE.moodle.csv (with --roster)")
    p.add_argument("--similarity", action="store_true",
                   help="also compare every pair of the class's submissions (their text, never run; copydetect's "
                        "winnowing, renamed names and moved comments seen through): the pairs sharing at least "
                        "--similar-above of either one's code and their clusters, printed and in --summary (with "
                        "similarity.md, the matching lines side by side)")
    p.add_argument("--starter", default=None, metavar="FILE",
                   help="with --similarity: the code the class was handed (.py or .ipynb), left out of every "
                        "comparison; refused before any grading when missing or not parsing as Python")
    p.add_argument("--similar-above", type=_similar_share, default=None, metavar="S",
                   help="with --similarity: the share of either submission's code a pair must share to be reported, "
                        "in (0, 1] (default 0.5)")
    p.add_argument("--platform", choices=["gradescope", "prairielearn", "classroom"], default=None,
                   help="grade on a course platform: with --write PATH, the assignment's package (gradescope: the "
                        "autograder OUT.zip; prairielearn: the question folder; classroom: the template repository "
                        "folder, its workflow); with --grade, the submission the platform laid out under --root, "
                        "graded as here and written as the platform's results.json")
    p.add_argument("--write", default=None, metavar="PATH", help="with --platform: write the assignment's package")
    p.add_argument("--grade", action="store_true", help="with --platform: grade the platform's submission (what "
                                                        "the package runs on the platform)")
    p.add_argument("--root", default=None, metavar="DIR", help="with --platform --grade: where the platform's folders "
                                                               "are (default /autograder, /grade, or the checkout)")
    p.add_argument("--passed", default=None, metavar="CHECK",
                   help="with --platform classroom: exit 0 if CHECK earned its points in the grading step's results "
                        "(each step of the workflow asks one)")
    p.add_argument("--roster", default=None, metavar="FILE",
                   help="for a .canvas.csv / .moodle.csv report: a CSV with a file column (each submission's path "
                        "under the class folder) and the students' columns (Canvas: Student, ID; Moodle: Email "
                        "address, Username or ID number)")


def _patch_options(p: argparse.ArgumentParser) -> None:
    """The options of ``multihead patch``."""
    p.add_argument("--hf", required=True, metavar="DIR", help="a local transformers causal language model (config, "
                                                              "weights, tokenizer)")
    p.add_argument("--clean", required=True, help="the text showing the behaviour")
    p.add_argument("--corrupted", required=True, help="the same number of tokens, the behaviour broken")
    p.add_argument("--metric", required=True, help="logit-diff:TOKEN_A,TOKEN_B (last position) or loss (of the clean "
                                                   "text)")
    p.add_argument("--direction", choices=["denoise", "noise"], default="denoise",
                   help="denoise: the corrupted run, one head clean; noise: the clean run, one head corrupted")
    p.add_argument("--positions", action="store_true", help="one patch per head and query position")
    p.add_argument("--chunk", type=_positive(int), default=32, help="patches per forward")
    p.add_argument("--out", default="out/patch")


def _circuit_options(p: argparse.ArgumentParser) -> None:
    """The options of ``multihead circuit`` (its --method, --steps and --budget are checked by the command: one line
    each, before the model loads)."""
    p.add_argument("--hf", required=True, metavar="DIR", help="a local transformers causal language model (config, "
                                                              "weights, tokenizer)")
    p.add_argument("--clean", default=None, help="the text showing the behaviour (or --pairs)")
    p.add_argument("--corrupted", default=None, help="the same number of tokens, the behaviour broken")
    p.add_argument("--metric", default=None, help="logit-diff:TOKEN_A,TOKEN_B (last position) or loss (of the clean "
                                                  "text)")
    p.add_argument("--pairs", default=None, metavar="FILE",
                   help='a dataset in place of --clean/--corrupted/--metric: JSON lines {"clean": TEXT, "corrupted": '
                        'TEXT, "answers": [A, B]}, padded and scored at each pair\'s last real token, averaged (MIB\'s '
                        "logit difference)")
    p.add_argument("--batch-size", type=_positive(int), default=16, help="--pairs: pairs a forward")
    p.add_argument("--mib", action="store_true", help="MIB's graph (a key and a value reader per query head) and "
                                                      "OUT/importances.json, the graph file MIB's evaluator reads")
    p.add_argument("--method", default="eap-ig", help="eap (one forward of each text, one backward), eap-ig "
                                                      "(--steps integration points) or atp* (AtP*: queries and keys "
                                                      "with the softmax recomputed, and GradDrop)")
    p.add_argument("--steps", type=int, default=5, help="eap-ig: integration steps, >= 1")
    p.add_argument("--budget", default="1%", help="the circuit kept: this share of the edges, by |score|, in "
                                                  "(0, 100%%] (1%% or 0.01), less those on no input-to-logits path "
                                                  "(MIB's)")
    p.add_argument("--out", default="out/circuit")


def _bench_options(p: argparse.ArgumentParser) -> None:
    """The options of ``multihead bench``."""
    p.add_argument("--workloads", default="W1,W2,W3,W4", type=_workloads,
                   help="comma-separated: W1, W2, W3, W4, W5 (decoding), W6 (context parallel, gloo processes), "
                        "W7 (all-MiniLM-L6-v2 through transformers: sdpa, multihead padded and padding-free)")
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
    p.add_argument("--decode-no-recompute", action="store_true",
                   help="W5: time the cached and the hand-written decoders only (recomputing takes 25x at batch 16)")
    p.add_argument("--memory-only", action="store_true", help="re-measure W4's peak memory into OUT/bench.json")
    p.add_argument("--ranks", type=int, default=4, help="W6: processes the sequence is sharded over")
    p.add_argument("--cp-length", type=int, default=16384, help="W6: the whole sequence's length")
    p.add_argument("--cp-reps", type=int, default=3, help="W6: timed calls per case")
    p.add_argument("--pruned", default=None, metavar="DIR",
                   help="W7: also time this model (written by prune --hf ... --quantize int8, its OUT/model)")
    p.add_argument("--max-seconds", type=_positive(float), default=60.0, help="W7: time allowed for the interleaved "
                                                                                "rounds")
    p.add_argument("--out", default="bench/results")


#: where GitHub Classroom's grading step writes its results (multihead.grader.platforms.LAYOUTS["classroom"])
CLASSROOM_RESULTS = ".multihead/results.json"


def earned(root: str, check: str) -> bool:
    """Whether ``check`` earned its points in the results GitHub Classroom's grading step wrote under ``root``
    (``check --platform classroom --passed CHECK``: one workflow step a check, answered without importing torch); a
    ValueError where there are no results, or no such check."""
    import json
    import os

    path = os.path.join(root, CLASSROOM_RESULTS)
    if not os.path.isfile(path):
        raise ValueError(f"--passed: {path} does not exist: the grading step (--platform classroom --grade) writes it")
    with open(path) as f:
        tests = {t["name"]: t for t in json.load(f)["tests"]}
    if check not in tests:
        raise ValueError(f"--passed {check!r} is not a check of this assignment; its checks: {', '.join(tests)}")
    return tests[check]["score"] >= tests[check]["max_score"] > 0


def _fork_server(args):
    """The grader's fork server (:mod:`multihead.grader.zygote`) started now, before this process imports torch,
    where ``check`` grades in a process that has not imported multihead (``--platform P --grade``, a file, a
    class): its own torch loads beside this process's, instead of after it -- on a platform, where each submission
    is a fresh process, that is one import of torch in two. (its control socket, its process, its HOME, the script),
    for :func:`multihead.grader.runner.adopt`; None where it is not started."""
    import os

    grades = args.command == "check" and (args.grade or args.target) and not (args.write or args.merge or args.passed)
    if not grades or "multihead" in sys.modules or not sys.platform.startswith("linux") or \
            os.environ.get("MULTIHEAD_GRADER_FORK", "1") == "0":
        return None
    import socket
    import subprocess
    import tempfile

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "multihead", "grader",
                          "zygote.py")
    if not os.path.isfile(script) or not hasattr(socket, "send_fds"):
        return None
    ours, theirs = socket.socketpair()
    home = tempfile.mkdtemp(prefix="multihead-zygote-")
    proc = subprocess.Popen([sys.executable, "-I", script, "--clean", str(theirs.fileno()), home],
                            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    theirs.close()
    return ours, proc, home, script


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check" and args.passed and args.platform == "classroom":
        try:
            return 0 if earned(args.root or ".", args.passed) else 1
        except ValueError as e:
            print(f"multihead check: {e}", file=sys.stderr)
            return 2
    early = _fork_server(args)  # before torch is imported here: the two load side by side
    from multihead.apps import cli

    try:
        return cli.run(args, early)
    except (ValueError, FileNotFoundError, ImportError) as e:  # our own checks, a missing extra: one line
        print(f"multihead {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

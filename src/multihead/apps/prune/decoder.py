"""``multihead prune --hf DIR`` on a causal language model: cut the way decoder runtimes load it, recover, judge it as
decoder users do, in memory bounded by the models held (the unpruned one, the cut being recovered with its AdamW
moments and, under a target, the last cut kept) and one batch.

The cut is planned in the units the runtime stores (:func:`plan`): with grouped key/value heads (Hkv > 1) whole
key/value groups, the same number in every layer (the KV cache shrinks by that share); with one key/value head
(Gemma 3 270M) or ``unit="query"``, the same number of query heads inside every group of every layer. Either way
every layer keeps one (H, Hkv, D), so the folder written is a standard config ``AutoModelForCausalLM.from_pretrained``
loads as it is (read back and compared before the command returns), and no layer's weights or KV cache grow
(:func:`multihead.heads.prune` refuses an uneven cut). Asked (``per_layer``, ``--per-layer``), the same number of
units over the whole model is placed where they matter least, so layers may keep different counts
(:func:`plan_per_layer`: still whole groups, or query heads evenly inside every group of a layer): the folder then
keeps each layer's counts (:func:`multihead.hf.save`; ``multihead.hf.load`` reads it, transformers'
``from_pretrained`` cannot, said in one line) and GGUF holds them as llama.cpp's per-layer counts. Which units go
in each layer: the least important, measured by cutting each unit alone (:func:`importance`: the next-token KL from
the unpruned model on text and the fall of the behaviour's logit difference, each normalised over the model,
summed; the text alone cut SmolLM2's IOI heads, ``bench/results/smollm2_recover``).

Fidelity, on text and prompts the cut and the recovery never saw: the perplexity ratio and the next-token KL to the
unpruned model on the installed packages' descriptions (another kind of text than the recovery's docstrings and
language reference), and the behaviour -- IOI (:mod:`multihead.apps.common.ioi`: importance on four templates, judgement
on the other four) or the user's own prompt pairs (:func:`read_behaviour`). The unpruned model's distributions are
computed batch by batch beside the cut one's, never kept for a corpus (a 49,152-word vocabulary holds 200 MB a
batch of 8 x 128 tokens).

Recovery (the default, as the bench found it): distillation toward the unpruned model's next-token distributions
on windows of packed text (no padding), AdamW at 3e-4 decaying along a half cosine, the embeddings frozen (a tied
embedding is a fifth of SmolLM2's weights: its gradient and AdamW's moments would take 0.35 GB for nothing the cut
changed), cut short to the time budget. Launched by ``torchrun`` (``torchrun --nproc-per-node N -m multihead prune
--hf DIR ...``), every rank runs the command and the recovery is data parallel (:func:`multihead.apps.prune.causal.recover`:
each rank its share of every batch, DistributedDataParallel over gloo; ``--fsdp``: FSDP2, every rank holding its
share of the weights and AdamW's moments), so the ranks hold one model, the one a single process makes within
rounding; rank 0 alone writes the folder, the formats and the report.
"""

from __future__ import annotations

import copy
import json
import random
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.timing import cpu_flags

#: what a cut removes in each layer: whole key/value groups, or query heads evenly inside every group
UNITS = ("auto", "group", "query")
#: the built-in behaviour's templates: importance reads the first four, the judgement the other four
IMPORTANCE_TEMPLATES, JUDGED_TEMPLATES = slice(0, 4), slice(4, 8)
#: windows of text (``seq`` tokens each) each unit's cost is measured on (:func:`unit_costs`): SmolLM2's 90 groups
#: took 563 s at 2 threads
IMPORTANCE_WINDOWS = 8
#: the behaviour's accuracy a candidate must keep, as a share of the unpruned model's (the worse one counts)
BEHAVIOUR_SHARE = 0.95


#: the quantized dtypes, whose files are judged by what quantizing cost their perplexity
QUANTIZED_DTYPES = ("q8_0", "q4_k_m", "int4")
#: what ``--formats`` writes beside the transformers folder: {name: (runtime, the writer's dtype)}
FORMATS = {"gguf-f16": ("gguf", "f16"), "gguf-q8_0": ("gguf", "q8_0"), "gguf-q4_k_m": ("gguf", "q4_k_m"),
           "genai-fp32": ("genai", "fp32"), "genai-int4": ("genai", "int4")}


@dataclass(frozen=True)
class DecoderOptions:
    """What ``multihead prune --hf DIR`` asks of :func:`run` on a causal LM. ``fraction``: the share of each layer's
    units cut (rounded to whole units: SmolLM2's 3 key/value groups: 1/3 cuts one); with a target, the furthest cut
    tried. ``unit``: "group", "query" or "auto" (groups where a layer has more than one key/value head).
    ``target``: ("perplexity", R) -- the perplexity ratio at most R -- or ("kl", K) -- the next-token KL at most K
    nats; the behaviour must keep :data:`BEHAVIOUR_SHARE` of its accuracy too. ``behaviour``: a JSON-lines file of
    prompt pairs (:func:`read_behaviour`) instead of IOI. ``recover``: distillation steps at most (0: none),
    ``lr``, ``seq`` tokens a window and ``batch`` windows a step; ``deadline``: a ``time.monotonic()`` time the run
    keeps to (recovery is cut short to fit it). ``formats``: the runtimes' files written beside the folder
    (:data:`FORMATS`, :func:`write_formats`). ``per_layer``: as many units over the model as the even cut, placed
    per layer (:func:`plan_per_layer`). ``fsdp``: under torchrun, the recovery fully sharded (FSDP2) rather than
    data parallel (DDP). ``decode_contexts``: each format's file timed against its peer (:func:`write_peers`) in its
    runtime (:mod:`multihead.deploy.decoding`), decoding ``decode_tokens`` tokens up to each context, in
    ``decode_rounds`` rounds, each file stepped in alternation with its peer (:func:`decode_speed`)."""

    fraction: float | None = None
    unit: str = "auto"
    target: tuple[str, float] | None = None
    behaviour: Path | None = None
    recover: int = 400
    lr: float = 3e-4
    seq: int = 128
    batch: int = 2
    held_out: int = 64
    prompts: int = 32
    deadline: float | None = None
    progress: bool = True
    formats: tuple[str, ...] = ()
    per_layer: bool = False
    fsdp: bool = False
    decode_contexts: tuple[int, ...] = ()
    decode_rounds: int = 3
    decode_tokens: int = 32


@dataclass
class Behaviour:
    """Prompt pairs scored by the logit difference at the last position: ``right`` above ``wrong`` on the clean
    prompt (IOI: the indirect object's name above the subject's). ``importance`` and ``judged`` are
    :func:`multihead.apps.common.ioi.batches`-shaped lists; ``name`` says which behaviour."""

    name: str
    importance: list[dict]
    judged: list[dict]


@dataclass
class Judgement:
    """One model's fidelity: perplexity and its ratio to the unpruned model's, next-token KL (nats), the behaviour's
    accuracy (its ratio to the unpruned model's) and mean logit difference."""

    perplexity: float
    perplexity_ratio: float
    kl: float
    tokens: int
    accuracy: float
    accuracy_ratio: float
    logit_diff: float
    prompts: int

    def meets(self, target: tuple[str, float] | None) -> bool:
        """The target's figure within it and the behaviour kept (:data:`BEHAVIOUR_SHARE`): the worse one counts."""
        if target is None:
            return True
        kind, value = target
        text = self.perplexity_ratio <= value if kind == "perplexity" else self.kl <= value
        return text and self.accuracy_ratio >= BEHAVIOUR_SHARE


# --- what the model is, and the plan in its units ---


def layer_counts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{attention module: (H, Hkv)} from each module's derived head layout (:func:`multihead.hf.attach`)."""
    import multihead.hf as mhf
    from multihead.layer.hooks import num_heads

    out = {}
    for name, m in mhf.attention_modules(model).items():
        layout = m.attention_hooks.layout
        if layout is None:
            why = m.attention_hooks.layout_reason or "no head layout was derived"
            raise ValueError(f"{name} ({type(m).__name__}) cannot be cut: {why}.")
        out[name] = (num_heads(m), layout.counts(m, m.attention_hooks.parent)[1])
    return out


def unit_of(counts: dict[str, tuple[int, int]], unit: str) -> tuple[str, int]:
    """("group" or "query", units per layer): groups where every layer has more than one key/value head and
    ``unit`` allows, else query heads inside each group (counted per group). ValueError for a model whose layers
    differ (no even cut holds every layer) or that has nothing to cut."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}; got {unit!r}.")
    shapes = set(counts.values())
    if len(shapes) != 1:
        raise ValueError(f"the layers hold different head counts ({sorted(shapes)}): no cut keeps one count in every "
                         "layer, as a standard config needs; this command cuts evenly only.")
    H, Hkv = shapes.pop()
    if unit == "group" or (unit == "auto" and Hkv > 1):
        if Hkv < 2:
            raise ValueError(f"unit 'group' needs two key/value heads or more in a layer; this model has {Hkv} (its "
                             f"{H} query heads share it): cut query heads (unit 'query').")
        return "group", Hkv
    if H // Hkv < 2:
        raise ValueError(f"each key/value head serves one query head (H={H}, Hkv={Hkv}): cut whole groups (unit "
                         "'group').")
    return "query", H // Hkv


def units_cut(fraction: float, per_layer: int, kind: str) -> int:
    """The whole units ``fraction`` of ``per_layer`` cuts (rounded), refused where it rounds to none or all."""
    k = round(fraction * per_layer)
    if not 1 <= k < per_layer:
        possible = ", ".join(f"{i / per_layer:.2f} cuts {i}" for i in range(1, per_layer))
        what = "key/value groups" if kind == "group" else "query heads in each key/value group"
        raise ValueError(f"--fraction {fraction:g} cuts {k} of the {per_layer} {what} in each layer; a cut keeps at "
                         f"least one and removes at least one: {possible}.")
    return k


def plan(scores: dict[str, Tensor], counts: dict[str, tuple[int, int]], kind: str, k: int) -> dict[str, list[int]]:
    """{module: query heads removed}: in each layer the ``k`` least important key/value groups (their query heads'
    scores summed), or the ``k`` least important query heads of every group; ``scores`` {module: (H,)}."""
    out = {}
    for name, s in scores.items():
        H, Hkv = counts[name]
        G = H // Hkv
        by_group = s.reshape(Hkv, G)  # (H,) -> (Hkv, G): head h is group h // G's
        if kind == "group":
            gone = by_group.sum(-1).argsort()[:k].tolist()
            out[name] = sorted(h for g in gone for h in range(g * G, (g + 1) * G))
        else:
            out[name] = sorted(g * G + int(i) for g in range(Hkv) for i in by_group[g].argsort()[:k])
    return out


def plan_per_layer(scores: dict[str, Tensor], counts: dict[str, tuple[int, int]], kind: str,
                   total: int) -> dict[str, list[int]]:
    """{module: query heads removed}: the ``total`` least important units of the whole model, each layer keeping one
    at least -- a unit is a key/value group (its query heads' scores summed), or (``kind`` "query") one query head
    of every group of a layer (the j-th least important of each, summed): inside a layer the cut stays whole groups
    or even inside every group, only the count differs between layers. ``scores`` {module: (H,)}, comparable
    across layers (:func:`importance` normalises over the model)."""
    costs = []  # (cost, layer's order, j): cutting a j+1-th unit in that layer
    for i, (name, s) in enumerate(scores.items()):
        H, Hkv = counts[name]
        by_group = s.reshape(Hkv, H // Hkv)  # (H,) -> (Hkv, G): head h is group h // G's
        units = by_group.sum(-1).sort().values if kind == "group" else by_group.sort(-1).values.sum(0)  # (units,)
        costs += [(float(c), i, j) for j, c in enumerate(units[:-1].tolist())]  # the last unit stays
    if not 1 <= total <= len(costs):
        raise ValueError(f"a per-layer cut of {total} units: the model has {len(costs)} to cut (each layer keeps one).")
    per = dict.fromkeys(range(len(scores)), 0)
    for _, i, _ in sorted(costs)[:total]:
        per[i] += 1
    names = list(scores)
    return {names[i]: plan({names[i]: scores[names[i]]}, counts, kind, n)[names[i]] for i, n in per.items() if n}


# --- text and behaviour ---


def _windows(tok, texts: Sequence[str], seq: int, seed: int = 0) -> list[Tensor]:
    """``texts`` shuffled, joined and cut into windows of ``seq`` real tokens (no padding): each (seq,)."""
    texts = list(texts)
    random.Random(seed).shuffle(texts)
    ids = tok(" ".join(texts), add_special_tokens=False)["input_ids"]
    return [torch.tensor(ids[i:i + seq]) for i in range(0, len(ids) - seq + 1, seq)]


def _stacked(windows: Sequence[Tensor]) -> dict:
    x = torch.stack(list(windows))  # (B, seq)
    return {"input_ids": x, "attention_mask": torch.ones_like(x)}


def read_behaviour(path: str | Path, tok) -> list[dict]:
    """The user's behaviour: a JSON-lines file, one pair a line, ``{"clean": text, "corrupted": text, "answer":
    token, "wrong": token}`` -- on the clean text the model should rank ``answer`` above ``wrong`` at the last
    position; the corrupted text has as many tokens. Returns the pairs as rows (clean ids, corrupted ids, answer id,
    wrong id), in the file's order (:func:`_batched` makes them batches).
    ValueError, naming the line, for a line that does not parse, a missing key, an answer that is not one token, or
    texts of different lengths."""
    rows = []
    lines = Path(path).read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--behaviour {path}, line {i}: not JSON ({e.msg}); each line is "
                             '{"clean": ..., "corrupted": ..., "answer": ..., "wrong": ...}.') from None
        missing = [k for k in ("clean", "corrupted", "answer", "wrong") if not isinstance(d, dict) or
                   not isinstance(d.get(k), str)]
        if missing:
            raise ValueError(f"--behaviour {path}, line {i}: {', '.join(missing)} missing (each a string).")
        ids, bad = tok(d["clean"])["input_ids"], tok(d["corrupted"])["input_ids"]
        right, wrong = (tok(d[k], add_special_tokens=False)["input_ids"] for k in ("answer", "wrong"))
        if len(right) != 1 or len(wrong) != 1:
            raise ValueError(f"--behaviour {path}, line {i}: answer {d['answer']!r} is {len(right)} tokens and wrong "
                             f"{d['wrong']!r} {len(wrong)}; each must be one token (a leading space usually "
                             "makes a word one).")
        if len(ids) != len(bad):
            raise ValueError(f"--behaviour {path}, line {i}: the clean text is {len(ids)} tokens, the corrupted "
                             f"{len(bad)}; they must have as many.")
        rows.append((ids, bad, right[0], wrong[0]))
    if len(rows) < 2:
        raise ValueError(f"--behaviour {path} holds {len(rows)} pair(s); give at least 2 (half for importance, half "
                         "judged).")
    return rows


def _batched(rows: list[tuple]) -> list[dict]:
    """Pairs as :func:`multihead.apps.common.ioi.batches`-shaped batches, one per token length (no padding)."""
    groups: dict[int, list] = {}
    for r in rows:
        groups.setdefault(len(r[0]), []).append(r)
    return [{"input_ids": torch.tensor([r[0] for r in g]), "corrupted_ids": torch.tensor([r[1] for r in g]),
             "io": torch.tensor([r[2] for r in g]), "s": torch.tensor([r[3] for r in g])} for g in groups.values()]


def behaviour(tok, o: DecoderOptions) -> Behaviour:
    """The user's pairs (``o.behaviour``) or IOI: importance on prompts of four templates (seed 2), judged on
    prompts of the other four (seed 1)."""
    from multihead.apps.common import ioi

    if o.behaviour is not None:
        rows = read_behaviour(o.behaviour, tok)  # every other pair (in the file's order) chooses, the rest judge
        return Behaviour(f"the pairs of {o.behaviour}", _batched(rows[0::2]), _batched(rows[1::2]))
    imp = ioi.batches(tok, ioi.make(o.prompts, tok, seed=2, templates=ioi.TEMPLATES[IMPORTANCE_TEMPLATES]))
    judged = ioi.batches(tok, ioi.make(o.prompts, tok, seed=1, templates=ioi.TEMPLATES[JUDGED_TEMPLATES]))
    return Behaviour("IOI (judged on templates the importance never read)", imp, judged)


@dataclass
class Text:
    """The run's text: ``select`` (importance windows), ``recovery`` (batches of packed windows, never the
    importance's), ``held_out`` (the packages' descriptions, padded batches: what fidelity is judged on)."""

    select: list[dict]
    recovery: list[dict]
    held_out: list[dict]
    notes: list[str] = field(default_factory=list)


def text(tok, o: DecoderOptions) -> Text:
    """Recovery on the standard library's docstrings (as many as the steps use) and the language reference, packed
    into windows; fidelity on ``o.held_out`` sentences of the installed packages' descriptions (another kind of
    text, none in the recovery)."""
    from multihead.apps.common.data import docstring_sentences, package_sentences, sentences
    from multihead.apps.prune import causal

    need = (IMPORTANCE_WINDOWS + max(o.recover, 1) * o.batch) * o.seq  # tokens: the importance's windows, each step's
    known = sentences() + docstring_sentences(need // 8)  # a docstring sentence has 8 tokens or more: as many as the
    # steps can use (all of them, about 6,500, for 400 steps of 2 windows of 128), and no stdlib file parsed for less
    unseen = package_sentences(o.held_out, exclude=set(known))
    if len(unseen) < 8:
        raise ValueError(f"only {len(unseen)} package sentences to judge fidelity on (8 at least): install more "
                         "packages or lower the held-out count.")
    windows = _windows(tok, known, o.seq)
    n = IMPORTANCE_WINDOWS  # the importance's text: the first windows, two a batch
    select = [_stacked(windows[i:i + 2]) for i in range(0, n, 2)]
    rec = [_stacked(windows[i:i + o.batch]) for i in range(n, len(windows) - o.batch + 1, o.batch)]
    held = causal.text_batches(tok, unseen, size=4, max_length=64)  # 4: the two models' (B, L, V) at a time
    return Text(select, rec, held, [f"recovery on {len(rec)} batches of {o.batch} windows of {o.seq} tokens (the "
                                    "standard library's docstrings and the language reference), importance on "
                                    f"{IMPORTANCE_WINDOWS} more; "
                                    f"fidelity on {len(unseen)} sentences of the installed packages' descriptions"])


def _lm_loss(m: nn.Module, b: dict) -> Tensor:
    return m(**b, labels=b["input_ids"]).loss


def _logprobs(model: nn.Module, t: Text) -> list[Tensor]:
    """The model's next-token log-probabilities on the importance windows: each (B, L, V) float32."""
    return [torch.log_softmax(model(**b).logits.float(), -1) for b in t.select]


def _measures(model: nn.Module, t: Text, beh: Behaviour, reference: Sequence[Tensor]) -> tuple[float, float]:
    """The mean next-token KL (nats) of ``model`` from the reference's log-probabilities (:func:`_logprobs`) on the
    importance windows, and the behaviour's mean logit difference."""
    from multihead.apps.common import ioi

    kl = sum(float(F.kl_div(torch.log_softmax(model(**b).logits.float(), -1), r, log_target=True,
                            reduction="none").sum(-1).mean()) for b, r in zip(t.select, reference)) / len(t.select)
    diff = sum(float(ioi.logit_diff(model(input_ids=b["input_ids"], logits_to_keep=1).logits.float(), b).mean())
               for b in beh.importance) / len(beh.importance)
    return kl, diff


def unit_costs(model: nn.Module, t: Text, beh: Behaviour, counts: dict[str, tuple[int, int]],
               kind: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """What cutting each unit alone costs, measured with the unit gated off (a key/value group: its G query heads
    together; ``kind`` "query": one query head), which is what the cut computes: ({module: (H,)} the next-token KL
    from the unpruned model on the importance windows, {module: (H,)} the fall of the behaviour's mean logit
    difference), a group's cost spread evenly over its query heads. One forward of the importance text and prompts
    a unit; the unpruned model's log-probabilities on the windows are held meanwhile (8 x 128 tokens: 200 MB for a
    49,152-word vocabulary)."""
    from multihead import heads

    text_cost, task_cost = {}, {}
    with torch.no_grad():
        reference = _logprobs(model, t)
        base = _measures(model, t, beh, reference)[1]
        for name, (H, Hkv) in counts.items():
            G = H // Hkv
            units = [list(range(g * G, (g + 1) * G)) for g in range(Hkv)] if kind == "group" else [[h] for h in range(H)]
            text_cost[name], task_cost[name] = torch.zeros(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
            for u in units:
                gates = torch.ones(H)
                gates[u] = 0.0
                with heads.gated(model, {name: gates}):
                    kl, diff = _measures(model, t, beh, reference)
                text_cost[name][u] = kl / len(u)
                task_cost[name][u] = (base - diff) / len(u)
    return text_cost, task_cost


def importance(model: nn.Module, t: Text, beh: Behaviour, counts: dict[str, tuple[int, int]],
               kind: str) -> dict[str, Tensor]:
    """{module: (H,)} each query head's share of what cutting its unit costs (:func:`unit_costs`), the text's and the
    behaviour's each normalised to a total (of magnitudes) of 1 over the model, so neither drowns the other, summed.

    Measured rather than estimated from the gradient: on SmolLM2-135M (a third of the groups cut, on the command's
    unseen text and IOI templates, ``bench/results/smollm2_command``) the gradient's choice started its recovery at
    perplexity 1.88x and ended 60 steps at 1.21x; the measured choice started at 1.37x and ended at 1.05x (IOI
    accuracy 1.000 both). The gradient at the unpruned model linearises a cut that is not small."""
    text_cost, task_cost = unit_costs(model, t, beh, counts, kind)
    a, b = torch.stack(list(text_cost.values())), torch.stack(list(task_cost.values()))  # (layers, H) each
    both = a / a.abs().sum().clamp_min(1e-30) + b / b.abs().sum().clamp_min(1e-30)
    return {n: both[i].float() for i, n in enumerate(text_cost)}


def judge(model: nn.Module, reference: nn.Module, t: Text, beh: Behaviour,
          unpruned: Judgement | None = None) -> Judgement:
    """``model`` against ``reference`` on the held-out text (batch by batch: the reference's distributions are
    never kept) and the judged behaviour prompts; ratios to ``unpruned`` (None: this is the unpruned model)."""
    from multihead.apps.common import ioi
    from multihead.apps.prune import causal

    f = causal.fidelity(model, reference, t.held_out)
    s = ioi.score(model, beh.judged)
    if unpruned is None and s.accuracy == 0:
        raise ValueError(f"the unpruned model gets none of the {s.n} judged prompts of {beh.name} right: a cut cannot "
                         "be shown to keep a behaviour the model does not have; give --behaviour pairs it does.")
    base_acc = unpruned.accuracy if unpruned is not None else s.accuracy
    return Judgement(f.perplexity, f.perplexity / f.reference_perplexity, f.kl, f.tokens, s.accuracy,
                     s.accuracy / base_acc, s.logit_diff, s.n)


def _freeze_embeddings(model: nn.Module) -> None:
    """The input and output embeddings left out of recovery (the cut changes neither)."""
    for m in (model.get_input_embeddings(), model.get_output_embeddings()):
        if m is not None:
            for p in m.parameters():
                p.requires_grad_(False)


@dataclass
class Candidate:
    """One cut tried: ``k`` units a layer, the heads removed, its judgements zero-shot and recovered, the recovery's
    curve (points of {step, seconds, judgement}) and losses."""

    k: int
    removed: dict[str, list[int]]
    zero_shot: Judgement
    recovered: Judgement | None = None
    curve: list[dict] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0

    @property
    def final(self) -> Judgement:
        return self.recovered or self.zero_shot


@dataclass
class Context:
    """What every cut of one run is judged and recovered against: the unpruned model, the text, the behaviour, the
    unpruned model's judgement and the options."""

    reference: nn.Module
    text: Text | None
    behaviour: Behaviour | None
    unpruned: Judgement
    options: DecoderOptions
    #: seconds one judgement takes (the unpruned model's, measured): a recovery's budget leaves room for its own
    judge_s: float = 0.0
    #: seconds kept after the cuts for the formats and the decode table (:func:`after_cuts_s`: from what the peers'
    #: files and their first timing took, where they were made; else :data:`FORMAT_S` a format)
    after_s: float | None = None

    def judge(self, model: nn.Module) -> Judgement:
        return judge(model, self.reference, self.text, self.behaviour, self.unpruned)


def _recovered(cut: nn.Module, ctx: Context, until: float | None, c: Candidate) -> None:
    """Distil ``cut`` toward the unpruned model (``recover`` steps at most, cut short to ``until``), judging it every
    so many steps into ``c.curve``."""
    from multihead.apps.prune import causal

    o = ctx.options
    every = max(1, o.recover // 8)
    started = time.monotonic()

    def observe(step: int) -> None:
        if step % every == 0:
            c.curve.append({"step": step, "seconds": round(time.monotonic() - started, 1), **asdict(ctx.judge(cut))})

    _freeze_embeddings(cut)
    losses = causal.recover(cut, ctx.reference, ctx.text.recovery, o.recover, lr=o.lr, observe=observe, until=until,
                            shard=o.fsdp)
    c.steps, c.seconds = len(losses), time.monotonic() - started
    c.recovered = ctx.judge(cut)
    if not c.curve or c.curve[-1]["step"] != c.steps:
        c.curve.append({"step": c.steps, "seconds": round(c.seconds, 1), **asdict(c.recovered)})


#: seconds kept after the last candidate for saving, reading back and the report; and for each format asked
RESERVE_S, FORMAT_S = 60.0, 90.0
#: the judgements a recovery makes: the curve's points (at most 8) and the last
JUDGEMENTS = 9


def search(ctx: Context, scores: dict[str, Tensor], counts: dict, kind: str, kmax: int
           ) -> tuple[list[Candidate], int | None, nn.Module | None]:
    """The cuts tried and the one kept: without a target, ``kmax`` units a layer; with one, 1, 2, ... units until a
    cut misses it (the kept model is the furthest cut tried that meets it; None when none does); ``per_layer``: as
    many units over the model, placed by :func:`plan_per_layer`. Each candidate is recovered within its share of the
    time left."""
    from multihead import heads

    o = ctx.options
    ks = list(range(1, kmax + 1)) if o.target is not None else [kmax]
    tried: list[Candidate] = []
    kept, kept_model = None, None
    for i, k in enumerate(ks):
        removed = plan_per_layer(scores, counts, kind, k * len(counts)) if o.per_layer else plan(scores, counts, kind, k)
        cut = copy.deepcopy(ctx.reference)
        heads.prune(cut, removed)
        c = Candidate(k, removed, ctx.judge(cut))
        if o.recover:
            until = None
            if o.deadline is not None:  # this candidate's share of what is left, less its judgements
                after = FORMAT_S * len(o.formats) if ctx.after_s is None else ctx.after_s
                left = o.deadline - RESERVE_S - after - time.monotonic()
                until = time.monotonic() + max(left / (len(ks) - i) - JUDGEMENTS * ctx.judge_s, 0.0)
            _recovered(cut, ctx, until, c)
        tried.append(c)
        if not c.final.meets(o.target):
            break
        kept, kept_model = len(tried) - 1, cut
    return tried, kept, kept_model


# --- what the cut saves, the folder written and read back, the report ---


def sizes(model: nn.Module) -> dict:
    """Parameters, and KV cache bytes per token of context at f16 (what llama.cpp and GenAI keep by default) and
    at the model's own dtype: 2 (key and value) x Hkv x D x bytes, summed over the layers."""
    import multihead.hf as mhf

    kv = 0  # Hkv * D summed over the layers
    for m in mhf.attention_modules(model).values():
        layout = m.attention_hooks.layout
        kv += layout.counts(m, m.attention_hooks.parent)[1] * layout.head_dim(m)
    p = next(model.parameters())
    return {"parameters": sum(x.numel() for x in model.parameters()), "kv_bytes_per_token_f16": 2 * kv * 2,
            f"kv_bytes_per_token_{str(p.dtype).removeprefix('torch.')}": 2 * kv * p.element_size()}


def save(cut: nn.Module, source: Path, folder: Path, t: Text, per_layer: bool = False) -> list[str]:
    """``cut`` written as a transformers folder (:func:`multihead.hf.save`: a standard config at the pruned size)
    with the checkpoint's other files as it shipped them (tokenizer, generation config:
    :func:`multihead.apps.prune.hf_models.save_with_files`), then read back with ``AutoModelForCausalLM.from_pretrained``
    as it is: its parameters by name and shape the family's own (nothing added) and its logits on a held-out batch
    equal to ``cut``'s within float32 rounding; RuntimeError otherwise. ``per_layer``: a cut whose layers keep
    different counts is kept so (each layer's counts in config.json) and read back by ``multihead.hf.load``
    instead, one line saying that transformers cannot load it. Returns the lines the report says."""
    import transformers

    import multihead.hf as mhf
    from multihead.apps.prune.hf_models import save_with_files

    save_with_files(cut, folder, source)
    cfg = json.loads((folder / "config.json").read_text())
    own = bool(cfg.get(mhf.HEADS_KEY)) and not cfg.get(mhf.FULL_SIZE_KEY)  # each layer's own counts
    if own and not per_layer:
        raise RuntimeError(f"{folder}: the cut was written with per-layer counts only multihead.hf.load reads "
                           f"({cfg.get(mhf.LOADS_KEY)}); the command writes standard folders unless --per-layer.")
    back = mhf.load(folder) if own else transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                                            dtype=torch.float32).eval()
    mine = {k: tuple(v.shape) for k, v in cut.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in back.state_dict().items()}
    if mine != theirs:
        extra = sorted(set(mine) ^ set(theirs)) or [k for k in mine if mine[k] != theirs[k]]
        raise RuntimeError(f"{folder} read back with other parameters than the cut model's: {extra[:4]}.")
    b = t.held_out[0]
    with torch.no_grad():
        a, z = cut(**b).logits, back(**b).logits  # (B, L, V)
    real = b["attention_mask"].bool()
    diff = float((a - z)[real].abs().max())
    tol = 1e-4 * max(1.0, float(a[real].abs().max()))
    if not diff <= tol:
        raise RuntimeError(f"{folder} read back by {'multihead.hf.load' if own else 'from_pretrained'} gives logits "
                           f"{diff:.3g} from the cut model's (tolerance {tol:.3g}).")
    if own:
        return [f"{folder}: each layer keeps its own head counts ({per_layer_words(layer_counts(cut))}): "
                "transformers' from_pretrained cannot load it (one count per model), multihead.hf.load does; its "
                f"logits on held-out text within {diff:.2g} of the cut model's (tolerance {tol:.2g}); GGUF "
                "(--formats gguf-*) holds the counts as llama.cpp's per-layer layout"]
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim")
    return [f"{folder}: AutoModelForCausalLM.from_pretrained loads it as it is (num_attention_heads={H}, "
            f"num_key_value_heads={Hkv}, head_dim={D}; its parameters the family's own, shape for shape); its logits "
            f"on held-out text within {diff:.2g} of the cut model's (tolerance {tol:.2g})"]


def per_layer_words(counts: dict[str, tuple[int, int]]) -> str:
    """Each layer's (H, Hkv) as the report says them: "H=4, Hkv=2 in layers 0, 2; H=6, Hkv=3 in layer 1"."""
    by: dict[tuple[int, int], list[int]] = {}
    for i, c in enumerate(counts.values()):
        by.setdefault(tuple(c), []).append(i)
    return "; ".join(f"H={H}, Hkv={Hkv} in layer{'s' if len(ls) > 1 else ''} {', '.join(map(str, ls))}"
                     for (H, Hkv), ls in by.items())


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _row(name: str, j: Judgement | dict, met: str = "") -> str:
    j = j if isinstance(j, dict) else asdict(j)
    return (f"| {name} | {j['perplexity']:.2f} ({j['perplexity_ratio']:.3f}x) | {j['kl']:.4f} | "
            f"{j['accuracy']:.3f} ({j['accuracy_ratio']:.3f}x) | {j['logit_diff']:+.3f} | {met} |")


def markdown(r: dict) -> str:
    """report.md: what was cut, the fidelity table, the recovery curves, the sizes, memory and the folder."""
    target = r["target"]
    lines = [f"# {r['model']}: {r['unit_words']} cut, {r['k_words']}\n",
             f"`{r['command']}`\n",
             f"CPU flags: {' '.join(r['cpu_flags']) or 'unknown'}; torch {r['torch']}, {r['threads']} thread(s); "
             f"{r['seconds']:.0f} s; peak resident memory {r['peak_rss_mib']:.0f} MiB"
             + (f" (rank 0 of {r['ranks']}: the recovery data parallel over the ranks)" if r.get("ranks", 1) > 1
                else "") + ".\n",
             "| phase | seconds | peak resident memory by its end (MiB) |", "|---|---:|---:|",
             *(f"| {k} | {v:.0f} | {r['peak_rss_mib_by_phase'][k]:,.0f} |" for k, v in r["phases"].items()), ""]
    lines += [f"- {n}" for n in r["notes"]]
    lines += ["", "Fidelity on text and prompts neither the choice of the cut nor the recovery saw (" + r["behaviour"]
              + "); " + (f"target: {target[0]} {'ratio ' if target[0] == 'perplexity' else ''}<= {target[1]:g} and "
                         f"the behaviour's accuracy >= {BEHAVIOUR_SHARE:.0%} of the unpruned model's (the worse one "
                         "counts)." if target else "no target: the cut asked for, recovered."),
              "", "| model | perplexity (x unpruned) | KL (nats) | behaviour accuracy (x unpruned) | logit diff | "
                  "meets the target |", "|---|---:|---:|---:|---:|---|", _row("unpruned", r["unpruned"])]
    for i, c in enumerate(r["tried"]):
        what = f"{c['k']} unit(s) a layer" + (" on average" if r.get("per_layer") else "")
        lines.append(_row(f"{what}, zero-shot", c["zero_shot"]))
        if c["recovered"] is not None:
            ok = "yes" if c["meets"] else "no"
            lines.append(_row(f"{what}, recovered ({c['steps']} steps, {c['seconds']:.0f} s)", c["recovered"],
                              ok + (" (kept)" if i == r["kept"] else "")))
    for c in r["tried"]:
        if c["curve"]:
            lines += ["", f"Recovery of the cut of {c['k']} unit(s) a layer (fidelity against steps):", "",
                      "| step | seconds | perplexity ratio | KL | behaviour accuracy | logit diff |",
                      "|---:|---:|---:|---:|---:|---:|"]
            lines += [f"| {p['step']} | {p['seconds']:.0f} | {p['perplexity_ratio']:.3f}x | {p['kl']:.4f} | "
                      f"{p['accuracy']:.3f} | {p['logit_diff']:+.3f} |" for p in c["curve"]]
    s0, s1 = r["sizes"]["unpruned"], r["sizes"].get("kept")
    if s1 is not None:
        lines += ["", "| | unpruned | kept | kept / unpruned |", "|---|---:|---:|---:|"]
        lines += [f"| {key.replace('_', ' ')} | {s0[key]:,} | {s1[key]:,} | {s1[key] / s0[key]:.4f} |" for key in s0]
    if r.get("per_layer") and r["kept_counts"]:
        lines += ["", f"Per-layer counts kept: {per_layer_words(r['kept_counts'])}."]
    lines += ["", *(f"- {x}" for x in r["saved"])] if r["saved"] else ["", "- nothing saved: no cut tried met the "
                                                                         "target."]
    if r["formats"]:
        lines += ["", "The formats users run, each read back (a quantized GGUF file: what quantizing cost its "
                      "perplexity, beside what the same quantization costs the unpruned model; within: at most twice "
                      "that, plus 0.5%):", "", "| format | file | bytes | perplexity cost | the unpruned model's | "
                      "within | read back |", "|---|---|---:|---:|---:|---|---|"]
        for f in r["formats"]:
            cost, base = (f"{f[k]:.4f}x" if k in f else "" for k in ("cost", "unpruned_cost"))
            within = "" if "within" not in f else "yes" if f["within"] else "no"
            lines.append(f"| {f['format']} | {Path(f['path']).name if 'path' in f else ''} | {f.get('bytes', 0):,} | "
                         f"{cost} | {base} | {within} | {'; '.join(f['checks'])} |")
    lines += decode_lines(r.get("decode"))
    return "\n".join(lines) + "\n"


def decode_lines(d: dict | None) -> list[str]:
    """The report's decode table (:func:`decode_speed`), or the line saying how to ask for it."""
    from multihead.deploy.decoding import markdown as table

    if d is None:
        return ["", "- decoding not timed: --decode-contexts 256,2048,8192 times each file --formats writes against "
                    "its peer in its runtime"]
    out = ["", f"Decoding where the cut pays: each file against its peer, the unpruned model made into the same "
               f"format by the runtime's own tools (OUT/peers), batch 1, {d['decode']} tokens decoded up to each "
               f"context after a prompt of the rest, {d['threads']} threads, {d['rounds']} rounds (median and "
               "min-max); each file and its peer in two processes decoding in alternation, one step each in turn, "
               "the speed-up the median of the paired steps' ratios; the bound: the multiply-adds of a decoded token "
               "removed (multihead.deploy.decoding).",
           ""]
    out += [table(d["rows"], d["kv_bytes"])] if d["rows"] else ["- no file timed"]
    return out + [f"- {n}" for n in d["notes"]]


def tokenizer(path: Path):
    """The checkpoint's tokenizer with a pad token; ValueError when ``path`` is not a causal LM."""
    from multihead.apps.prune.hf_models import _tokenizer

    tok, causal = _tokenizer(Path(path))
    if not causal:
        raise ValueError(f"{path} is not a causal language model (its config names no *ForCausalLM).")
    return tok


def load(path: Path) -> nn.Module:
    """The model in float32 on multihead's attention, attached (its head layouts derived and verified), eval mode."""
    import transformers

    import multihead.hf as mhf

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="multihead").eval()
    return mhf.attach(model)


def config_counts(path: Path) -> dict[str, tuple[int, int]]:
    """{layer: (H, Hkv)} as the config says (before any weight is read): every layer the same."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg = getattr(cfg, "text_config", None) or cfg
    H, layers = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_hidden_layers", None)
    if not isinstance(H, int) or not isinstance(layers, int):
        raise ValueError(f"{path}: its config ({type(cfg).__name__}) gives no num_attention_heads and "
                         "num_hidden_layers: this command cuts decoders whose config says their head counts.")
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    return {f"layer {i}": (H, Hkv) for i in range(layers)}


def check(counts: dict, o: DecoderOptions) -> tuple[str, int, int]:
    """(unit kind, units per layer, the furthest cut in units) for ``o`` on a model of ``counts``, refused in one
    line (ValueError) before any work."""
    kind, per_layer = unit_of(counts, o.unit)
    fraction = o.fraction if o.fraction is not None else (1 - 1 / per_layer if o.target else 1 / per_layer)
    return kind, per_layer, units_cut(fraction, per_layer, kind)


def _check_budget(o: DecoderOptions, started: float) -> None:
    """A time budget that leaves no time beyond the recovery refused (ValueError, one line) before any work."""
    least = RESERVE_S + FORMAT_S * len(o.formats) + 60.0  # and a minute for loading, importance and judging
    if o.deadline is not None and o.deadline - started < least:
        raise ValueError(f"the time budget leaves {o.deadline - started:.0f} s; a causal LM's run needs {least:.0f} s "
                         "beyond its recovery (saving, reading back, the formats asked): give a longer --time-budget.")


def run(path: str | Path, out: Path, o: DecoderOptions, command: str = "") -> dict:
    """The whole command on the causal LM in ``path``: the plan, importance, the cut(s) recovered and judged, the
    kept model saved into ``out/model`` and read back, ``out/report.{json,md}``. Returns the report (``"met"``:
    False when a target was asked and no cut tried met it: nothing is saved then)."""
    started = time.monotonic()
    phases: dict[str, float] = {}
    peaks: dict[str, float] = {}

    def phase(name: str, since: list[float] = [started]) -> None:  # noqa: B006 - the last phase's end, kept here
        now = time.monotonic()
        phases[name] = round(now - since[0], 1)
        peaks[name] = round(peak_rss_mib())  # the process's peak so far: where it grew is the phase that grew it
        since[0] = now

    path, out = Path(path), Path(out)
    _check_budget(o, started)
    rank, world = _ranks(o)
    tok = tokenizer(path)
    check(config_counts(path), o)  # the plan, refused before any weight is read
    check_formats(path, o.formats, tok, per_layer=o.per_layer)
    check_decode(path, o, world)
    beh = behaviour(tok, o)  # a behaviour file that does not parse: refused here
    ref = load(path)
    counts = layer_counts(ref)  # the counts the derived layouts hold (verified on a probe)
    kind, per_layer, kmax = check(counts, o)
    phase("loading")
    t = text(tok, o)
    phase("text")
    scores = importance(ref, t, beh, counts, kind)
    phase("importance")
    base = judge(ref, ref, t, beh)
    phase("judging the unpruned model")
    ctx = Context(ref, t, beh, base, o, phases["judging the unpruned model"] / 2)  # it ran the model twice
    peers = _peers_costed(ctx, path, tok, out / "peers", phase) if o.decode_contexts else {}
    tried, kept, model = search(ctx, scores, counts, kind, kmax)
    phase("the cuts, recovered and judged")
    sizes_of = {"unpruned": sizes(ref), **({"kept": sizes(model)} if model is not None else {})}
    writes = model is not None and rank == 0  # one rank writes: the ranks hold the same model
    saved, formats, decode = _written_files(model, ctx, path, tok, out, peers=peers, phase=phase) if writes else ([], [], None)
    r = {"model": path.name, "command": command or f"multihead prune --hf {path}", "cpu_flags": cpu_flags(),
         "torch": torch.__version__, "threads": torch.get_num_threads(), "unit": kind,
         "unit_words": "whole key/value groups" if kind == "group" else "query heads evenly inside every group",
         "k_words": _k_words(counts, kind, per_layer, kmax, o.per_layer), "per_layer": o.per_layer, "rank": rank, "ranks": world,
         "kept_counts": None if model is None else {n: list(c) for n, c in layer_counts(model).items()},
         "target": list(o.target) if o.target else None, "behaviour": beh.name,
         "unpruned": asdict(base), "kept": kept, "met": kept is not None,
         "tried": [_tried(c, o) for c in tried], "sizes": sizes_of,
         "saved": saved, "formats": formats, "formats_failed": [f["failed"] for f in formats if "failed" in f],
         "decode": decode,
         "notes": t.notes, "seconds": time.monotonic() - started, "phases": phases, "peak_rss_mib": peak_rss_mib(),
         "peak_rss_mib_by_phase": peaks}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(r, indent=1))
        (out / "report.md").write_text(markdown(r))
    return r


def _tried(c: Candidate, o: DecoderOptions) -> dict:
    return {"k": c.k, "removed": c.removed, "zero_shot": asdict(c.zero_shot),
            "recovered": None if c.recovered is None else asdict(c.recovered), "meets": c.final.meets(o.target),
            "curve": c.curve, "steps": c.steps, "seconds": c.seconds}


def _written_files(model: nn.Module, ctx: Context, path: Path, tok, out: Path, *, peers: dict,
                   phase: Callable[[str], None]) -> tuple[list[str], list[dict], dict | None]:
    """The kept model's folder saved and read back, its formats written and read back, and (peers given) its
    decode table: (the folder's lines, the formats' rows, the decode table or None)."""
    o, t, ref = ctx.options, ctx.text, ctx.reference
    saved = save(model, path, out / "model", t, o.per_layer)
    phase("saving and reading back")
    formats = write_formats(model, ref, tok, out / "model", t, o.formats, peers=peers, src=path)
    if formats:
        phase("the formats, written and read back")
    decode = decode_speed(model, ref, formats, peers, o) if peers else None
    if decode is not None:
        phase("decoding timed against the peers")
    return saved, formats, decode


def _ranks(o: DecoderOptions) -> tuple[int, int]:
    """(rank, world size): this process's place under torchrun (:func:`multihead.apps.prune.causal.process_group`); what
    the ranks cannot do refused in one line (ValueError) before any work."""
    from multihead.apps.prune.causal import process_group

    rank, world = process_group()
    if o.fsdp and world < 2:
        raise ValueError("--fsdp shards the recovery over the ranks torchrun starts: launch with torchrun "
                         "--nproc-per-node N -m multihead prune ...")
    if o.recover and o.batch % world:
        raise ValueError(f"{world} ranks share each recovery batch of {o.batch} windows: give a batch that is a "
                         f"multiple of {world}.")
    return rank, world


def _k_words(counts: dict, kind: str, per_layer: int, kmax: int, placed: bool) -> str:
    """What the report's title says was cut: "up to 1 of 3 groups a layer (9 query / 3 key/value heads a layer)"."""
    H, Hkv = next(iter(counts.values()))
    return (f"up to {kmax} of {per_layer} {'groups' if kind == 'group' else 'in each group'} a layer ({H} query / "
            f"{Hkv} key/value heads a layer)" + (", as many over the model placed per layer" if placed else ""))


def summary(r: dict) -> list[str]:
    """The lines the command prints: the kept cut's fidelity, its KV cache and memory, or why none was kept."""
    base = r["unpruned"]
    lines = [f"unpruned: perplexity {base['perplexity']:.2f}, behaviour accuracy {base['accuracy']:.3f}"]
    for c in r["tried"]:
        j = c["recovered"] or c["zero_shot"]
        lines.append(f"{c['k']} unit(s) a layer{' on average' if r.get('per_layer') else ''} cut"
                     f"{' and recovered' if c['recovered'] else ''}: perplexity "
                     f"{j['perplexity_ratio']:.3f}x, KL {j['kl']:.4f}, behaviour accuracy {j['accuracy_ratio']:.3f}x"
                     + (f", meets the target: {'yes' if c['meets'] else 'no'}" if r["target"] else ""))
    if r["met"]:
        s0, s1 = r["sizes"]["unpruned"], r["sizes"]["kept"]
        if r.get("per_layer"):
            lines.append(f"per-layer counts: {per_layer_words(r['kept_counts'])}")
        lines.append(f"KV cache per token {s1['kv_bytes_per_token_f16']:,} bytes at f16, "
                     f"{s1['kv_bytes_per_token_f16'] / s0['kv_bytes_per_token_f16']:.4f} of the unpruned model's; "
                     f"parameters {s1['parameters'] / s0['parameters']:.4f}")
        lines += r["saved"]
        lines += [f"{f['format']}: {f.get('path', '')} {'; '.join(f['checks'])}" for f in r["formats"]]
        for row in (r.get("decode") or {}).get("rows", []):
            lines.append(f"{row['format']} at {row['context']} tokens of context: decode "
                         f"{row['pruned']['decode_tps']['median']:.1f} tok/s against the peer's "
                         f"{row['peer']['decode_tps']['median']:.1f}, {row['speedup']:.2f}x (bound {row['bound']:.2f}x)")
    lines.append(f"peak resident memory {r['peak_rss_mib']:.0f} MiB; {r['seconds']:.0f} s")
    return lines


# --- the formats users run ---


def check_formats(path: Path, formats: Sequence[str], tok, *, per_layer: bool = False) -> None:
    """``formats`` refused in one line before any work: an unknown name, a family the runtime's writer cannot
    hold (GenAI: Gemma 3, whose config its builder cannot read; GGUF: what llama.cpp's gemma3 graph cannot hold), a
    missing extra (naming its install line), (GGUF) a tokenizer its vocabulary writer cannot write, or
    (``per_layer``) GenAI, whose builder holds one head count for every layer, and Gemma 3's GGUF."""
    from multihead.deploy.genai import _builder_refusal
    from multihead.deploy.gguf import _check_gemma3, _vocabulary
    from multihead.deploy.llama import ARCHITECTURES
    from multihead.extras import require

    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"--formats {','.join(unknown)}: unknown; the formats are {', '.join(FORMATS)}.")
    if not formats:
        return
    genai = [f for f in formats if FORMATS[f][0] == "genai"]
    if per_layer and genai:
        raise ValueError(f"--formats {','.join(genai)}: ONNX Runtime GenAI's builder holds one head count for every "
                         "layer; --per-layer cuts are written as GGUF (llama.cpp's per-layer counts) only.")
    archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or ["?"]
    if archs[0] not in ARCHITECTURES:
        raise ValueError(f"--formats {','.join(formats)}: the GGUF and GenAI writers hold "
                         f"{', '.join(ARCHITECTURES)} only; {archs[0]} is refused (the transformers "
                         "folder is written either way: leave --formats out).")
    if genai and _builder_refusal(archs[0]):
        raise ValueError(f"--formats {','.join(genai)}: {_builder_refusal(archs[0])}.")
    try:
        for runtime in {FORMATS[f][0] for f in formats}:
            require("gguf" if runtime == "gguf" else "onnxruntime_genai", f"--formats {runtime}")
    except ImportError as e:
        raise ValueError(str(e).splitlines()[0]) from None
    ggufs = [f for f in formats if FORMATS[f][0] == "gguf"]
    if ggufs:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(path)
        if archs[0] == "Gemma3ForCausalLM":
            if per_layer:
                raise ValueError(f"--formats {','.join(ggufs)}: llama.cpp's gemma3 graph makes every layer at one "
                                 "head count; --per-layer cuts of Gemma 3 are kept as the transformers folder only.")
            _check_gemma3(cfg, f"--formats {','.join(ggufs)}")
        _vocabulary(tok, int(cfg.vocab_size))  # its ValueError names the tokenizer's kind


def _quantization_cost(file: Path, model: nn.Module, t: Text) -> float:
    """The file's perplexity on the held-out text over ``model``'s (its float32 source): what quantizing cost. A
    GGUF file runs in transformers' reader (dequantized), a GenAI folder in onnxruntime_genai."""
    from multihead.apps.prune import causal
    from multihead.deploy.genai import genai_model
    from multihead.deploy.gguf import gguf_model

    f = causal.fidelity(genai_model(file) if Path(file).is_dir() else gguf_model(file), model, t.held_out)
    return f.perplexity / f.reference_perplexity


def _quantize(f16: Path, dst: Path, dtype: str) -> str:
    """``f16`` quantized to ``dtype`` (q4_k_m, q8_0) by llama.cpp's own quantizer (llama-cpp-python's
    ``llama_model_quantize``, where ``make decoder-llama-cpp`` built it): the line it says."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[dtype]
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed on {f16}")
    return f"{dst.name}: llama.cpp's quantizer (llama_model_quantize, {dtype.upper()}) from {f16.name}"


def _q4_k_m(f16: Path, dst: Path) -> str:
    return _quantize(f16, dst, "q4_k_m")


def write_formats(cut: nn.Module, ref: nn.Module, tok, folder: Path, t: Text, formats: Sequence[str], *,
                  peers: Mapping[str, Path] | None = None, src: Path | None = None) -> list[dict]:
    """Each format in ``formats`` written into ``folder`` (``gguf/model-<dtype>.gguf``, ``genai-<precision>/``) and
    read back: f16 and fp32 files must give the cut model's greedy tokens and logits within their rounding; a
    quantized file (GGUF Q8_0 and Q4_K_M in transformers' reader, GenAI int4 in onnxruntime_genai, with the greedy
    tokens that agree) is judged by what quantizing cost its perplexity on the held-out text, beside the cost of
    the same quantization to the unpruned model (its file in ``peers``, :func:`write_peers`, else written the same
    way into a temporary folder; GenAI's builder on ``src``, the checkpoint folder). Returns a row a format; one
    whose file did not read back, or whose quantization costs more than twice the unpruned model's plus 0.5%, has
    "failed"."""
    rows, ids = [], t.held_out[0]["input_ids"][:1, :16]  # (1, L) a held-out prompt
    ids = ids[:, : int(t.held_out[0]["attention_mask"][0].sum())]
    for name in formats:
        try:
            row = _written(cut, tok, folder, name, ids)
            if "path" in row and FORMATS[name][1] in QUANTIZED_DTYPES:
                _cost_beside_unpruned(row, cut, ref, t, ids, peer=(peers or {}).get(name), src=src)
        except (ValueError, RuntimeError) as e:  # a file that did not read back: said, the others still written
            row = {"format": name, "checks": [], "failed": f"{name}: {str(e).splitlines()[0]}"}
        if "path" in row:
            p = Path(row["path"])
            row["bytes"] = sum(f.stat().st_size for f in p.rglob("*")) if p.is_dir() else p.stat().st_size
        rows.append(row)
    return rows


def _written(cut: nn.Module, tok, folder: Path, name: str, ids: Tensor) -> dict:
    """One format's file written by its runtime's writer and read back: its row (path and the checks' lines; no path
    where the writer is not built here, said in the line)."""
    from multihead.deploy.genai import export_genai
    from multihead.deploy.gguf import export_gguf

    runtime, dtype = FORMATS[name]
    if runtime == "genai":
        served = export_genai(cut, folder / f"genai-{dtype}", tokenizer=tok, precision=dtype, prompt_ids=ids)
        return {"format": name, "path": str(served.path), "checks": served.checks}
    if dtype != "q4_k_m":
        served = export_gguf(cut, folder / "gguf" / f"model-{dtype}.gguf", dtype=dtype, tokenizer=tok,
                                prompt_ids=ids)
        return {"format": name, "path": str(served.path), "checks": served.checks}
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return {"format": name, "checks": ["not written: Q4_K_M is made by llama.cpp's own quantizer, which is not "
                                           "built here (make decoder-llama-cpp builds it)"]}
    f16 = folder / "gguf" / "model-f16.gguf"
    if not f16.exists():
        export_gguf(cut, f16, dtype="f16", tokenizer=tok, prompt_ids=ids)
    said = _q4_k_m(f16, folder / "gguf" / "model-q4_k_m.gguf")
    return {"format": name, "path": str(folder / "gguf" / "model-q4_k_m.gguf"), "checks": [said]}


def _cost_beside_unpruned(row: dict, cut: nn.Module, ref: nn.Module, t: Text, ids: Tensor, *,
                          peer: Path | None = None, src: Path | None = None) -> None:
    """A quantized row's perplexity cost, and the same quantization's cost to the unpruned model (``peer``, its
    file, else written the same way into a temporary folder: GenAI's builder on ``src``, the checkpoint folder);
    "failed" when the cut's is more than twice it plus 0.5%."""
    import tempfile

    from multihead.deploy.genai import standard_genai
    from multihead.deploy.gguf import export_gguf

    runtime, dtype = FORMATS[row["format"]]
    row["cost"] = _quantization_cost(Path(row["path"]), cut, t)
    if peer is not None:
        row["unpruned_cost"] = _quantization_cost(peer, ref, t)
    else:
        with tempfile.TemporaryDirectory() as d:
            if runtime == "genai":
                row["unpruned_cost"] = _quantization_cost(standard_genai(src, Path(d) / "unpruned", dtype), ref, t)
            elif dtype == "q4_k_m":
                export_gguf(ref, Path(d) / "unpruned-f16.gguf", dtype="f16", prompt_ids=ids)
                _q4_k_m(Path(d) / "unpruned-f16.gguf", Path(d) / "unpruned.gguf")
            else:
                export_gguf(ref, Path(d) / "unpruned.gguf", dtype=dtype, prompt_ids=ids)
            if runtime == "gguf":
                row["unpruned_cost"] = _quantization_cost(Path(d) / "unpruned.gguf", ref, t)
    row["within"] = row["cost"] - 1 <= 2 * max(row["unpruned_cost"] - 1, 0.0) + 0.005
    if not row["within"]:
        row["failed"] = (f"{row['format']}: quantizing costs the cut model's perplexity {row['cost']:.4f}x, more "
                         f"than twice the unpruned model's {row['unpruned_cost']:.4f}x plus 0.5%")


# --- where the cut pays: decoding timed in each format's runtime against its peer ---


def vocab_size(model: nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _runtime(name: str) -> str:
    return "llama.cpp" if FORMATS[name][0] == "gguf" else "genai"


def check_decode(path: Path, o: DecoderOptions, world: int) -> None:
    """``--decode-contexts`` refused in one line (ValueError) before any work: without ``--formats`` (the files it
    times), under torchrun (the runtimes are timed in one process), a context the model's positions cannot hold or
    not above the tokens decoded, rounds below 1."""
    if not o.decode_contexts:
        return
    if not o.formats:
        raise ValueError("--decode-contexts times the files --formats writes against their peers: give --formats "
                         "(e.g. gguf-q8_0,genai-int4).")
    if world > 1:
        raise ValueError("--decode-contexts times the runtimes in one process: run the command without torchrun to "
                         "time them (the recovery alone runs on the ranks).")
    if isinstance(o.decode_rounds, bool) or not isinstance(o.decode_rounds, int) or o.decode_rounds < 1:
        raise ValueError(f"--decode-rounds must be a whole number >= 1; got {o.decode_rounds!r}.")
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg = getattr(cfg, "text_config", None) or cfg
    positions = getattr(cfg, "max_position_embeddings", None)
    for n in o.decode_contexts:
        if isinstance(n, bool) or not isinstance(n, int) or n <= o.decode_tokens:
            raise ValueError(f"--decode-contexts {n}: a context must be a whole number of tokens above the "
                             f"{o.decode_tokens} decoded (the prompt is the context less them).")
        if positions is not None and n > positions:
            raise ValueError(f"--decode-contexts {n}: longer than the model's {positions} positions "
                             f"(max_position_embeddings); give contexts up to {positions}.")


def write_peers(ref: nn.Module, src: Path, tok, folder: Path, t: Text, formats: Sequence[str]) -> dict[str, Path]:
    """The peers the decode table times each format against: the unpruned model made into each format by the
    runtime's own tools, into ``folder``. GGUF: f16 by :func:`multihead.deploy.gguf.export_gguf` (what llama.cpp's
    convert_hf_to_gguf.py writes, the vocabulary from the tokenizer), Q8_0 and Q4_K_M by llama.cpp's own quantizer
    from it where llama.cpp is built (Q8_0 by the gguf writer where it is not; Q4_K_M then has no file on either
    side); GenAI: its builder on the checkpoint folder (:func:`multihead.deploy.genai.standard_genai`) at the
    precision. {format: path}, formats without a file left out."""
    import importlib.util

    from multihead.deploy.genai import standard_genai
    from multihead.deploy.gguf import export_gguf

    folder.mkdir(parents=True, exist_ok=True)
    built = importlib.util.find_spec("llama_cpp") is not None
    ids = t.held_out[0]["input_ids"][:1, : int(t.held_out[0]["attention_mask"][0].sum())][:, :16]  # (1, L) a prompt
    out: dict[str, Path] = {}
    f16 = folder / "model-f16.gguf"
    for name in formats:
        runtime, dtype = FORMATS[name]
        if runtime == "genai":
            out[name] = standard_genai(src, folder / f"genai-{dtype}", precision=dtype)
            continue
        if dtype == "q4_k_m" and not built:
            continue
        if (dtype != "q8_0" or built) and not f16.exists():
            export_gguf(ref, f16, dtype="f16", tokenizer=tok, prompt_ids=ids)
        if dtype == "f16":
            out[name] = f16
        elif built:
            _quantize(f16, folder / f"model-{dtype}.gguf", dtype)
            out[name] = folder / f"model-{dtype}.gguf"
        else:
            out[name] = export_gguf(ref, folder / f"model-{dtype}.gguf", dtype=dtype, tokenizer=tok,
                                    prompt_ids=ids).path
    return out


def _peers_costed(ctx: Context, path: Path, tok, folder: Path, phase: Callable[[str], None]) -> dict[str, Path]:
    """The peers written (:func:`write_peers`) and timed once, ``ctx.after_s`` set from what both took."""
    began = time.monotonic()
    peers = write_peers(ctx.reference, path, tok, folder, ctx.text, ctx.options.formats)
    phase("the peers, written")
    ctx.after_s = after_cuts_s(peers, time.monotonic() - began, ctx.options, ctx.judge_s, vocab_size(ctx.reference))
    phase("the peers, timed once (the plan's estimate)")
    return peers


def after_cuts_s(peers: Mapping[str, Path], written_s: float, o: DecoderOptions, judge_s: float, vocab: int) -> float:
    """Seconds to keep after the cuts, measured: the kept model's files take what the peers' took (``written_s``),
    each quantized GGUF's cost two judgements more; each peer is timed once here at every context, so the decode
    table's rounds (each peer and its pruned file, which runs no slower) take ``decode_rounds`` x 2 x that."""
    import importlib.util

    from multihead.deploy.decoding import measure

    once = 0.0
    for name, peer in peers.items():
        if _runtime(name) == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
            continue
        for n in o.decode_contexts:
            began = time.monotonic()
            measure(_runtime(name), peer, n - o.decode_tokens, decode=o.decode_tokens, vocab=vocab, threads=THREADS)
            once += time.monotonic() - began
    quantized = sum(FORMATS[f] in (("gguf", "q8_0"), ("gguf", "q4_k_m")) for f in o.formats)
    return written_s + 2 * judge_s * quantized + o.decode_rounds * 2 * once


#: threads the runtimes are timed with (both runtimes, every file)
THREADS = 2


def unsettled(rows: Sequence[dict]) -> list[str]:
    """One line for each row of the decode table whose paired speed-up spread over the rounds (max - min) by more
    than :data:`multihead.timing.BUSY_SPREAD` of its median (the encoder's runtime table's rule): the machine's load
    moved even the pairs, that speed-up is not settled."""
    from multihead.timing import BUSY_SPREAD as SPREAD

    out = []
    for r in rows:
        s = r.get("speedup_spread")
        if s and s["max"] - s["min"] > SPREAD * r["speedup"]:
            out.append(f"{r['format']} at {r['context']} tokens: the machine was busy: the paired speed-up spread over "
                       f"the rounds from {s['min']:.2f}x to {s['max']:.2f}x, {(s['max'] - s['min']) / r['speedup']:.0%}"
                       f" of its median (> {SPREAD:.0%}); that speed-up is not settled (more --decode-rounds, or a "
                       "quieter machine)")
    return out


def decode_speed(cut: nn.Module, ref: nn.Module, formats: Sequence[dict], peers: Mapping[str, Path],
                 o: DecoderOptions) -> dict:
    """Each written file timed against its peer in its runtime (:func:`multihead.deploy.decoding.decode_table`),
    beside the bound of the work removed and each side's KV-cache bytes a token (llama.cpp's default f16 cache,
    GenAI's fp32 on the CPU). {"rows", "kv_bytes", "notes"}."""
    import importlib.util

    from multihead.deploy.decoding import attention_windows, decode_macs, decode_table

    cfg = ref.config
    shape = {"E": cfg.hidden_size, "F": cfg.intermediate_size, "V": vocab_size(ref),
             "D": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads}
    before, after = list(layer_counts(ref).values()), list(layer_counts(cut).values())
    w = attention_windows(cfg)  # Gemma 3's sliding layers read only their window of the cache
    s0, s1 = sizes(ref)["kv_bytes_per_token_f16"], sizes(cut)["kv_bytes_per_token_f16"]
    pairs, kv, notes = {}, {}, []
    for f in formats:
        name = f["format"]
        if "path" not in f or "failed" in f or name not in peers:
            notes.append(f"{name}: not timed (no file{' to time' if 'path' in f else ''} on both sides)")
            continue
        if _runtime(name) == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
            notes.append(f"{name}: not timed: llama.cpp is not built here (make decoder-llama-cpp builds it)")
            continue
        pairs[name] = (_runtime(name), peers[name], Path(f["path"]))
        kv[name] = (s0, s1) if _runtime(name) == "llama.cpp" else (2 * s0, 2 * s1)  # GenAI's cache: fp32
    rows = decode_table(pairs, list(o.decode_contexts), vocab=shape["V"], rounds=o.decode_rounds,
                        decode=o.decode_tokens, threads=THREADS,
                        bound=lambda n: decode_macs(shape, before, n, w) / decode_macs(shape, after, n, w),
                        progress=(lambda line: print(line, file=sys.stderr, flush=True)) if o.progress else None
                        ) if pairs else []
    notes += unsettled(rows)
    return {"rows": rows, "kv_bytes": kv, "notes": notes, "threads": THREADS, "rounds": o.decode_rounds,
            "decode": o.decode_tokens}

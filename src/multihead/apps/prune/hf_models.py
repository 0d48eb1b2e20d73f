"""The pruning exercise and the pictures on any local transformers checkpoint directory
(``multihead prune --hf DIR``, ``multihead viz --hf DIR``): the model through
:mod:`multihead.hf`, text through the directory's own tokenizer.

Fidelity to the unpruned model: mean cosine of the mean-pooled last hidden states for
encoders; mean KL divergence of the next-token distributions for causal LMs (lower is
better; reported as the metric). ``recover`` distils a pruned model towards the
unpruned one on unlabelled sentences (the same fidelity as the loss).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from multihead.apps.prune.pruning import Setup
from multihead.deploy.compare import pooled  # noqa: F401 - the fidelity's pooling, used here and by its callers
from multihead.quantize import quantize


def _config_file(path: Path) -> Path:
    """The checkpoint's config.json (ValueError, saying what --hf takes, when there is none); offline from here on."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{cfg} does not exist: --hf takes a local transformers checkpoint directory (config.json, "
                         "weights and a tokenizer).")
    return cfg


def _tokenizer(path: Path):
    """(the checkpoint's tokenizer, with a pad token; whether the model is a causal LM)."""
    _config_file(path)
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    causal = any(a.endswith("ForCausalLM") for a in (config.architectures or []))
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is the same advice
        raise ValueError(f"{path} has no tokenizer transformers can load ({type(e).__name__}: {e}); text models need "
                         "tokenizer.json (or the tokenizer files) in the directory.") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok, causal


def _load(path: Path, *, with_peer: bool = True):
    path = Path(path)
    tok, causal = _tokenizer(path)  # config.json checked there, offline from then on
    import transformers

    import multihead.hf as mhf

    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model = auto.from_pretrained(path).eval()
    try:  # padding-free where the model's layers allow it (verified on a padded batch), else padded
        model = mhf.attach(model, packed=True)
    except ValueError as e:
        if "packed=True" not in str(e):
            raise
        print(f"note: {str(e).split(': ', 1)[1].split(' This model runs padded')[0]}; running padded.")
        model = mhf.attach(model)
    peer = auto.from_pretrained(path, attn_implementation="sdpa").eval() if with_peer else None
    return model, peer, tok, causal


#: the sentences' tokens at most (longer ones are truncated)
SENTENCE_TOKENS = 128
#: the longest passages fidelity is measured on, in tokens (sentence-transformers' all-MiniLM-L6-v2 truncates
#: its inputs there): at most the model's own limit
PASSAGE_TOKENS = 256
#: fewer passages than this make no interval worth the name: the kind is left out (and the notes say so)
MIN_PASSAGES = 8


def _batches(tok, sents: list[str], size: int, causal: bool, max_length: int = SENTENCE_TOKENS) -> list[tuple]:
    out = []
    tok.padding_side = "left" if causal else "right"
    for i in range(0, len(sents), size):
        enc = tok(sents[i:i + size], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        out.append((enc["input_ids"], enc["attention_mask"]))
    return out


def _hidden(model, ids, am):
    return model(input_ids=ids, attention_mask=am).last_hidden_state  # (B, L, E)


def _distil_loss(h, ref, am):
    """How far an encoder's hidden states h (B, L, E) are from the unpruned model's ref: 1 - the
    cosine of their mean-pooled vectors (the fidelity metric) plus 1 - the mean cosine of the real
    tokens' states (a target per token: less to overfit on a few hundred sentences)."""
    m = am.to(h.dtype)[..., None]  # (B, L, 1)
    pool = lambda x: F.normalize((x * m).sum(1) / m.sum(1).clamp_min(1e-9), dim=-1)  # noqa: E731 - (B, E)
    tokens = 1 - F.cosine_similarity(h, ref, dim=-1)  # (B, L)
    return (1 - (pool(h) * pool(ref)).sum(-1)).mean() + (tokens * am).sum() / am.sum()


def _logp(model, ids, am):
    return F.log_softmax(model(input_ids=ids, attention_mask=am).logits.float(), -1)  # (B, L, V)


def _kl(lp, ref, am) -> torch.Tensor:
    kl = (ref.exp() * (ref - lp)).sum(-1)  # (B, L)
    return (kl * am).sum() / am.sum()


def _objective(causal: bool, batches: list, refs: list) -> tuple[Callable, Callable, str, Callable | None]:
    """(loss_fn(model, ((ids, am), ref)), metric_fn(model) on the held-out ``batches`` against the
    unpruned model's ``refs``, the metric's name, scores_fn(model) -> (n,) per sentence or None): KL of
    next-token distributions for a decoder, the cosine of mean-pooled states for an encoder (per sentence:
    the metric is their mean)."""
    if causal:
        def loss_fn(m, b):
            (ids, am), ref = b
            return _kl(_logp(m, ids, am), ref, am)

        def metric_fn(m):
            with torch.no_grad():
                return float(sum(_kl(_logp(m, i, a), r, a) for (i, a), r in zip(batches, refs)) / len(batches))
        name = "mean KL of next-token distributions to the unpruned model (lower is better)"
        return loss_fn, metric_fn, name, None

    def loss_fn(m, b):
        (ids, am), ref = b
        return 1 - (pooled(m, ids, am) * ref).sum(-1).mean()

    def scores_fn(m):  # (n,) each held-out sentence's cosine (pooled outputs are normalised)
        with torch.no_grad():
            return torch.cat([(pooled(m, i, a) * r).sum(-1) for (i, a), r in zip(batches, refs)])

    def metric_fn(m):
        return scores_fn(m).mean().item()
    return loss_fn, metric_fn, "mean cosine of mean-pooled hidden states to the unpruned model", scores_fn


def save_with_files(model: nn.Module, out: str | Path, source: str | Path, *, quantize: str | None = None) -> Path:
    """:func:`multihead.hf.save` into ``out``, with the checkpoint directory's other files copied beside it
    (the tokenizer, and sentence-transformers' modules.json, pooling and normalisation folders), so that the
    directory opens where the source did: ``SentenceTransformer(out)``, ``AutoModel.from_pretrained(out)``
    (a model with one key/value head per query head is stored at full size, its pruned heads zero)."""
    import shutil

    import multihead.hf as mhf

    out, source = Path(out), Path(source)
    mhf.save(model, out, quantize=quantize)
    for f in source.iterdir():
        if f.name == "config.json" or f.name.startswith(("model", "pytorch_model")) or f.name in ("onnx", "openvino"):
            continue  # the weights and config are the pruned model's; other runtimes' exports are not
        if f.is_dir():
            shutil.copytree(f, out / f.name, dirs_exist_ok=True)
        elif not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out


def readable_elsewhere(out: str | Path) -> str | None:
    """None when the directory :func:`save_with_files` wrote opens with ``AutoModel.from_pretrained`` and
    ``SentenceTransformer`` (unpruned, or stored at full size); else the one line that says it does not and
    how to open it."""
    import json

    import multihead.hf as mhf

    cfg = json.loads((Path(out) / "config.json").read_text())
    if cfg.get(mhf.FULL_SIZE_KEY) or not cfg.get(mhf.HEADS_KEY):
        return None
    return (f"{out} keeps each layer's own head counts (grouped key/value heads or fused q/k/v cannot be stored at "
            "full size with the kept heads named): AutoModel.from_pretrained and SentenceTransformer cannot read "
            f"it; open it with multihead.hf.load('{out}') (and put that model in a SentenceTransformer as "
            "st[0].model)")


def passages(tok, sents: list[str], n: int, limit: int) -> list[str]:
    """Up to ``n`` passages of consecutive ``sents`` joined: each takes sentences until it reaches its length,
    the lengths spread over ``limit // 2`` to ``limit`` tokens (special tokens counted; the last sentence may
    take it past ``limit``: tokenize with truncation there)."""
    half, extra = limit // 2, tok.num_special_tokens_to_add()
    out, cur, length = [], [], extra
    for s in sents:
        if len(out) == n:
            break
        goal = half + (limit - half) * (len(out) % 4 + 1) // 4  # 5/8, 6/8, 7/8 and all of limit, in turn
        cur.append(s)
        length += len(tok.tokenize(s))
        if length >= goal:
            out.append(" ".join(cur))
            cur, length = [], extra
    return out


def _token_limit(tok, model) -> int | None:
    """The most tokens one input may have: the model config's ``max_position_embeddings`` or the tokenizer's
    limit, whichever is smaller (None when neither says)."""
    limits = [n for n in (getattr(model.config, "max_position_embeddings", None), tok.model_max_length)
              if isinstance(n, int) and 0 < n < 1_000_000]
    return min(limits) if limits else None


def _passage_limit(tok, model) -> int:
    """The passages' length: :data:`PASSAGE_TOKENS`, or the model's or its tokenizer's limit when smaller."""
    limit = _token_limit(tok, model)
    return PASSAGE_TOKENS if limit is None else min(PASSAGE_TOKENS, limit)


def _split(corpus: list[str], n_importance: int, n_recover: int | None, n_held_out: int | None,
           seen: list[str] | None = None) -> tuple[list[str], list[str], list[str]]:
    """(importance, recovery, held-out) sentences of the corpus' different sentences (a repeated line counts once,
    where it first comes): the first ``n_importance``, the next ``n_recover`` (default a quarter of them, at most
    256), then ``n_held_out`` (default all the rest) of those not also in ``seen`` (more text the model is trained
    on): the held-out sentences are never ones it saw (a corpus of repeated lines measured fidelity on the very
    sentences it pruned and distilled on)."""
    corpus = list(dict.fromkeys(corpus))
    n_recover = min(256, len(corpus) // 4) if n_recover is None else n_recover
    head = corpus[:n_importance]
    recover_set = corpus[n_importance:n_importance + n_recover]
    trained = set(seen or ())
    held_out = [s for s in corpus[n_importance + n_recover:] if s not in trained]
    if n_held_out is not None:
        held_out = held_out[:n_held_out]
    if not head or not held_out:
        raise ValueError(f"the corpus has {len(corpus)} different sentences: it needs more than {n_importance} "
                         "(importance on the first ones, fidelity on the rest, none of them in the recovery text).")
    return head, recover_set, held_out


def _held_out_kinds(tok, model, split: list[str], extra: tuple[str, list[str]] | None, n_passages: int,
                    causal: bool) -> tuple[tuple, list[str], list[str], int, str | None]:
    """The held-out text by kind (see :func:`hf_setup`): (kinds ``(name, count[, unit])``, the sentences of every
    kind in order, the passages, their token limit, a note when passages were asked for but too few fit)."""
    kinds, held_out = (("the held-out split", len(split)),), split
    if extra and extra[1] and not causal:  # a decoder's KL is one figure over one kind of text
        kinds += ((extra[0], len(extra[1])),)
        held_out = split + list(extra[1])
    limit = _passage_limit(tok, model)
    if not n_passages or causal or limit <= SENTENCE_TOKENS:
        return kinds, held_out, [], limit, None
    long = passages(tok, split, n_passages, limit)
    if len(long) < MIN_PASSAGES:
        return kinds, held_out, [], limit, (f"no fidelity on passages: the held-out split makes {len(long)} passages "
                                            f"of {limit // 2}-{limit} tokens, fewer than {MIN_PASSAGES}")
    lens = [len(x) for x in tok(long, truncation=True, max_length=limit)["input_ids"]]
    kinds += ((f"the held-out split's sentences joined ({min(lens)}-{max(lens)} tokens)", len(long), "passages"),)
    return kinds, held_out, long, limit, None


def _recovery_batches(tok, model, causal: bool, own: list[str], extra: list[str] | None,
                      limit: int | None) -> list[tuple]:
    """Recovery's batches, ((ids, am), the unpruned ``model``'s output): 16 sentences of ``own`` and ``extra``
    mixed in a fixed order (the steps walk through every source, not one after another), and with ``limit``
    (encoders whose fidelity is measured on passages too) two passages of that text joined to ``limit // 2`` to
    ``limit`` tokens after every third batch. Trained on sentences alone, all-MiniLM-L6-v2 pruned to 50 of 72
    heads (400 steps, int8) kept 0.9701 on held-out sentences but 0.9307 on held-out 163-256-token passages; with
    the passages, 0.9672 and 0.9631 (package descriptions 0.9602 -> 0.9567)."""
    rec_fn = _logp if causal else _hidden  # recovery matches every token, not only the pooled vector
    text = list(own) + list(extra or [])
    if extra:
        import random

        random.Random(0).shuffle(text)
    with torch.no_grad():
        rec = [(b, rec_fn(model, *b)) for b in _batches(tok, text, 16, causal)]
        if limit is None:
            return rec
        joined = passages(tok, list(own), 2 * len(rec), limit) + passages(tok, list(extra or []), 2 * len(rec), limit)
        long = [(b, rec_fn(model, *b)) for b in _batches(tok, joined[: 2 * (len(rec) // 3)], 2, causal,
                                                          max_length=limit)]
    out = []
    for i, b in enumerate(rec):  # one passage batch after every third batch of sentences
        out.append(b)
        if i % 3 == 2 and i // 3 < len(long):
            out.append(long[i // 3])
    return out


def hf_setup(path: str | Path, corpus: list[str] | None = None, n_importance: int = 128,
             n_held_out: int | None = None, n_recover: int | None = None, *,
             recover_extra: list[str] | None = None, held_out_extra: tuple[str, list[str]] | None = None,
             n_passages: int = 32) -> Setup:
    """A pruning :class:`~multihead.apps.prune.pruning.Setup` for the checkpoint in ``path``: importance
    on the first ``n_importance`` sentences, recovery (distillation) on the next ``n_recover``
    (default: a quarter of the corpus, at most 256) and on ``recover_extra`` (more text, e.g.
    :func:`multihead.apps.common.data.docstring_sentences`), fidelity on the ``n_held_out`` after them
    (default: all the rest), so the fidelity sentences are never trained on, and on ``held_out_extra`` =
    (its name, sentences of another kind), and on ``n_passages`` passages of the held-out sentences joined to
    :data:`SENTENCE_TOKENS` to :data:`PASSAGE_TOKENS` tokens (the model's limit if smaller; encoders whose limit
    is longer than the sentences' only, and at least :data:`MIN_PASSAGES` of them): each kind's fidelity is
    measured and the worst one counts -- a model measured on sentences alone can lose its fidelity on the
    paragraphs users embed (all-MiniLM-L6-v2 pruned to 50 of its 72 heads: 0.96 on sentences, 0.91 at 256
    tokens). With passages measured, recovery distils on passages of its own text too
    (:func:`_recovery_batches`)."""
    from multihead.apps.common.data import sentences

    model, peer, tok, causal = _load(Path(path))
    corpus = corpus if corpus is not None else sentences()
    head, recover_set, held_out = _split(corpus, n_importance, n_recover, n_held_out, recover_extra)
    kinds, held_out, long, limit, passage_note = _held_out_kinds(tok, model, held_out, held_out_extra, n_passages,
                                                                 causal)
    out_fn = _logp if causal else pooled
    with torch.no_grad():
        imp = [(b, out_fn(model, *b)) for b in _batches(tok, head, 16, causal)]
        rec = _recovery_batches(tok, model, causal, recover_set or head, recover_extra, limit if long else None)
        batches = _batches(tok, held_out, 16, causal) + _batches(tok, long, 8, causal, max_length=limit)
        refs = [out_fn(model, *b) for b in batches]

    loss_fn, metric_fn, name, scores_fn = _objective(causal, batches, refs)
    speed = {n: _batches(tok, held_out[: 4 * n], n, causal)[:4] for n in (1, 16, 64)}
    p = Path(path).resolve()
    label = p.parent.name if p.name == "model" else p.name  # e.g. <package>/model -> the package's name
    setup = Setup(label, model, imp, loss_fn, metric_fn, name, speed,
                  lambda m, x: m(input_ids=x[0], attention_mask=x[1]), "ablation", True,
                  lambda m, p, quantize=None: readable_elsewhere(save_with_files(m, p, path, quantize=quantize)),
                  (f"transformers {type(peer).__name__} (sdpa)", peer,
                                                lambda m, x: m(input_ids=x[0], attention_mask=x[1])),
                  [f"importance on the first {len(head)} sentences, recovery (if asked) on the next {len(recover_set)}"
                   + (f" and {len(recover_extra)} more" if recover_extra else "")
                   + (" (and passages of them every fourth step)" if long else "") +
                   f", fidelity on the {kinds[0][1]} after them"
                   + "".join(f", on {k[1]} {k[2] if len(k) > 2 else 'sentences'} of {k[0]}" for k in kinds[1:])
                   + (" (the worst kind counts)" if len(kinds) > 1 else ""),
                   "fidelity: " + name] + ([passage_note] if passage_note else []))
    setup.recover_fn = lambda m, steps, quantize=None, until=None: recover(m, rec, steps, causal, quantize=quantize,
                                                                            until=until)
    setup.quantize_fn = quantize
    setup.scores_fn = scores_fn
    setup.metric_kind = "kl" if causal else "cosine"  # what --target-kl / --target-cosine judge
    setup.held_out_kinds = kinds if len(kinds) > 1 else None

    setup.more_peers = ((lambda openvino=True: []) if causal else
                        (lambda openvino=True: runtime_peers(peer, speed[16][0], _calibration(imp), openvino=openvino)))
    setup.ffn_fn = lambda m, fraction: _cut_ffn(m, fraction, imp)
    if not causal:
        _for_runtimes(setup, imp, runtime_texts(tok, kinds, held_out, long, limit), peer, speed[16][0])
    return setup


def _calibration(imp: list) -> list[dict]:
    """The importance text as calibration batches (OpenVINO's static int8): text the timing never uses."""
    return [{"input_ids": ids, "attention_mask": am} for (ids, am), _ in imp]


def _for_runtimes(setup: Setup, imp: list, texts: tuple[dict, dict], peer: nn.Module, example: tuple) -> None:
    """An encoder's setup made ready for the runtimes: the kept model written where users run it (calibrated on the
    importance text), the unpruned ``peer`` (the transformers model as loaded) made into the standard files the
    runtime table times it against, the text its files are timed and scored on, and its served form timed beside."""
    import multihead.hf as mhf
    from multihead.deploy import peers

    calibration = _calibration(imp)
    setup.export_fn = lambda m, folder, openvino=None: _export(m, folder, calibration, openvino)
    setup.standard_fn = lambda openvino=True: peers.standard_files(
        peer, {"input_ids": example[0], "attention_mask": example[1]}, calibration, openvino=openvino)
    setup.runtime_texts = texts
    setup.serve_fn = mhf.serve


def _cut_ffn(model: nn.Module, fraction: float, batches: list) -> dict[str, list[int]]:
    """``fraction`` of every feed-forward block's neurons cut (the least important on the importance ``batches``,
    replaced by their means: :func:`multihead.heads.prune_neurons`), verified on the first batch."""
    from multihead import heads

    def run(m, b):
        return m(input_ids=b[0][0], attention_mask=b[0][1])
    return heads.prune_neurons(model, fraction, batches, run, lambda m: run(m, batches[0]))


def _export(model: nn.Module, folder: Path, calibration: list[dict], openvino: bool | None) -> dict[str, Path]:
    """The kept model's runtime files (``openvino``: as :func:`multihead.hf.export` takes it); no file to serve yet:
    ``prune --hf`` chooses it from its runtime table (:mod:`multihead.deploy.serve`)."""
    import multihead.hf as mhf

    return mhf.export(model, folder, calibration=calibration, openvino=openvino, serve=False)


#: each batch size's batches per kind of text in the runtime table (batch 1: several short calls)
RUNTIME_BATCHES = {1: 4, 16: 1, 64: 1}


def runtime_texts(tok, kinds: tuple, held_out: list[str], long: list[str], limit: int,
                  sizes: dict[int, int] | None = None) -> tuple[dict, dict]:
    """The runtime table's text (:mod:`multihead.deploy.compare`), from every held-out kind (the split's sentences, the
    other kind's, the passages): ({batch size: batches}, {kind: batches}). At each batch size, each kind with
    enough items gives ``sizes[B]`` batches (default :data:`RUNTIME_BATCHES`; a kind with fewer than the batch size
    is left out there, and a batch size no kind fills is left out);
    each kind's fidelity batches (16 items each) hold all its items."""
    texts, start = {}, 0
    for kind in kinds:
        if len(kind) > 2:  # the passages, tokenized to the passage limit
            texts[kind[0]] = (long, limit)
        else:
            texts[kind[0]] = (held_out[start:start + kind[1]], SENTENCE_TOKENS)
            start += kind[1]

    def batch(items, n, cap):
        return [{k: v for k, v in tok(items[i:i + n], padding=True, truncation=True, max_length=cap,
                                      return_tensors="pt").items() if k in ("input_ids", "attention_mask")}
                for i in range(0, len(items), n)]

    inputs = {}
    for B, n in (sizes or RUNTIME_BATCHES).items():
        batches = [b for items, cap in texts.values() if len(items) >= B for b in batch(items[: B * n], B, cap)]
        if batches:  # a batch size no kind fills is left out
            inputs[B] = batches
    return inputs, {kind: batch(items, 16, cap) for kind, (items, cap) in texts.items()}


def runtime_peers(model: nn.Module, example: tuple, calibration: list[dict] | None = None, *, openvino: bool = True
                  ) -> list[tuple[str, object, Callable]]:
    """The unpruned transformers encoder ``model`` in ONNX Runtime and OpenVINO (``openvino``: False leaves it out), from
    its standard files (:func:`multihead.deploy.peers.standard_files`, exported once with the (ids, am) ``example``),
    those whose extra (onnx, openvino) is installed: [(name, model, run_fn)]."""
    from multihead.deploy import peers

    ids, am = example
    return [(name, m, lambda m, x: m(input_ids=x[0], attention_mask=x[1]))
            for name, m in peers.peers(model, {"input_ids": ids, "attention_mask": am}, None, calibration,
                                       openvino=openvino).items()]


def recover(pruned: nn.Module, batches: list, steps: int, causal: bool, *, lr: float = 3e-5,
            quantize: str | None = None, until: float | None = None,
            observe: Callable[[int], None] | None = None, shard: bool = False) -> list[float]:
    """Distil ``pruned`` towards the unpruned model for ``steps`` steps on the unlabelled
    ``batches`` ((ids, am), the unpruned model's output: next-token log-probabilities of a
    decoder, hidden states (B, L, E) of an encoder, matched by :func:`_distil_loss`); returns the
    losses (one per step run). The learning rate decays from ``lr`` to 0 along a half cosine, so the
    model saved is where the steps settled rather than a point of their noise (all-MiniLM-L6-v2, 50%
    pruned, 400 steps, int8: mean cosine 0.9589 on the 600 held-out sentences, 0.9557 at a constant rate).
    AdamW takes its fused step (all-MiniLM-L6-v2: 0.70 s a step where its per-tensor loop takes 0.92 s, one
    thread). Dropout stays off (eval mode): the target is the unpruned model's deterministic output. ``quantize``:
    the model will be quantized to it afterwards, so the distillation runs with its Linear layers
    rounded as they will be (:func:`multihead.quantize.fake_quantized`). ``until`` (a
    ``time.monotonic()`` time): after the first steps have shown what a step costs, the run is
    shortened to the steps that end before it (the cosine then decays over the shorter run). ``observe``: called
    with the number of steps done after each step (a curve of fidelity against steps reads the model there). Over
    torch.distributed ranks (two or more): ``DistributedDataParallel`` (each rank's ``batches`` its share), or with
    ``shard`` FSDP2 (:func:`_data_parallel`; ``pruned`` gets the gathered weights before each ``observe`` and at
    the end); a shortened run's length is the fewest steps any rank can afford."""
    import time

    from multihead.extras import progress
    from multihead.quantize import fake_quantized

    pruned.eval()
    net, world, gather = _data_parallel(pruned, shard)
    total = [steps]  # the run's length; shortened once under ``until``
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                            fused=not shard)  # DTensor shards: the per-tensor step
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total[0]) / total[0])))
    losses = []
    started = time.monotonic()
    bar = progress(total=steps, desc="recovery (distillation)")
    with fake_quantized(pruned, quantize) if quantize else contextlib.nullcontext():
        s = 0
        while s < total[0]:
            (ids, am), ref = batches[s % len(batches)]
            if causal:
                loss = _kl(_logp(net, ids, am), ref, am)
            else:
                loss = _distil_loss(_hidden(net, ids, am), ref, am)
            loss.backward()
            opt.step()
            opt.zero_grad()  # the gradients freed now, not at the next step: they never sit beside its activations
            decay.step()
            losses.append(loss.item())
            s += 1
            bar.update(1)
            if observe is not None:
                gather()
                observe(s)
            if until is not None and s == min(3, steps) and s < steps:  # the first steps give a step's cost
                affordable = _affordable(s, started, until, world)
                if affordable < steps:
                    total[0] = affordable
                    bar.total = affordable
                    bar.set_postfix_str(f"{affordable} of {steps} steps fit the time budget")
    bar.close()
    gather()
    return losses


def _affordable(done: int, started: float, until: float, world: int) -> int:
    """The steps that end before ``until`` at the cost ``done`` steps took since ``started``; over ``world`` > 1 ranks
    the fewest any rank can afford (every rank runs as many)."""
    import time

    affordable = done + int(max(0.0, until - time.monotonic()) / ((time.monotonic() - started) / done))
    if world > 1:
        agreed = torch.tensor([affordable])
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        affordable = int(agreed)
    return affordable


def _data_parallel(model: nn.Module, shard: bool = False) -> tuple[nn.Module, int, Callable[[], None]]:
    """(``model`` wrapped in ``DistributedDataParallel``, the world size, a no-op) when this process is a rank of a
    torch.distributed group of two or more; ``shard``: (a copy of ``model`` fully sharded over the ranks on the CPU
    (FSDP2: each block of its longest ModuleList, then the whole), the world size, what gathers its weights into
    ``model``); (``model``, 1, a no-op) outside a group (``shard`` refused there: ValueError)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        if shard:
            raise ValueError("a sharded recovery (FSDP) needs a process group of two ranks or more: launch with "
                             "torchrun --nproc-per-node N.")
        return model, 1, lambda: None
    world = dist.get_world_size()
    if not shard:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), world, lambda: None
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    blocks = max((m for m in net.modules() if isinstance(m, nn.ModuleList)), key=len, default=[])
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, world, lambda: _gathered_into(net, model)


def _gathered_into(net: nn.Module, model: nn.Module) -> None:
    """The sharded ``net``'s weights gathered whole (a collective: every rank calls it) into ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model.load_state_dict(get_model_state_dict(net, options=StateDictOptions(full_state_dict=True)))


def _encode_within(tok, model, text: str):
    """``text`` tokenized for one call, truncated to the positions the model has (its config's
    ``max_position_embeddings``, or the tokenizer's limit when smaller), saying so on stderr."""
    import sys

    limit = _token_limit(tok, model)
    if limit is None:
        return tok([text], return_tensors="pt")
    n = len(tok.tokenize(text)) + tok.num_special_tokens_to_add()
    if n > limit:
        print(f"multihead viz: the text is {n} tokens and {type(model).__name__} takes at most {limit} positions: "
              f"its first {limit} tokens are drawn.", file=sys.stderr)
    return tok([text], truncation=True, max_length=limit, return_tensors="pt")


def _kept_heads(path: Path) -> dict[str, list[int]]:
    """{attention module: the original indices of its kept heads} that ``multihead.hf.save`` recorded for a pruned
    model (``{}``: not pruned, or not saved by multihead)."""
    from multihead.hf import KEPT_KEY

    return json.loads(_config_file(path).read_text()).get(KEPT_KEY) or {}


def _in_place(cap: dict, kept: dict[str, list[int]], H0: int | None) -> dict:
    """The captured weights with each pruned module's heads at their original numbers, (B, H0, Lq, Lk), the pruned
    heads NaN (the pictures say "pruned" there); ``cap`` as it is when nothing was pruned."""
    if not kept or not isinstance(H0, int):
        return cap
    placed = {}
    for name, w in cap.items():  # (B, H, Lq, Lk): the kept heads, in order
        heads = kept.get(name)
        if heads is None or len(heads) != w.shape[1] or max(heads, default=0) >= H0:
            placed[name] = w
            continue
        full = w.new_full((w.shape[0], H0, *w.shape[2:]), float("nan"))  # (B, H0, Lq, Lk)
        full[:, heads] = w
        placed[name] = full
    return placed


def draw(path: str | Path, text: str, out: Path, *, explain: bool = False) -> list[Path]:
    """Every head of the checkpoint in ``path`` on ``text``: heatmaps, rollout and the explorer;
    with ``explain``, :func:`multihead.hf.explain` printed first."""
    import multihead
    import multihead.hf as mhf
    from multihead.viz import ROLLOUT_AXES, explorer, heatmaps, rollout
    from multihead.viz.rollout import stacks_of

    kept = _kept_heads(Path(path))
    if kept:  # written by prune --hf: the pruned model itself, not its full-size copy (pruned heads zero, uniform)
        tok, causal = _tokenizer(Path(path))
        model = mhf.load(path, quantized=False)
    else:
        model, _, tok, causal = _load(Path(path), with_peer=False)  # pictures need no sdpa twin
    if explain:
        print(mhf.explain(model))
    enc = _encode_within(tok, model, text)
    tokens = tok.convert_ids_to_tokens(enc["input_ids"][0])
    with torch.no_grad(), multihead.capture(model) as cap:
        model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    out.mkdir(parents=True, exist_ok=True)
    name = Path(path).name
    paths = []
    placed = _in_place(cap, kept, getattr(model.config, "num_attention_heads", None))  # pruned heads: NaN
    fig = heatmaps(placed, queries=tokens, keys=tokens, max_labels=24)
    paths.append(out / f"{name}_heads.png")
    fig.savefig(paths[-1], dpi=90, bbox_inches="tight")
    stack = next(iter(stacks_of(cap).values()))  # an encoder-decoder: the encoder's stack (the text's tokens)
    fig = heatmaps(rollout(cap, names=stack, causal=causal)[:, None], queries=tokens, keys=tokens, titles=["rollout"],
                   cell=4, **ROLLOUT_AXES)
    paths.append(out / f"{name}_rollout.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    paths.append(explorer(placed, tokens, out / f"{name}_explorer.html", title=f"{name}: {text}"))
    import matplotlib.pyplot as plt

    plt.close("all")
    return paths

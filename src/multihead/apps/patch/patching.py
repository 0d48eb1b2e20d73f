"""``multihead patch --hf DIR``: activation patching per head on a local transformers causal language model, from
two texts of the same length, a metric named on the command line; writes the table, the values (JSON) and the
picture."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["load", "metric_of", "run"]


def metric_of(spec: str, tok, clean_ids: torch.Tensor):
    """``logit-diff:A,B`` (the last position's logit of token A minus token B) or ``loss`` (the language-model loss of
    the clean text, per row) as a function of the model's output; a ValueError naming the spec otherwise."""
    if spec == "loss":
        target = clean_ids[:, 1:]

        def loss(out):
            logits = out.logits[:, :-1]  # (B, L-1, V): each position predicts the next clean token
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none").mean(-1)
        return loss, "loss of the clean text"
    kind, _, tokens = spec.partition(":")
    names = [t for t in tokens.split(",") if t]
    if kind != "logit-diff" or len(names) != 2:
        raise ValueError(f"--metric takes logit-diff:TOKEN_A,TOKEN_B or loss; got {spec!r}.")
    ids = []
    for t in names:
        got = tok(t, add_special_tokens=False)["input_ids"]
        if len(got) != 1:
            raise ValueError(f"--metric {spec}: {t!r} is {len(got)} tokens for this tokenizer; give one token each.")
        ids.append(got[0])
    a, b = ids

    def diff(out):
        return out.logits[:, -1, a] - out.logits[:, -1, b]  # (B,)
    return diff, f"logit({names[0]}) - logit({names[1]})"


def _last_logits_only(model):
    """How to call ``model`` when the metric reads the last position's logits alone: with transformers'
    ``logits_to_keep=1`` where its forward takes it (the output head then runs on one position, not L: the same
    values, most of a large vocabulary's work gone), else as usual (None)."""
    import inspect

    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return None
    return lambda m, inputs: m(**inputs, logits_to_keep=1)


def load(path: str | Path, clean: str, corrupted: str, metric: str, *, command: str, why: str):
    """What ``multihead patch`` and ``multihead circuit`` read: the causal LM at ``path`` (attached to multihead), the
    two texts tokenized ({input_ids, attention_mask} each), the metric (:func:`metric_of`) and its description, the
    tokenizer. Refused before any forward: a model other than a causal LM, texts of different token counts (``why``
    they must match), a malformed metric."""
    from multihead.apps.prune.hf_models import _tokenizer

    tok, _ = _tokenizer(Path(path))
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = transformers.AutoConfig.from_pretrained(path).architectures or []
    if not set(archs) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise ValueError(f"{path}: {command} --hf takes a causal language model (an architecture AutoModelForCausalLM "
                         f"loads; its config names {archs}): the metrics read its next-token logits.")
    enc = [tok(t, return_tensors="pt") for t in (clean, corrupted)]
    lengths = [int(e["input_ids"].shape[1]) for e in enc]
    if lengths[0] != lengths[1]:
        raise ValueError(f"--clean is {lengths[0]} tokens and --corrupted {lengths[1]}: {why}, so the two texts must "
                         "have the same number of tokens; change words one for one (or pad the shorter).")
    fn, what = metric_of(metric, tok, enc[0]["input_ids"])
    import multihead.hf as mhf

    model = mhf.attach(transformers.AutoModelForCausalLM.from_pretrained(path).eval())
    inputs = [{"input_ids": e["input_ids"], "attention_mask": e["attention_mask"]} for e in enc]
    return model, inputs, fn, what, tok


def run(path: str | Path, clean: str, corrupted: str, metric: str, out: str | Path, *, positions: bool = False,
        direction: str = "denoise", chunk: int = 32) -> dict:
    """Patch every head of the model at ``path``; writes OUT/patching.md, patching.json (loads back with
    :func:`json.load`: module -> values), patching.png and (all positions) patching.html, the explorer of the clean
    run with each head's effect. Returns the record written to patching.json."""
    import multihead
    from multihead import heads

    model, inputs, fn, what, tok = load(path, clean, corrupted, metric, command="patch",
                                        why="patching takes a head's output position by position")
    r = heads.patch(model, inputs[0], inputs[1], fn, direction=direction, positions=positions, chunk=chunk,
                    run=_last_logits_only(model) if metric != "loss" else None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"metric": what, "direction": direction, "base": r.base, "source": r.source,
              "values": {n: v.tolist() for n, v in r.values.items()}}
    (out / "patching.json").write_text(json.dumps(record, indent=1))
    (out / "patching.md").write_text(f"# Activation patching: {what}\n\n{direction}: base {r.base:.4f}, source "
                                     f"{r.source:.4f}\n\n{r.to_markdown()}\n")
    r.figure(what).savefig(out / "patching.png", dpi=110)
    if not positions:  # the clean run's heads in the explorer, each with its patching effect
        import torch

        from multihead.viz import explorer

        with torch.no_grad(), multihead.capture(model) as cap:
            model(**inputs[0])
        tokens = [tok.decode([i]) for i in inputs[0]["input_ids"][0].tolist()]
        explorer(cap, tokens, out / "patching.html", patching=r, title=f"multihead patch: {what}")
    print(r.to_markdown())
    print(f"wrote {out / 'patching.md'}, {out / 'patching.json'}, {out / 'patching.png'}"
          + ("" if positions else f", {out / 'patching.html'}"))
    return record

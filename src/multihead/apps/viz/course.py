"""The course's two small models and a pretrained sentence encoder, each head drawn (heatmaps, rollout, the HTML
explorer): what ``multihead viz --model`` shows and ``multihead demo`` trains and draws."""

from __future__ import annotations

from pathlib import Path

import torch

import multihead
from multihead.models import seq2seq
from multihead.models import vit as vit_model
from multihead.models.seq2seq import DIGIT0, Seq2SeqTransformer
from multihead.models.vit import ViT, digits


def reverser(ckpt: Path, retrain: bool = False) -> Seq2SeqTransformer:
    """The digit-reversing Transformer: loaded from ``ckpt`` or trained (and saved there)."""
    return seq2seq.load_or_train(ckpt, retrain)


def vit(ckpt: Path, retrain: bool = False) -> ViT:
    """The digits ViT: loaded from ``ckpt`` or trained (and saved there)."""
    return vit_model.load_or_train(ckpt, retrain)


def toy_digits(text: str) -> list[int]:
    """The digits of ``text`` for the toy reverser; ValueError for anything it was not trained on (a character
    that is not a digit 0-9, fewer or more digits than its training strings), before any model is loaded."""
    from multihead.models.seq2seq import MAX_DIGITS, MIN_DIGITS

    other = sorted({c for c in text if c not in "0123456789"})
    if other or not MIN_DIGITS <= len(text) <= MAX_DIGITS:
        why = f"it holds {''.join(other)!r}" if other else f"it has {len(text)} digits"
        raise ValueError(f"the toy model reverses strings of {MIN_DIGITS} to {MAX_DIGITS} digits 0-9 (what it was "
                         f"trained on): give --text like '31415'; got {text!r} ({why}).")
    return [int(c) for c in text]


def draw_reverser(model: Seq2SeqTransformer, text: str, out: Path) -> list[Path]:
    from multihead.viz import ROLLOUT_AXES, explorer, heatmaps, rollout

    digits_ = toy_digits(text)
    src = torch.tensor([[d + DIGIT0 for d in digits_]])
    lens = torch.tensor([len(digits_)])
    pred = model.greedy(src, lens, len(digits_))[0]
    tgt_in = torch.cat([torch.tensor([1]), pred[:-1]])[None]  # BOS + the model's own output
    with torch.no_grad(), multihead.capture(model) as cap:
        model(src, lens, tgt_in)
    src_tok = [str(d) for d in digits_]
    out_tok = ["<bos>"] + [str(int(t) - DIGIT0) if int(t) >= DIGIT0 else "?" for t in pred[:-1]]
    cross = {n: w for n, w in cap.items() if "cross" in n}
    enc = {n: w for n, w in cap.items() if n.startswith("encoder")}
    paths = []
    fig = heatmaps(cross, queries=out_tok, keys=src_tok, xlabel="source", ylabel="target")
    fig.suptitle(f"cross-attention: reversing {''.join(src_tok)}")
    paths.append(out / "transformer_cross_attention.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    fig = heatmaps(rollout(enc)[:, None], queries=src_tok, keys=src_tok, titles=["encoder rollout"],
                   **ROLLOUT_AXES)
    paths.append(out / "transformer_encoder_rollout.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    dec = {n: w for n, w in cap.items() if n.startswith("decoder")}
    key_tokens = {n: (src_tok if "cross" in n else out_tok) for n in dec}
    paths.append(explorer(enc, src_tok, out / "transformer_encoder_explorer.html", title="encoder self-attention"))
    paths.append(explorer(dec, out_tok, out / "transformer_decoder_explorer.html", key_tokens=key_tokens,
                          title="decoder: causal self-attention and cross-attention"))
    return paths


def draw_vit(model: ViT, index: int, out: Path) -> list[Path]:
    from multihead.viz import explorer, heatmaps, rollout

    _, _, xte, yte = digits()
    img, label = xte[index:index + 1], int(yte[index])
    with torch.no_grad(), multihead.capture(model) as cap:
        pred = int(model(img).argmax(-1))
    g = model.grid
    tokens = ["[CLS]"] + [f"p{r},{c}" for r in range(g) for c in range(g)]
    paths = []
    fig = heatmaps(cap, queries=tokens, keys=tokens, max_labels=20)
    fig.suptitle(f"ViT heads: digit {label} (predicted {pred})")
    paths.append(out / "vit_heads.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    r = rollout(cap)[0, 0, 1:].reshape(g, g)  # [CLS] row over the patches
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(6, 3))
    axes[0].imshow(img[0, 0], cmap="gray")
    axes[0].set_title(f"digit {label}")
    axes[1].imshow(img[0, 0], cmap="gray")
    shown = axes[1].imshow(torch.nn.functional.interpolate(r[None, None].float(), size=img.shape[-2:],
                                                           mode="nearest")[0, 0], cmap="Reds", alpha=0.6)
    axes[1].set_title("[CLS] rollout over patches")
    for a in axes:
        a.axis("off")
    fig.colorbar(shown, ax=axes[1], shrink=0.8, label="rollout: share of [CLS] drawn from the patch")
    paths.append(out / "vit_rollout.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close("all")
    paths.append(explorer(cap, tokens, out / "vit_explorer.html", image=img[0, 0], patch_grid=(g, g),
                          prefix_tokens=1, title=f"ViT on digit {label} (predicted {pred})"))
    return paths


def draw_minilm(text: str, out: Path) -> list[Path]:
    from multihead.models import SentenceEncoder, minilm_path
    from multihead.viz import ROLLOUT_AXES, explorer, heatmaps, rollout

    enc = SentenceEncoder.from_pretrained(minilm_path())
    ids, am = enc.tokenize([text])
    tokens = [enc.tokenizer.id_to_token(int(i)) for i in ids[0]]
    with torch.no_grad(), multihead.capture(enc.bert) as cap:
        enc(ids, am)
    paths = []
    fig = heatmaps(cap, queries=tokens, keys=tokens, cell=1.3)
    paths.append(out / "minilm_heads.png")
    fig.savefig(paths[-1], dpi=90, bbox_inches="tight")
    fig = heatmaps(rollout(cap)[:, None], queries=tokens, keys=tokens, titles=["rollout"], cell=4,
                   **ROLLOUT_AXES)
    paths.append(out / "minilm_rollout.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    paths.append(explorer(cap, tokens, out / "minilm_explorer.html", title=f"all-MiniLM-L6-v2: {text}"))
    return paths

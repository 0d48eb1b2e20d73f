"""The small models built from multihead modules: trained here, they must learn
what they are for, and their attention must show it."""

from __future__ import annotations

import torch

from multihead import MultiHeadAttention
from multihead.models import Seq2SeqConfig, Seq2SeqTransformer, ViT, ViTConfig, checkpoint, digits, reverse_batch
from multihead.models.seq2seq import EOS, PAD, alignment


def test_reverse_batch_is_the_task():
    src, lens, tgt_in, tgt_out = reverse_batch(4, generator=torch.Generator().manual_seed(0))
    for i in range(4):
        n = int(lens[i])
        assert tgt_out[i, :n].tolist() == src[i, :n].flip(0).tolist()
        assert tgt_out[i, n] == EOS and (src[i, n:] == PAD).all()
        assert tgt_in[i, 1:n + 1].tolist() == tgt_out[i, :n].tolist()


def test_transformer_cross_attention_follows_the_alignment(trained):
    model = trained["reverser"]
    assert sum(isinstance(m, MultiHeadAttention) for m in model.modules()) == 2 + 2 * 2
    seq_acc, aligned = alignment(model)
    assert seq_acc >= 0.95
    assert aligned >= 0.90  # argmax of the head-mean lands on the right source position


def test_vit_reaches_90_percent(trained):
    assert trained["vit_accuracy"] >= 0.90
    _, _, xte, yte = digits()
    assert xte.shape[1:] == (1, 8, 8) and len(yte) == 359


def test_checkpoints_round_trip(trained):
    d = trained["dir"]
    again = checkpoint.load(Seq2SeqTransformer, Seq2SeqConfig, d / "transformer")
    src, lens, tgt_in, _ = reverse_batch(8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(again(src, lens, tgt_in), trained["reverser"](src, lens, tgt_in))
    vit = checkpoint.load(ViT, ViTConfig, d / "vit")
    x = torch.rand(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(vit(x), trained["vit"](x))
    assert {p.name for p in (d / "vit").iterdir()} == {"config.json", "model.safetensors"}


def test_vit_patches_are_row_major():
    vit = ViT(ViTConfig())
    img = torch.arange(64.0).reshape(1, 1, 8, 8)
    p = vit.patches(img)  # (1, 16, 4)
    assert p.shape == (1, 16, 4)
    assert p[0, 1].tolist() == [2.0, 3.0, 10.0, 11.0]  # row 0, column 1: pixels (0..1, 2..3)

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


def test_patching_finds_the_reversal_in_the_decoders_cross_attention(trained):
    """The course's digit reverser, as the demo trains it: noising one head at a time (the clean run, that head's
    output from a run on other digits) costs the right reversal most in the decoder's cross-attention heads, the
    ones that read the source: every cross-attention module's worst head costs more than any self-attention head."""
    import torch.nn.functional as F

    from multihead import heads

    model = trained["reverser"]
    g = torch.Generator().manual_seed(4)
    src, lens, tgt_in, tgt_out = reverse_batch(32, min_len=8, max_len=8, generator=g)
    other, _, _, _ = reverse_batch(32, min_len=8, max_len=8, generator=g)  # other digits, the same length

    def right(logits):  # (B,): the log-probability of the right reversal, digit by digit
        return -F.cross_entropy(logits[:, :8].transpose(1, 2), tgt_out[:, :8], reduction="none").mean(-1)

    r = heads.patch(model, (src, lens, tgt_in), (other, lens, tgt_in), right, direction="noise")
    cost = {n: float((r.base - v).max()) for n, v in r.values.items()}  # each module's costliest head
    cross = {n: c for n, c in cost.items() if "cross" in n}
    assert len(cross) == 2 and len(cost) == 6, list(cost)
    assert min(cross.values()) > max(c for n, c in cost.items() if n not in cross), cost
    assert r.base > r.source + 1.0  # the corrupted digits do ruin the clean reversal

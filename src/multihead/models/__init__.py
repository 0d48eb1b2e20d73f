"""Models built from multihead modules."""

from multihead.models.bert import Bert, BertConfig, SentenceEncoder, minilm_path

__all__ = ["Bert", "BertConfig", "SentenceEncoder", "minilm_path"]

"""SmolLM2-135M-Instruct as the ``bench/smollm2_*.py`` scripts load it: :func:`multihead.models.smollm2_path`'s folder
(converted once into the shared cache), its tokenizer, and the model in float32 with multihead's attention, attached,
in eval mode. Imported by those scripts (run as ``.venv/bin/python bench/smollm2_X.py``: bench/ is on the path)."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load():
    """(tokenizer, model): SmolLM2-135M-Instruct's tokenizer and the model (float32, ``attn_implementation=
    "multihead"``, attached with :func:`multihead.hf.attach`, eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import multihead.hf as mhf
    from multihead.models import smollm2_path

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = mhf.attach(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="multihead").eval())
    return tok, model

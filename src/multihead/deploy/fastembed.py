"""fastembed: the ONNX files :func:`multihead.deploy.folder.export` wrote, opened as fastembed's ``TextEmbedding``
from the folder itself (no download)."""

from __future__ import annotations

from pathlib import Path

import torch

from multihead.deploy.onnx import ONNX_DIR, ONNX_FILE, ONNX_INT8_FILE, ONNX_SERVE_FILE, ONNX_SERVE_INT8_FILE


def fastembed(folder: str | Path, *, int8: bool = False, normalize: bool = True, name: str | None = None):
    """fastembed's ``TextEmbedding`` of a folder :func:`export` wrote (beside the tokenizer files and config.json,
    as ``prune --hf`` leaves ``OUT/model``): registered as a custom model with mean pooling (sentence-transformers'
    MiniLM pools so) over the file to serve, ``onnx/serve.onnx`` (``int8``: ``onnx/serve_int8.onnx``; the fastest
    form on the machine that wrote it: :mod:`multihead.deploy.serve`; a folder written without one:
    ``onnx/model.onnx``, ``onnx/model_int8.onnx``), its dimension read from
    config.json, then opened from the folder itself (no download), with as many threads as torch. The ``fastembed``
    extra."""
    import json

    from multihead.extras import require

    fe = require("fastembed", "multihead.hf.fastembed")
    from fastembed.common.model_description import ModelSource, PoolingType

    folder = Path(folder)
    f = folder / ONNX_DIR / (ONNX_SERVE_INT8_FILE if int8 else ONNX_SERVE_FILE)
    if not f.is_file():  # written with serve=False: the SDPA graph's file
        f = folder / ONNX_DIR / (ONNX_INT8_FILE if int8 else ONNX_FILE)
    if not f.is_file() or not (folder / "config.json").is_file():
        raise ValueError(f"fastembed: {folder} has no {f.relative_to(folder)} beside a config.json: give a folder "
                         "written by multihead.hf.export (prune --hf writes OUT/model).")
    dim = int(json.loads((folder / "config.json").read_text())["hidden_size"])
    name = name or f"local/{folder.resolve().parent.name}-{folder.name}{'-int8' if int8 else ''}"
    known = {d["model"] for d in fe.TextEmbedding.list_supported_models()}
    if name not in known:
        fe.TextEmbedding.add_custom_model(model=name, pooling=PoolingType.MEAN, normalization=normalize,
                                          sources=ModelSource(hf=name), dim=dim,
                                          model_file=str(f.relative_to(folder)))
    return fe.TextEmbedding(model_name=name, specific_model_path=str(folder), threads=torch.get_num_threads())

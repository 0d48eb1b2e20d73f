"""Optional dependencies: one import helper that names the extra that brings a missing one."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]

#: the extra of pyproject.toml that installs each optional top-level package
EXTRA = {"matplotlib": "viz", "sklearn": "train", "tqdm": "train", "keras": "keras", "transformers": "hf",
         "tokenizers": "hf", "playwright": "browser", "onnx": "onnx", "onnxscript": "onnx", "onnxruntime": "onnx"}


def require(module: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, or an ImportError that says what needs it and the
    ``pip install 'multihead[extra]'`` that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        extra = EXTRA.get(top)
        how = f"pip install 'multihead[{extra}]'" if extra else f"pip install {top}"
        raise ImportError(f"{what} needs {top}, which is not installed: {how}") from e

"""Optional dependencies: one import helper that names the extra that brings a missing one, and
one way to keep their log notices (not the user's to act on) out of the user's terminal."""

from __future__ import annotations

import contextlib
import importlib
import logging
from types import ModuleType

__all__ = ["quiet_logs", "require"]

#: the extra of pyproject.toml that installs each optional top-level package
EXTRA = {"matplotlib": "viz", "sklearn": "train", "tqdm": "train", "keras": "keras", "transformers": "hf",
         "tokenizers": "hf", "playwright": "browser", "onnx": "onnx", "onnxscript": "onnx", "onnxruntime": "onnx",
         "openvino": "openvino", "nncf": "openvino", "fastembed": "fastembed"}


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


@contextlib.contextmanager
def quiet_logs(*names: str, level: int = logging.ERROR):
    """Inside the block the named loggers ("" = the root logger) show only records of ``level`` and
    above: a dependency's informational warnings (torch.onnx's "torchvision is not installed",
    onnxruntime's pre-processing advice) stay out of the user's terminal; errors still show."""
    loggers = [logging.getLogger(n) if n else logging.getLogger() for n in names]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, before):
            lg.setLevel(lv)

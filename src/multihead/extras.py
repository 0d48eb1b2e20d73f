"""Optional dependencies: one import helper that names the extra that brings a missing one, one way to keep their
log notices (not the user's to act on) out of the user's terminal, and the one progress bar of the project (tqdm's on
a terminal or in a notebook; whole lines, now and then, in a file, a pipe or a CI log)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any, TextIO

__all__ = ["progress", "quiet_logs", "require"]

#: the extra of pyproject.toml that installs each optional top-level package
EXTRA = {"matplotlib": "viz", "sklearn": "train", "tqdm": "train", "keras": "keras", "transformers": "hf",
         "tokenizers": "hf", "playwright": "browser", "onnx": "onnx", "onnxscript": "onnx", "onnxruntime": "onnx",
         "openvino": "openvino", "nncf": "openvino", "fastembed": "fastembed",
         "gguf": "decoder", "onnxruntime_genai": "decoder"}


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


#: in a file or a pipe, a progress line at most this often (seconds), and one when the work ends
LOG_EVERY = 10.0


def progress(iterable: Iterable | None = None, *, desc: str, total: float | None = None, unit: str = "it",
             bar_format: str | None = None, enabled: bool = True, file: TextIO | None = None,
             every: float | None = None):
    """The project's one progress bar. On a terminal (or in a notebook) it is tqdm's, redrawn at most once a second;
    when ``file`` (default: ``sys.stderr``) is a file, a pipe or a CI log, it is whole lines instead, no carriage
    return: one at most every ``every`` seconds (default ``LOG_EVERY``) and one at the end (tqdm's own meter,
    ``bar_format`` included). ``enabled=False``: nothing is written. Either way the object iterates ``iterable``
    and answers ``update``, ``set_postfix``, ``set_postfix_str``, ``close``, ``n`` and ``total`` as tqdm's does."""
    if not isinstance(desc, str) or not desc:
        raise TypeError(f"progress: desc must be a non-empty str naming the work (e.g. 'training'), got {desc!r}")
    every = LOG_EVERY if every is None else every
    if isinstance(every, bool) or not isinstance(every, int | float):
        raise TypeError(f"progress: every must be a number of seconds (e.g. 10.0), got {type(every).__name__}")
    if every <= 0:
        raise ValueError(f"progress: every must be a positive number of seconds (e.g. 10.0), got {every!r}")
    tqdm = require("tqdm.auto", "a progress bar").tqdm
    stream = sys.stderr if file is None else file
    notebook = any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)
    if enabled and (notebook or _is_terminal(stream)):
        return tqdm(iterable, desc=desc, total=total, unit=unit, bar_format=bar_format, file=file, mininterval=1.0)
    return _Lines(iterable, desc=desc, total=total, unit=unit, bar_format=bar_format,
                  file=stream if enabled else None, every=every)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Lines:
    """tqdm's meter as whole lines for a log: the first after ``every`` seconds, then at most one every ``every``
    seconds, and the last when the bar closes (nothing when ``file`` is None)."""

    def __init__(self, iterable, *, desc, total, unit, bar_format, file, every):
        self.iterable, self.desc, self.unit, self.bar_format, self.file, self.every = \
            iterable, desc, unit, bar_format, file, every
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.n, self.postfix = total, 0, ""
        self.start = self.last = time.monotonic()
        self.closed, self.shown = False, None  # shown: the (n, postfix) of the last line written

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.iterable)

    def update(self, n: float = 1) -> None:
        self.n += n
        self._maybe_write()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.set_postfix_str(", ".join(f"{k}={v}" for k, v in items.items()), refresh)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)
        if refresh:
            self._maybe_write()

    def refresh(self) -> None:
        self._maybe_write()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.shown != (self.n, self.postfix):  # the end, unless the last line already said it
                self._write()

    def _maybe_write(self) -> None:
        if not self.closed and time.monotonic() - self.last >= self.every:
            self._write()

    def _write(self) -> None:
        self.last, self.shown = time.monotonic(), (self.n, self.postfix)
        if self.file is None:
            return
        from tqdm import tqdm

        line = tqdm.format_meter(self.n, self.total, self.last - self.start, prefix=self.desc, unit=self.unit,
                                 ascii=True, postfix=self.postfix or None, bar_format=self.bar_format)
        self.file.write(line.replace("\r", " ").rstrip() + "\n")  # a whole line, no carriage return
        self.file.flush()

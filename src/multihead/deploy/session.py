"""A runtime's file opened on the CPU and called like the transformers model (:class:`RuntimeModel`): ONNX Runtime's
session (:func:`ort_session`) and OpenVINO's compiled model (:func:`openvino_model`), each with as many threads as
torch and set up to be timed beside it. The peers, the runtime table and the choice of the file to serve open their
files here; the runtime files a process makes for them go in its :func:`scratch` folders."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch


class RuntimeModel:
    """A compiled ONNX model called like the transformers model: ``(input_ids, attention_mask[, token_type_ids])``
    (B, L) -> an object with ``last_hidden_state`` (B, L, E). ``names``: the graph's inputs (token types are
    zeros when the caller gives none, as transformers' BERT makes them)."""

    def __init__(self, run, names: list[str]):
        self.run, self.names = run, list(names)  # run: {name: ndarray (B, L)} -> ndarray (B, L, E)

    def __call__(self, input_ids, attention_mask, token_type_ids=None):
        x = {"input_ids": input_ids, "attention_mask": attention_mask,
             "token_type_ids": torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids}
        out = self.run({n: x[n].numpy() for n in self.names})
        return SimpleNamespace(last_hidden_state=torch.from_numpy(out))


def ort_session(f: Path) -> RuntimeModel:
    """The ONNX file ``f`` (fp32 or int8) in ONNX Runtime on the CPU, with as many threads as torch and its idle
    workers not spinning (they would slow torch beside them)."""
    from multihead.extras import require

    ort = require("onnxruntime", "the ONNX Runtime peer")
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(f), so, providers=["CPUExecutionProvider"])
    return RuntimeModel(lambda feed: session.run(None, feed)[0], [i.name for i in session.get_inputs()])


def openvino_model(f: Path) -> RuntimeModel:
    """The ONNX or OpenVINO IR file ``f`` compiled by OpenVINO for the CPU: fp32 inference precision (no bf16 even
    where the CPU has it; an int8 IR keeps its int8 layers), as many threads as torch, the latency hint (one
    request at a time, as timed here)."""
    from multihead.extras import require

    ov = require("openvino", "the OpenVINO peer")
    compiled = ov.Core().compile_model(str(f), "CPU", {
        "INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": torch.get_num_threads(),
        "PERFORMANCE_HINT": "LATENCY"})
    out = compiled.output(0)
    return RuntimeModel(lambda feed: compiled(feed)[out], [i.get_any_name() for i in compiled.inputs])


def scratch() -> Path:
    """A new empty folder for runtime files this process makes, inside one temporary folder of the process's that is
    removed when the process ends (normally or by an exception): the per-process caches here keep their files until
    then, and nothing is left in the system's temporary folder (an encoder's standard files are ~0.8 GB a run)."""
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = tempfile.TemporaryDirectory(prefix="multihead-runtimes-")  # its finalizer removes it at exit
    return Path(tempfile.mkdtemp(dir=_SCRATCH.name))


_SCRATCH: tempfile.TemporaryDirectory | None = None

"""Other runtimes of the same checkpoint, timed beside ours by ``prune --hf`` and bench W7: ONNX Runtime's int8
model (the ``onnx`` extra) and OpenVINO's fp32 model (the ``openvino`` extra), both from the ONNX file
:func:`multihead.hf.export_onnx` writes, both called like the transformers model."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch


class RuntimeModel:
    """A compiled ONNX model called like the transformers model: ``(input_ids, attention_mask)`` (B, L) ->
    an object with ``last_hidden_state`` (B, L, E)."""

    def __init__(self, run):
        self.run = run  # {"input_ids": ndarray, "attention_mask": ndarray} -> ndarray (B, L, E)

    def __call__(self, input_ids, attention_mask):
        out = self.run({"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
        return SimpleNamespace(last_hidden_state=torch.from_numpy(out))


def _export(model, example: dict) -> Path:
    import multihead.hf as mhf

    d = Path(tempfile.mkdtemp())
    return mhf.export_onnx(model, d / "fp32.onnx", example={k: example[k] for k in ("input_ids", "attention_mask")})


def ort_int8(model, example: dict) -> RuntimeModel:
    """The model exported, dynamically quantized to int8 by onnxruntime (QInt8 weights), run with as many
    threads as torch and its idle workers not spinning (they would slow torch beside them)."""
    from multihead.extras import quiet_logs, require

    ort = require("onnxruntime", "the ONNX Runtime peer")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    f = _export(model, example)
    with quiet_logs(""):  # onnxruntime's "consider pre-processing" advice goes to the root logger
        quantize_dynamic(str(f), str(f.with_name("int8.onnx")), weight_type=QuantType.QInt8)
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(f.with_name("int8.onnx")), so, providers=["CPUExecutionProvider"])
    return RuntimeModel(lambda feed: session.run(None, feed)[0])


def openvino_fp32(model, example: dict) -> RuntimeModel:
    """The model exported and compiled by OpenVINO for the CPU: fp32 inference precision (no bf16 even where
    the CPU has it), as many threads as torch, the latency hint (one request at a time, as timed here)."""
    from multihead.extras import require

    ov = require("openvino", "the OpenVINO peer")
    compiled = ov.Core().compile_model(str(_export(model, example)), "CPU", {
        "INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": torch.get_num_threads(),
        "PERFORMANCE_HINT": "LATENCY"})
    out = compiled.output(0)
    return RuntimeModel(lambda feed: compiled(feed)[out])

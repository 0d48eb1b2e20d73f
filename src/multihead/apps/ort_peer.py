"""ONNX Runtime's int8 model of a transformers checkpoint: the peer `prune --hf` and bench W7 time beside ours
(the `onnx` extra)."""

from __future__ import annotations

from pathlib import Path

import torch


class OrtModel:
    """An ONNX Runtime session called like the transformers model (returns last_hidden_state)."""

    def __init__(self, session):
        self.session = session

    def __call__(self, input_ids, attention_mask):
        from types import SimpleNamespace

        out = self.session.run(None, {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})[0]
        return SimpleNamespace(last_hidden_state=torch.from_numpy(out))


def ort_int8(model, example: dict) -> OrtModel:
    """The model exported (multihead.hf.export_onnx), dynamically quantized to int8 by onnxruntime, run with
    as many threads as torch and its idle workers not spinning (they would slow torch beside them)."""
    import tempfile

    import multihead.hf as mhf
    from multihead.extras import quiet_logs, require

    ort = require("onnxruntime", "the ONNX Runtime peer")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    d = Path(tempfile.mkdtemp())
    mhf.export_onnx(model, d / "fp32.onnx", example={k: example[k] for k in ("input_ids", "attention_mask")})
    with quiet_logs(""):  # onnxruntime's "consider pre-processing" advice goes to the root logger
        quantize_dynamic(str(d / "fp32.onnx"), str(d / "int8.onnx"), weight_type=QuantType.QInt8)
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return OrtModel(ort.InferenceSession(str(d / "int8.onnx"), so, providers=["CPUExecutionProvider"]))

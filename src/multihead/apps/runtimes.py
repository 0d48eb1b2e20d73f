"""Other runtimes of the same checkpoint, timed beside ours by ``prune --hf`` and bench W7: ONNX Runtime's int8
model (the ``onnx`` extra) and OpenVINO's fp32 model (the ``openvino`` extra), both from one ONNX file
(:func:`export`, through :func:`multihead.hf.export_onnx`), both called like the transformers model;
:func:`peers` makes those this machine has."""

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


def export(model, example: dict) -> Path:
    """``model`` written as ONNX (:func:`multihead.hf.export_onnx`, traced on ``example``'s input_ids and
    attention_mask) into a new temporary folder: the file every runtime here starts from. A model with the
    same class, config and weights (by content) is exported once per process: the exporter takes seconds
    even for a tiny model, and ``prune --hf`` exports the same checkpoint at every run."""
    import multihead.hf as mhf

    key = _fingerprint(model)
    if key is None or key not in _EXPORTS or not _EXPORTS[key].is_file():
        d = Path(tempfile.mkdtemp())
        f = mhf.export_onnx(model, d / "fp32.onnx", example={k: example[k] for k in ("input_ids", "attention_mask")})
        if key is None:
            return f
        _EXPORTS[key] = f
    return _EXPORTS[key]


_EXPORTS: dict[str, Path] = {}


def _fingerprint(model) -> str | None:
    """A digest of what the exported graph depends on: the model's class, its config, and every parameter and
    buffer (name, dtype, shape, values); None when its state holds anything but tensors, or a hook changes what
    an attention module computes (gates: not in the weights), so it is not cached."""
    import hashlib

    if any(getattr(m, "attention_hooks", None) is not None and m.attention_hooks.transforms for m in model.modules()):
        return None

    h = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    h.update(model.config.to_json_string().encode())
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            return None
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        flat = t.detach().cpu().contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def ort_int8(f: Path) -> RuntimeModel:
    """The ONNX file ``f`` dynamically quantized to int8 by onnxruntime (QInt8 weights, one scale per output
    channel: on all-MiniLM-L6-v2 pruned 40%, mean cosine 0.970 where one scale per tensor gives 0.947, in about
    the same time), in :func:`ort_session`."""
    from multihead.extras import quiet_logs, require

    require("onnxruntime", "the ONNX Runtime peer")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet_logs(""):  # onnxruntime's "consider pre-processing" advice goes to the root logger
        quantize_dynamic(str(f), str(f.with_name("int8.onnx")), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"])
    return ort_session(f.with_name("int8.onnx"))


def openvino_fp32(f: Path) -> RuntimeModel:
    """The ONNX file ``f`` in :func:`openvino_model`."""
    return openvino_model(f)


def openvino_int8(f: Path, calibration: list[dict]) -> RuntimeModel:
    """The ONNX file ``f`` quantized by NNCF's static int8 (:func:`multihead.hf.export.openvino_int8`, calibrated on
    ``calibration``: text the timing never uses), compiled by :func:`openvino_model`."""
    from multihead.hf.export import openvino_int8 as quantized_ir

    return openvino_model(quantized_ir(f, Path(tempfile.mkdtemp()) / "int8.xml", calibration))


def peers(model, example: dict, log=None, calibration: list[dict] | None = None) -> dict[str, RuntimeModel]:
    """{name: runtime model} of the unpruned encoder ``model`` in every runtime whose extra is installed
    (exported once); a missing extra is told to ``log`` when given. ``calibration``: batches for OpenVINO's int8
    model (static quantization; without them it is not made)."""
    from multihead.extras import require

    try:
        require("onnxscript", "the ONNX export")  # the exporter comes with the onnx extra
    except ImportError as e:
        if log is not None:
            log(f"  no other runtime timed: {e}")
        return {}
    f = export(model, example)
    out = {}
    makers = [("ONNX Runtime int8 (unpruned)", ort_int8), ("OpenVINO fp32 (unpruned)", openvino_fp32)]
    if calibration:
        makers.append(("OpenVINO int8, NNCF static (unpruned)", lambda f: openvino_int8(f, calibration)))
    for name, make in makers:
        try:
            out[name] = make(f)
        except ImportError as e:
            if log is not None:
                log(f"  {name} not timed: {e}")
    return out

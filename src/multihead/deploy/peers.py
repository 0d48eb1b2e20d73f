"""The peers of every runtime table, timed beside ours by ``prune --hf`` and bench W7: the unpruned transformers model
made into each runtime's files the way that runtime's documentation does it. Each runtime's room makes its own
(:func:`multihead.deploy.onnx._onnx_standard`, :func:`multihead.deploy.openvino._openvino_standard`, labelled in
their ``ONNX_STANDARD`` and ``OPENVINO_STANDARD``); this index lists them all (:func:`standard_files`: the peer of
every runtime table, made once per process, labelled in :data:`STANDARD`), and :func:`peers` opens those this machine
has, each called like the transformers model."""

from __future__ import annotations

from pathlib import Path

import torch

from multihead.deploy.onnx import ONNX_STANDARD, _fingerprint, _onnx_standard
from multihead.deploy.openvino import OPENVINO_STANDARD, _openvino_standard
from multihead.deploy.session import RuntimeModel, openvino_model, ort_session, scratch

#: the standard files' labels: (key, how the runtime's documentation makes it), every runtime's
STANDARD = ONNX_STANDARD | OPENVINO_STANDARD


def standard_files(model, example: dict, calibration: list[dict] | None = None, *, openvino: bool = True,
                   log=None) -> dict[str, Path]:
    """The unpruned transformers encoder ``model``, as loaded (its own attention, sdpa by default), made into runtime
    files the way each runtime's documentation does it -- the peer every runtime table times the pruned files
    against: ``torch.onnx.export`` of the model (its defaults, both sizes dynamic), ONNX Runtime's
    ``quantize_dynamic`` (int8 weights, per channel), ONNX Runtime's transformer optimizer (where it has a pass for
    the model type) and the optimized file quantized the same way; the same from the eager graph (the plain export of
    the model loaded with ``attn_implementation="eager"``, quantized, and optimum's way, where ONNX Runtime fuses
    attention: :func:`multihead.deploy.onnx._onnx_standard`); OpenVINO's ``convert_model`` of the ONNX file and NNCF's
    static int8 (with ``calibration``) where the openvino extra is installed, and the same from the PyTorch model
    through OpenVINO's PyTorch frontend (optimum-intel's way: :func:`multihead.deploy.openvino._openvino_standard`).
    {key: path} (keys as :data:`STANDARD`), exported once per process for the same weights."""
    from multihead.deploy.trace import _export_example, input_names
    from multihead.extras import require

    require("onnxscript", "the standard ONNX export")
    names = input_names(model)
    key = _fingerprint(model)
    if key is not None:  # the attention implementation (not in the config's JSON) and the calibration text count too
        import hashlib

        h = hashlib.sha256(f"{key}:{model.config._attn_implementation}".encode())
        for b in calibration or ():
            for name in sorted(b):
                h.update(name.encode() + torch.as_tensor(b[name]).contiguous().numpy().tobytes())
        key = h.hexdigest()
    cached = _STANDARD.get(key) if key is not None else None
    if cached is not None:  # served by an export that holds at least what is asked (OpenVINO, its int8 model)
        held, (had_openvino, had_int8) = cached
        if (had_openvino or not openvino) and (had_int8 or not calibration) and all(f.is_file() for f in held.values()):
            return held
    d = scratch()
    xs = _export_example(example, names)  # (B, L) each, B, L >= 2
    out = _onnx_standard(model, xs, names, d, log)
    if openvino:
        out |= _openvino_standard(model, out["onnx"], xs, names, d, calibration=calibration, log=log)
    if key is not None:
        _STANDARD[key] = (out, (openvino, bool(calibration)))
    return out


_STANDARD: dict[str, tuple[dict[str, Path], tuple[bool, bool]]] = {}  # fingerprint -> (files, (openvino, its int8))


def peers(model, example: dict, log=None, calibration: list[dict] | None = None, *, openvino: bool = True
          ) -> dict[str, RuntimeModel]:
    """{name: runtime model} of the unpruned transformers encoder ``model`` (as loaded, not attached) in every runtime
    whose extra is installed, from its standard files (:func:`standard_files`: made as users make them, once); a
    missing extra is told to ``log`` when given. ``calibration``: batches for OpenVINO's int8 model (static
    quantization; without them it is not made); ``openvino``: False leaves OpenVINO's files out."""
    from multihead.extras import require

    try:
        require("onnxscript", "the ONNX export")  # the exporter comes with the onnx extra
    except ImportError as e:
        if log is not None:
            log(f"  no other runtime timed: {e}")
        return {}
    files = standard_files(model, example, calibration, openvino=openvino, log=log)
    labels = [("onnx_int8", "ONNX Runtime int8"), ("onnx_eager_int8", "ONNX Runtime int8, eager attention"),
              ("onnx_optimized_int8", "ONNX Runtime int8, ORT optimizer"),
              ("onnx_eager_optimized_int8", "ONNX Runtime int8, eager + ORT optimizer"),
              ("openvino", "OpenVINO fp32"), ("openvino_int8", "OpenVINO int8, NNCF static"),
              ("openvino_pt", "OpenVINO fp32, PyTorch frontend"),
              ("openvino_pt_int8", "OpenVINO int8, PyTorch frontend + NNCF static")]
    out = {}
    for k, label in labels:
        if k in files:
            out[f"{label} (unpruned, standard export)"] = (ort_session if k.startswith("onnx") else openvino_model)(
                files[k])
    return out

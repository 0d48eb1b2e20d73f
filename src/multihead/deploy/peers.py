"""Other runtimes of the same checkpoint, timed beside ours by ``prune --hf`` and bench W7: the unpruned transformers
model made into ONNX Runtime's and OpenVINO's files the way each runtime's documentation does it
(:func:`standard_files`: the peer of every runtime table), each called like the transformers model; :func:`peers`
opens those this machine has; :func:`export` writes a model through :func:`multihead.hf.export_onnx`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from multihead.deploy.session import RuntimeModel, openvino_model, ort_session  # noqa: F401 - peers.ort_session, ...


def scratch() -> Path:
    """A new empty folder for runtime files this process makes, inside one temporary folder of the process's that is
    removed when the process ends (normally or by an exception): the per-process caches here keep their files until
    then, and nothing is left in the system's temporary folder (an encoder's standard files are ~0.8 GB a run)."""
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = tempfile.TemporaryDirectory(prefix="multihead-runtimes-")  # its finalizer removes it at exit
    return Path(tempfile.mkdtemp(dir=_SCRATCH.name))


_SCRATCH: tempfile.TemporaryDirectory | None = None


def export(model, example: dict) -> Path:
    """``model`` written as ONNX (:func:`multihead.hf.export_onnx`, traced on ``example``'s input_ids and
    attention_mask) into a new folder of :func:`scratch`: the file every runtime here starts from. A model with the
    same class, config and weights (by content) is exported once per process: the exporter takes seconds
    even for a tiny model, and ``prune --hf`` exports the same checkpoint at every run."""
    import multihead.hf as mhf

    key = _fingerprint(model)
    if key is None or key not in _EXPORTS or not _EXPORTS[key].is_file():
        d = scratch()
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
    from multihead.deploy.onnx import quantize_standard

    return ort_session(quantize_standard(f, f.with_name("int8.onnx"), matmul_only=True))


def openvino_fp32(f: Path) -> RuntimeModel:
    """The ONNX file ``f`` in :func:`openvino_model`."""
    return openvino_model(f)


def openvino_int8_model(f: Path, calibration: list[dict]) -> RuntimeModel:
    """The ONNX file ``f`` quantized by NNCF's static int8 (:func:`multihead.deploy.openvino.openvino_int8`, calibrated on
    ``calibration``: text the timing never uses), compiled by :func:`openvino_model`."""
    from multihead.deploy.openvino import openvino_int8 as quantized_ir

    return openvino_model(quantized_ir(f, scratch() / "int8.xml", calibration))


class _Hidden(torch.nn.Module):
    """A transformers encoder called with its token tensors, giving its last hidden state: what a user wraps to export
    the model for sentence embeddings (the pooler left out, as sentence-transformers and fastembed read it)."""

    def __init__(self, model, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        types = {"token_type_ids": token_type_ids} if "token_type_ids" in self.names else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **types).last_hidden_state  # (B, L, E)


#: the standard files' labels: (key, how the runtime's documentation makes it)
STANDARD = {"onnx": "torch.onnx.export", "onnx_int8": "torch.onnx.export + quantize_dynamic",
            "onnx_optimized": "torch.onnx.export + ORT optimizer",
            "onnx_optimized_int8": "torch.onnx.export + ORT optimizer + quantize_dynamic",
            "onnx_eager": "eager attention, torch.onnx.export (TorchScript)",
            "onnx_eager_int8": "eager attention, torch.onnx.export (TorchScript) + quantize_dynamic",
            "onnx_eager_optimized": "eager attention, torch.onnx.export (TorchScript) + ORT optimizer",
            "onnx_eager_optimized_int8": "eager attention, torch.onnx.export (TorchScript) + ORT optimizer + "
                                         "quantize_dynamic",
            "openvino": "openvino.convert_model of the ONNX file",
            "openvino_int8": "openvino.convert_model of the ONNX file + NNCF",
            "openvino_pt": "openvino.convert_model of the PyTorch model",
            "openvino_pt_int8": "openvino.convert_model of the PyTorch model + NNCF"}


def standard_files(model, example: dict, calibration: list[dict] | None = None, *, openvino: bool = True,
                   log=None) -> dict[str, Path]:
    """The unpruned transformers encoder ``model``, as loaded (its own attention, sdpa by default), made into runtime
    files the way each runtime's documentation does it -- the peer every runtime table times the pruned files
    against: ``torch.onnx.export`` of the model (its defaults, both sizes dynamic), ONNX Runtime's
    ``quantize_dynamic`` (int8 weights, per channel), ONNX Runtime's transformer optimizer (where it has a pass for
    the model type) and the optimized file quantized the same way; the same from the eager graph (:func:`_eager_files`:
    the plain export of the model loaded with ``attn_implementation="eager"``, quantized, and optimum's way, where ONNX
    Runtime fuses attention); OpenVINO's ``convert_model`` of the ONNX file and NNCF's static
    int8 (with ``calibration``) where the openvino extra is installed, and the same from the PyTorch model through
    OpenVINO's PyTorch frontend (:func:`_openvino_pt`: optimum-intel's way). {key: path} (keys as :data:`STANDARD`), exported
    once per process for the same weights."""
    from multihead.deploy.onnx import optimize, quantize_standard
    from multihead.deploy.trace import _export_example, input_names
    from multihead.extras import quiet_logs, require

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
    B, L = torch.export.Dim("B"), torch.export.Dim("L", max=int(model.config.max_position_embeddings))
    was = model.training
    model.eval()
    try:
        with quiet_logs("torch.onnx"):
            torch.onnx.export(_Hidden(model, names).eval(), xs, str(d / "model.onnx"), input_names=names,
                              output_names=["last_hidden_state"], dynamic_shapes={n: {0: B, 1: L} for n in names})
    finally:
        model.train(was)
    f = d / "model.onnx"
    out = {"onnx": f, "onnx_int8": quantize_standard(f, d / "model_int8.onnx")}
    fused = optimize(model, f, d / "model_optimized.onnx")
    if fused["written"]:
        out["onnx_optimized"] = d / "model_optimized.onnx"
        out["onnx_optimized_int8"] = quantize_standard(d / "model_optimized.onnx", d / "model_optimized_int8.onnx")
    out |= _eager_files(model, xs, names, d, log)
    if openvino:
        out |= _openvino_standard(model, f, xs, names, d, calibration=calibration, log=log)
    if key is not None:
        _STANDARD[key] = (out, (openvino, bool(calibration)))
    return out


def _eager_files(model, xs: tuple, names: list[str], d: Path, log=None) -> dict[str, Path]:
    """{"onnx_eager", "onnx_eager_int8"[, "onnx_eager_optimized", "onnx_eager_optimized_int8"]: path} in ``d``:
    ``model`` with transformers' eager attention through the TorchScript exporter
    (:func:`multihead.deploy.onnx.eager_onnx`, inputs ``xs`` named ``names``) -- the plain export of the model loaded
    with ``attn_implementation="eager"`` -- and ``quantize_dynamic`` per channel; then, where ONNX Runtime's optimizer
    has a pass for the model type, that graph through it given the config's head count and hidden size (as optimum
    gives them), quantized the same way; {} where the export fails (told to ``log``)."""
    from multihead.deploy.onnx import ORT_MODEL_TYPES, eager_onnx, optimize, quantize_standard
    from multihead.deploy.trace import _padded_eval

    try:
        with _padded_eval(model):
            eager_onnx(_Hidden(model, names), model, xs, names, d / "model_eager.onnx")
            out = {"onnx_eager": d / "model_eager.onnx",
                   "onnx_eager_int8": quantize_standard(d / "model_eager.onnx", d / "model_eager_int8.onnx")}
            if ORT_MODEL_TYPES.get(getattr(model.config, "model_type", "")) is None:
                return out
            fused = optimize(model, d / "model_eager.onnx", d / "model_eager_optimized.onnx", heads_from_config=True)
    except Exception as e:  # noqa: BLE001 - the exporter's and the optimizer's failures share no base class
        if log is not None:
            log(f"  the eager standard export not made: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return {}
    if not fused["written"]:
        return out
    return out | {"onnx_eager_optimized": d / "model_eager_optimized.onnx",
                  "onnx_eager_optimized_int8": quantize_standard(d / "model_eager_optimized.onnx",
                                                                 d / "model_eager_optimized_int8.onnx")}


def _openvino_standard(model, f: Path, xs: tuple, names: list[str], d: Path, *, calibration=None,
                       log=None) -> dict[str, Path]:
    """OpenVINO's files of the unpruned ``model`` in ``d``: ``convert_model`` of the ONNX file ``f`` and of the PyTorch
    model (:func:`_openvino_pt`), each with NNCF's static int8 where ``calibration`` is given; {} without the openvino
    extra (told to ``log``)."""
    from multihead.deploy.openvino import openvino_int8
    from multihead.extras import require

    try:
        ov = require("openvino", "OpenVINO's standard conversion")
        ov.save_model(ov.convert_model(str(f)), str(d / "openvino_model.xml"), compress_to_fp16=False)
        out = {"openvino": d / "openvino_model.xml"} | _openvino_pt(model, xs, names, d, log)
        for k in [k for k in ("openvino", "openvino_pt") if k in out and calibration]:
            out[f"{k}_int8"] = openvino_int8(out[k], d / f"{k}_model_int8.xml", calibration)
        return out
    except ImportError as e:
        if log is not None:
            log(f"  OpenVINO's standard files not made: {e}")
        return {}


def _openvino_pt(model, xs: tuple, names: list[str], d: Path, log=None) -> dict[str, Path]:
    """{"openvino_pt": path} in ``d``: ``model`` (its own attention) through OpenVINO's PyTorch frontend
    (``openvino.convert_model`` of the module, traced on ``xs`` named ``names``: OpenVINO's documented first route,
    and the one optimum-intel and sentence-transformers' OpenVINO backend take); {} where it fails (told to ``log``)."""
    import warnings

    from multihead.deploy.trace import _padded_eval
    from multihead.extras import quiet_logs, require

    ov = require("openvino", "OpenVINO's standard conversion")
    try:
        with _padded_eval(model), torch.no_grad(), warnings.catch_warnings(), quiet_logs("torch"):
            warnings.simplefilter("ignore")  # the tracer's notices
            ir = ov.convert_model(_Hidden(model, names).eval(), example_input=dict(zip(names, xs)))
        ir.outputs[0].get_tensor().set_names({"last_hidden_state"})
        ov.save_model(ir, str(d / "openvino_pt_model.xml"), compress_to_fp16=False)
    except Exception as e:  # noqa: BLE001 - the frontend's failures share no base class
        if log is not None:
            log(f"  OpenVINO's conversion of the PyTorch model not made: {type(e).__name__}: {str(e)[:200]}")
        return {}
    return {"openvino_pt": d / "openvino_pt_model.xml"}


_STANDARD: dict[str, tuple[dict[str, Path], tuple[bool, bool]]] = {}  # fingerprint -> (files, (openvino, its int8))


def peers(model, example: dict, log=None, calibration: list[dict] | None = None) -> dict[str, RuntimeModel]:
    """{name: runtime model} of the unpruned transformers encoder ``model`` (as loaded, not attached) in every runtime
    whose extra is installed, from its standard files (:func:`standard_files`: made as users make them, once); a
    missing extra is told to ``log`` when given. ``calibration``: batches for OpenVINO's int8 model (static
    quantization; without them it is not made)."""
    from multihead.extras import require

    try:
        require("onnxscript", "the ONNX export")  # the exporter comes with the onnx extra
    except ImportError as e:
        if log is not None:
            log(f"  no other runtime timed: {e}")
        return {}
    files = standard_files(model, example, calibration, log=log)
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

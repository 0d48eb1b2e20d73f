"""OpenVINO: a (pruned) transformers model converted to OpenVINO IR (:func:`openvino_ir`: through OpenVINO's PyTorch
frontend, as optimum-intel converts, else the ONNX file through its ONNX frontend), its graph rewrites (the padding
mask read straight from ``attention_mask``: :func:`padding_mask_only`; same-shape reshapes left out:
:func:`identity_reshapes`; each attention op's query and key from one int8 product: :func:`merge_query_key`) and
NNCF's static int8 (:func:`nncf_int8`); the files :func:`multihead.deploy.folder.export` writes under
``DIR/openvino/``, each compared with the torch model before it is kept (:mod:`multihead.deploy.check`).

The peers' OpenVINO files are made here too: the unpruned model converted as OpenVINO's documentation does it, from
the ONNX file and from the PyTorch model, each with NNCF's int8 (:func:`_openvino_standard`, labelled in
:data:`OPENVINO_STANDARD`; :func:`multihead.deploy.peers.standard_files` lists every runtime's).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from multihead.deploy.check import verify
from multihead.deploy.onnx import EXPORT_JSON
from multihead.deploy.session import RuntimeModel, openvino_model, scratch
from multihead.deploy.trace import _export_example, _Hidden, _padded_eval, _TokensToHidden, standard_attention
from multihead.hf.layouts import probe_inputs

OPENVINO_DIR, OPENVINO_FILE, OPENVINO_INT8_FILE = "openvino", "openvino_model.xml", "openvino_model_int8.xml"
#: the files to serve (deploy/serve.py): one form each today, under the same names as ONNX Runtime's
OPENVINO_SERVE_FILE, OPENVINO_SERVE_INT8_FILE = "serve.xml", "serve_int8.xml"


def _openvino(model: nn.Module, f: Path, folder: Path, names: list[str],
              calibration: list[dict] | None, example: dict | None = None) -> dict[str, Path]:
    """OpenVINO IR of ``model`` in ``folder``: fp32 (:func:`openvino_ir`, verified like the ONNX file), and int8 by
    NNCF's static quantization (the transformer preset) where nncf is installed and ``calibration`` is given, each
    attention op's query and key products then merged into one (:func:`merge_query_key`, checked against NNCF's
    model by :func:`_query_key_merged`); export.json says how each file was made."""
    from multihead.extras import require

    ov = require("openvino", "OpenVINO IR export")
    folder.mkdir(parents=True, exist_ok=True)
    ir, how = openvino_ir(model, f, names, example)
    ov.save_model(ir, str(folder / OPENVINO_FILE), compress_to_fp16=False)
    record = f.with_name(EXPORT_JSON)
    if record.is_file():  # the export's record says which conversion the IR is
        record.write_text(json.dumps(json.loads(record.read_text()) | {"openvino": how}, indent=2))
    written = {"openvino": folder / OPENVINO_FILE}
    if not calibration:
        return written
    q, how = _query_key_merged(nncf_int8(folder / OPENVINO_FILE, calibration), calibration[0])
    ov.save_model(q, str(folder / OPENVINO_INT8_FILE), compress_to_fp16=False)
    if record.is_file():
        record.write_text(json.dumps(json.loads(record.read_text()) | {"openvino_int8": how}, indent=2))
    return written | {"openvino_int8": folder / OPENVINO_INT8_FILE}


def openvino_ir(model: nn.Module, f: Path | None, names: list[str], example: dict | None = None):
    """(OpenVINO model, how it was made) of the transformers ``model`` (inputs ``names``): the model itself through
    OpenVINO's PyTorch frontend (``openvino.convert_model`` of the module with transformers' SDPA attention at its
    pruned size, traced on ``example``; the way optimum-intel and sentence-transformers' OpenVINO backend convert:
    one OpenVINO attention op per layer), run on two padded batches and compared with the torch model
    (:func:`verify`); then, where the traced mask is the padding mask alone, each attention op given it straight
    from ``attention_mask`` (:func:`padding_mask_only`: ~30 fewer nodes OpenVINO re-runs at every new input length),
    the reshapes that keep every dimension after them left out (:func:`identity_reshapes`), and compared again
    (:func:`_simplified`: where a rewrite or that check fails, the verified conversion as it was); where the
    conversion itself fails or differs, the ONNX file ``f`` through OpenVINO's ONNX frontend, verified the same way
    (RuntimeError when it cannot be read). The output is named like the model's first output
    (``last_hidden_state`` or ``logits``)."""
    from multihead.extras import quiet_logs, require

    ov = require("openvino", "OpenVINO IR export")
    core, why = ov.Core(), None

    def checked(ir, what: str):
        compiled = core.compile_model(ir, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                  "INFERENCE_NUM_THREADS": torch.get_num_threads()})
        verify(model, lambda feed: compiled(feed)[compiled.output(0)], names, what)
        return ir

    xs = _export_example(example if example is not None else probe_inputs(model), names)  # (B, L) each
    with _padded_eval(model), standard_attention(model) as used, torch.no_grad():
        out_name = next(iter(model(**dict(zip(names, xs))).keys()))  # last_hidden_state, logits, ...
        try:
            with warnings.catch_warnings(), quiet_logs("torch"):
                warnings.simplefilter("ignore")  # the tracer's notices (the mask's data-dependent branches)
                ir = ov.convert_model(_TokensToHidden(model, "token_type_ids" in names).eval(),
                                      example_input=dict(zip(names, xs)))
            ir.outputs[0].get_tensor().set_names({out_name})
            ir = checked(ir, "the PyTorch model's OpenVINO conversion")
            return _simplified(ir, model, f"openvino.convert_model of the PyTorch model ({used} attention)", checked)
        except Exception as e:  # noqa: BLE001 - the frontend's and verify's failures share no base class
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if f is None:
        raise RuntimeError(f"OpenVINO could not convert the PyTorch model ({why}) and no ONNX file was given")
    try:
        ir = ov.convert_model(str(f))
    except Exception as e:  # noqa: BLE001 - OpenVINO's conversion errors share no base class beyond Exception
        raise RuntimeError(str(e)) from None
    return checked(ir, f"{f} in OpenVINO"), f"openvino.convert_model of {f.name} (the PyTorch model's conversion: {why})"


def _simplified(ir, model: nn.Module, how: str, checked) -> tuple:
    """(model, how) for the verified OpenVINO model ``ir``: a copy with the padding mask read from the input
    (:func:`padding_mask_only`) and same-shape reshapes after attention left out (:func:`identity_reshapes`),
    checked against the torch model by ``checked``; ``ir`` itself, ``how`` saying why, where a rewrite or its
    check fails (the verified conversion is kept, never lost to a rewrite)."""
    try:
        probed, dropped = padding_mask_only(simple := ir.clone(), model), identity_reshapes(simple)
        if probed is None and not dropped:
            return ir, how
        done = ([f"each attention op's mask read from attention_mask (B, 1, 1, Lk), the graph's own mask found "
                 f"equal to it at lengths {probed}"] if probed else []) + \
            ([f"{dropped} reshapes to the same shape after attention ops left out"] if dropped else [])
        return checked(simple, "the PyTorch model's OpenVINO conversion, simplified"), "; ".join([how, *done])
    except Exception as e:  # noqa: BLE001 - OpenVINO's and verify's failures share no base class
        return ir, f"{how}; left as converted (simplifying it failed: {type(e).__name__}: {str(e)[:200]})"


#: config fields that name a local attention window: a model with one keeps its traced mask (its window may pass
#: every length probed and still cut a longer input)
WINDOW_FIELDS = ("sliding_window", "local_attention", "attention_window", "window_size", "local_window_size")


def padding_mask_only(ir, model: nn.Module) -> tuple[int, ...] | None:
    """Each attention op (``ScaledDotProductAttention``) of the OpenVINO model ``ir`` given the key padding mask
    straight from the ``attention_mask`` input, (B, 1, 1, Lk) boolean, in place of the mask subgraph the conversion
    traced (transformers' mask functions: ~30 index, range and shape nodes that OpenVINO re-runs at every new input
    length). Done only where that subgraph, run at a short and at the longest length the model takes on padding at
    the right, at the left and in holes, with two draws of the tokens (every id below 3 and the pad id among them)
    and of the token types, gives every attention op the padding mask (a causal, sliding-window, length- or
    token-derived mask differs); a model with a window in its config (:data:`WINDOW_FIELDS`) or taking over 2048
    positions is left as converted. Returns the lengths checked, or None with ``ir`` left unchanged. The caller
    compares the rewritten model with the torch model (:func:`verify`)."""
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops

    cfg = model.config
    ops_ = [o for o in ir.get_ordered_ops() if o.get_type_name() == "ScaledDotProductAttention"]
    params = {p.get_friendly_name(): p for p in ir.get_parameters()}
    longest = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    if (not ops_ or "attention_mask" not in params or not 8 <= longest <= 2048
            or any(getattr(cfg, f, None) for f in WINDOW_FIELDS)
            or any(o.get_input_size() < 4 or o.get_attributes().get("causal") for o in ops_)):
        return None
    masks = [o.input(3).get_source_output() for o in ops_]
    if any(m.get_element_type() != ov.Type.boolean for m in masks):
        return None
    probe = ov.Core().compile_model(ov.Model(masks, ir.get_parameters()), "CPU")
    vocab, types = int(getattr(cfg, "vocab_size", 100) or 100), int(getattr(cfg, "type_vocab_size", 1) or 1)
    for L, draw in ((7, 0), (7, 1), (longest, 0), (longest, 1)):
        am = np.ones((4, L), np.int64)  # (B, L): rows whole, padded at the right, at the left, in holes
        am[1, max(1, L // 3):], am[2, :L - max(1, L // 3)], am[3, 1::3] = 0, 0, 0
        ids = np.random.default_rng(10 * L + draw).integers(0, min(vocab, 1000), (4, L))  # (B, L)
        ids[:, :3] = [0, 1, 2]
        ids[:, 3] = getattr(cfg, "pad_token_id", None) or 0
        feed = {n: am if n == "attention_mask" else ids if n == "input_ids" else
                np.full((4, L), draw % types, np.int64) for n in params}
        want = am.astype(bool)[:, None, None, :]  # (B, 1, 1, Lk)
        for got in probe(feed).values():  # (B, 1 or H, Lq, Lk)
            if got.ndim != 4 or not np.array_equal(*np.broadcast_arrays(got.astype(bool), want)):
                return None
    mask = ops.unsqueeze(ops.convert(params["attention_mask"], "boolean"), np.array([1, 2]))  # (B, 1, 1, Lk)
    for o in ops_:
        o.input(3).replace_source_output(mask.output(0))
    ir.validate_nodes_and_infer_types()
    return (7, longest)


def identity_reshapes(ir) -> int:
    """Each ``Reshape`` right after an attention op of the OpenVINO model ``ir`` that keeps every dimension (its
    target a constant with 0, "copy this one", in every dynamic place and the same size in every static one) left
    out: the conversion of transformers' attention leaves one per layer, and it keeps OpenVINO's CPU plugin from
    taking the transposes around the op into its fused attention kernel. Returns how many were left out."""
    n = 0
    for op in [o for o in ir.get_ordered_ops() if o.get_type_name() == "ScaledDotProductAttention"]:
        users = list(op.output(0).get_target_inputs())
        r = users[0].get_node() if len(users) == 1 else None
        if r is None or r.get_type_name() != "Reshape" or not r.get_attributes().get("special_zero"):
            continue
        target = r.input(1).get_source_output().get_node()
        shape = op.get_output_partial_shape(0)  # (B, H, Lq, Dv), B and Lq dynamic
        if target.get_type_name() != "Constant" or len(want := list(target.get_vector())) != shape.rank.get_length():
            continue
        if all(w == 0 or (d.is_static and w == d.get_length()) for w, d in zip(want, shape)):
            r.output(0).replace(op.output(0))
            n += 1
    if n:
        ir.validate_nodes_and_infer_types()
    return n


def openvino_int8(source: Path, out: Path, calibration: list[dict]) -> Path:
    """``source`` (an ONNX file or OpenVINO IR) quantized by NNCF's static post-training quantization
    (:func:`nncf_int8`), written as the IR ``out``: sentence-transformers' own recommendation for CPUs
    (``export_static_quantized_openvino_model``), the standard int8 file."""
    from multihead.extras import require

    ov = require("openvino", "OpenVINO int8 export")
    ov.save_model(nncf_int8(source, calibration), str(out), compress_to_fp16=False)
    return out


def nncf_int8(source: Path, calibration: list[dict]):
    """The OpenVINO model of ``source`` (an ONNX file or OpenVINO IR) quantized by NNCF's static post-training
    quantization (the transformer preset; activations' ranges calibrated on ``calibration``, batches {"input_ids",
    "attention_mask"[, "token_type_ids"]} (B, L) of text like the model's)."""
    from multihead.extras import quiet_logs, require

    ov = require("openvino", "OpenVINO int8 export")
    nncf = require("nncf", "OpenVINO int8 export")
    model = ov.Core().read_model(str(source))
    feeds = [{n: _as_input(b, n) for n in (i.get_any_name() for i in model.inputs)} for b in calibration]
    with quiet_logs("nncf"):
        return nncf.quantize(model, nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(feeds))


def _query_key_merged(q, batch: dict) -> tuple:
    """(model, how) for the NNCF-quantized OpenVINO model ``q``: a copy with each attention op's query and key
    products merged (:func:`merge_query_key`), kept where it gives ``q``'s outputs on ``batch`` (float32 rounding:
    the same int8 arithmetic); ``q`` itself, saying why, where the merge finds nothing, raises or differs."""
    import numpy as np
    import openvino as ov

    try:
        merged = q.clone()
        n = merge_query_key(merged)
        if not n:
            return q, "NNCF static int8 (no query and key products to merge)"
        f32 = {"INFERENCE_PRECISION_HINT": "f32"}
        feed = {i.get_any_name(): _as_input(batch, i.get_any_name()) for i in q.inputs}
        want, got = (ov.Core().compile_model(m, "CPU", f32)(feed)[0] for m in (q, merged))
        gap = float(np.abs(got - want).max())
        if not gap <= 1e-5 * max(1.0, float(np.abs(want).max())):
            raise RuntimeError(f"the merged model differs from NNCF's by {gap:.3g}")
        return merged, f"NNCF static int8; the query and key products of {n} attention ops merged into one each"
    except Exception as e:  # noqa: BLE001 - OpenVINO's failures share no base class
        return q, f"NNCF static int8 (merging query and key products failed: {type(e).__name__}: {str(e)[:200]})"


def merge_query_key(ir) -> int:
    """Each attention op (``ScaledDotProductAttention``) of the NNCF-quantized OpenVINO model ``ir`` whose query and
    key are int8 products of one input (:func:`_quantized_product`: int8 weights with a scale per output channel, a
    bias, the output quantized, then reshapes and transposes) given both from one product: the two weights stacked,
    both biases, one FakeQuantize with each half's own limits (the same arithmetic), split on the last axis after.
    OpenVINO's CPU plugin runs that as one int8 product and a split of int8 data; at one sentence a product's time
    is mostly fixed, so a product fewer per layer saves ~6% of a MiniLM call, at batch 16 and 64 the same time. The
    value product stays apart (its output is not quantized). Returns how many attention ops were merged."""
    n = 0
    for op in [o for o in ir.get_ordered_ops() if o.get_type_name() == "ScaledDotProductAttention"]:
        q, k = (_quantized_product(op.input(i).get_source_output()) for i in (0, 1))
        if (q is None or k is None or not _same(q["x"], k["x"]) or _same(q["fq"].output(0), k["fq"].output(0))
                or q["levels"] != k["levels"] or q["wt"] != k["wt"] or q["w"].shape[1] != k["w"].shape[1]):
            continue
        halves = _one_product(q, k)
        q["fq"].output(0).replace(halves.output(0))
        k["fq"].output(0).replace(halves.output(1))
        n += 1
    if n:
        ir.validate_nodes_and_infer_types()
    return n


def _one_product(q: dict, k: dict):
    """The int8 products ``q`` and ``k`` of one input (:func:`_quantized_product`) as one: the weights stacked, the
    biases and the quantizer's limits joined (each half its own), split after: the VariadicSplit node, outputs
    (B, L, Nq) and (B, L, Nk)."""
    import numpy as np
    from openvino import opset13 as ops

    nq, nk = q["w"].shape[0], k["w"].shape[0]
    lead = [1] * (q["x"].get_partial_shape().rank.get_length() - 1)  # x (B, L, E): biases and limits (1, 1, N)

    def joined(a, b):
        return ops.constant(np.concatenate([np.broadcast_to(a, (*lead, nq)), np.broadcast_to(b, (*lead, nk))],
                                           -1).astype(np.float32))  # (1, 1, Nq + Nk)

    scales = np.concatenate([np.broadcast_to(q["s"], (nq, 1)), np.broadcast_to(k["s"], (nk, 1))])  # (Nq + Nk, 1)
    w = ops.multiply(ops.convert(ops.constant(np.concatenate([q["w"], k["w"]]), q["wt"]), "f32"),
                     ops.constant(scales.astype(np.float32)))  # (Nq + Nk, E)
    y = ops.add(ops.matmul(q["x"], w, False, True), joined(q["b"].reshape(-1), k["b"].reshape(-1)))  # (B, L, N)
    y = ops.fake_quantize(y, *(joined(a, b) for a, b in zip(q["limits"], k["limits"])), q["levels"])
    return ops.variadic_split(y, np.int64(-1), np.array([nq, nk], np.int64))  # (B, L, Nq), (B, L, Nk)


def _same(a, b) -> bool:
    """Whether the OpenVINO outputs ``a`` and ``b`` are one node's same output."""
    return a.get_index() == b.get_index() and a.get_node().get_instance_id() == b.get_node().get_instance_id()


def _quantized_product(out) -> dict | None:
    """The int8 product NNCF made that feeds ``out`` through reshapes and transposes, FakeQuantize(Add(MatMul(x,
    Multiply(Convert(int8 Constant (N, E)), scale)), bias), limits): {"x", "w", "wt", "s", "b", "limits", "levels",
    "fq"}, or None where the graph is anything else (a zero point, a weight not transposed, a limit not constant, a
    scale other than per tensor or per output channel (N, 1), a bias or limit along another axis than the last)."""
    def const(o):
        return o.get_node().get_data() if o.get_node().get_type_name() == "Constant" else None

    while out.get_node().get_type_name() in ("Reshape", "Transpose"):
        out = out.get_node().input(0).get_source_output()
    fq = out.get_node()
    if fq.get_type_name() != "FakeQuantize" or fq.get_attributes()["auto_broadcast"] != "numpy":
        return None
    add, *limits = (i.get_source_output() for i in fq.inputs())
    limits = [const(x) for x in limits]
    if add.get_node().get_type_name() != "Add" or any(x is None for x in limits):
        return None
    mm, b = sorted((i.get_source_output() for i in add.get_node().inputs()), key=lambda o: const(o) is not None)
    if const(b) is None or mm.get_node().get_type_name() != "MatMul":
        return None
    x, w = (i.get_source_output() for i in mm.get_node().inputs())
    flags = mm.get_node().get_attributes()
    if flags["transpose_a"] or not flags["transpose_b"] or w.get_node().get_type_name() != "Multiply":
        return None
    conv, s = sorted((i.get_source_output() for i in w.get_node().inputs()), key=lambda o: const(o) is not None)
    if const(s) is None or conv.get_node().get_type_name() != "Convert":
        return None
    c = conv.get_node().input(0).get_source_output()
    wt = c.get_element_type()
    if const(c) is None or wt.get_type_name() not in ("i8", "u8") or const(c).ndim != 2:
        return None
    n, rank = const(c).shape[0], x.get_partial_shape().rank.get_length()

    def last(a):  # per tensor, or per output channel on the product's last axis, not raising its rank
        return a.ndim <= rank and (a.size == 1 or a.shape[-1] == a.size == n)

    scale = const(s)  # per tensor, or per output channel: (N, 1), scaling the weight's rows
    if not (scale.ndim <= 2 and (scale.size == 1 or scale.shape == (n, 1))) or not last(const(b)) \
            or not all(map(last, limits)):
        return None
    return {"x": x, "w": const(c), "wt": wt, "s": scale.reshape(-1, 1), "b": const(b), "limits": limits,
            "levels": fq.get_attributes()["levels"], "fq": fq}


def _as_input(batch: dict, name: str):
    """One graph input of a batch as numpy int64 (B, L); token types default to zeros."""
    t = batch.get(name)
    if t is None and name == "token_type_ids":
        t = torch.zeros_like(batch["input_ids"])
    if t is None:
        raise ValueError(f"export: a calibration batch has no {name!r}; each batch needs {name} (B, L).")
    return torch.as_tensor(t).long().numpy()


# --- the peers' OpenVINO files: the unpruned model converted the way OpenVINO's documentation does it ---

#: the peers' OpenVINO files' labels: (key, how OpenVINO's documentation makes it)
OPENVINO_STANDARD = {"openvino": "openvino.convert_model of the ONNX file",
                     "openvino_int8": "openvino.convert_model of the ONNX file + NNCF",
                     "openvino_pt": "openvino.convert_model of the PyTorch model",
                     "openvino_pt_int8": "openvino.convert_model of the PyTorch model + NNCF"}


def openvino_fp32(f: Path) -> RuntimeModel:
    """The ONNX file ``f`` in :func:`openvino_model`."""
    return openvino_model(f)


def openvino_int8_model(f: Path, calibration: list[dict]) -> RuntimeModel:
    """The ONNX file ``f`` quantized by NNCF's static int8 (:func:`openvino_int8`, calibrated on
    ``calibration``: text the timing never uses), compiled by :func:`openvino_model`."""
    return openvino_model(openvino_int8(f, scratch() / "int8.xml", calibration))


def _openvino_standard(model, f: Path, xs: tuple, names: list[str], d: Path, *, calibration=None,
                       log=None) -> dict[str, Path]:
    """OpenVINO's files of the unpruned ``model`` in ``d``: ``convert_model`` of the ONNX file ``f`` and of the PyTorch
    model (:func:`_openvino_pt`), each with NNCF's static int8 where ``calibration`` is given; {} without the openvino
    extra (told to ``log``)."""
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

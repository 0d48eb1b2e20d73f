"""ONNX, for ONNX Runtime: a (pruned) transformers model written as one ONNX file (:func:`export_onnx`), ONNX
Runtime's transformer optimizer on it (:func:`optimize`, from the eager-attention graph with each layer's head count
written: :func:`eager_onnx`, :func:`write_head_counts`) and its int8 quantization (:func:`quantize_standard`); the
files :func:`multihead.deploy.folder.export` writes under ``DIR/onnx/``.

The graph is the model's own transformers graph with transformers' SDPA attention -- the graph ``torch.onnx.export``
gives for the unpruned model, the one users export and ONNX Runtime's optimizer knows -- at the pruned size: each
attention module's projections hold its kept heads only (checked on the written graph); a family without SDPA is
exported through multihead's attention function. A model whose heads are cut by gates or stored as zeros is
refused, naming the module. Every file is run once on padded batches and compared with the torch model before it
is kept (:mod:`multihead.deploy.check`).

The peers' ONNX files are made here too: the unpruned model exported as ONNX Runtime's documentation does it
(:func:`_onnx_standard`, labelled in :data:`ONNX_STANDARD`; :func:`multihead.deploy.peers.standard_files` lists every
runtime's), a model exported once per process (:func:`export`) and quantized as users quantize it (:func:`ort_int8`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from multihead.deploy.check import _refuse_full_size
from multihead.deploy.session import RuntimeModel, ort_session, scratch
from multihead.deploy.trace import (
    _attention,
    _export_example,
    _Hidden,
    _padded_eval,
    _TokensToHidden,
    input_names,
    standard_attention,
)
from multihead.hf.attention import PreTrainedModel, attention_modules
from multihead.hf.layouts import probe_inputs

ONNX_DIR, ONNX_FILE, ONNX_INT8_FILE = "onnx", "model.onnx", "model_int8.onnx"
ONNX_OPT_FILE, ONNX_OPT_INT8_FILE, EXPORT_JSON = "model_optimized.onnx", "model_optimized_int8.onnx", "export.json"
ONNX_EAGER_FILE, ONNX_EAGER_INT8_FILE = "model_eager.onnx", "model_eager_int8.onnx"
#: ONNX Runtime's fused attention without its GELU fusion (:func:`_attention_form`)
ONNX_ATTENTION_FILE, ONNX_ATTENTION_INT8_FILE = "model_attention.onnx", "model_attention_int8.onnx"
#: the files to serve: the fastest of the fp32 and of the int8 forms on the machine that wrote them (deploy/serve.py)
ONNX_SERVE_FILE, ONNX_SERVE_INT8_FILE = "serve.onnx", "serve_int8.onnx"


#: transformers' model types ONNX Runtime's transformer optimizer has a pass for (``optimizer.MODEL_TYPES``'s names)
ORT_MODEL_TYPES = {"bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "distilbert": "bert", "electra": "bert",
                   "mpnet": "bert", "camembert": "bert", "deberta-v2": "bert", "gpt2": "gpt2"}


def export_onnx(model: nn.Module, path: str | Path, *, example: dict | None = None, standard: bool = True) -> Path:
    """Write ``model`` (pruned or not) as an ONNX file taking ``input_ids`` and ``attention_mask`` (and
    ``token_type_ids`` where the model has token types: :func:`input_names`), each (B, L), both sizes dynamic
    (L up to the config's ``max_position_embeddings``), and giving its first output, named ``last_hidden_state``
    (or ``logits``). Uses ``torch.onnx.export`` (the ``onnx`` extra) on the model's transformers graph with SDPA
    attention (:func:`standard_attention`; ``standard=False``: through multihead's attention function). A pruned
    model is written at its pruned size; a padding-free model is exported padded (the same outputs on real tokens;
    ONNX gets one static graph).
    Refused with a clear error: a quantized model (export the float one and quantize in ONNX Runtime), heads cut
    by gates or stored as zeros (:func:`_refuse_full_size`), a model whose forward takes no ``attention_mask``, a
    decoder whose call would make a cache, and masks other than a (B, L) 0/1 padding mask in ``example``."""
    _export_onnx(model, Path(path), example, standard)
    return Path(path)


def _export_onnx(model: nn.Module, path: Path, example: dict | None, standard: bool) -> str:
    """:func:`export_onnx`'s work; returns the attention implementation the graph holds ("sdpa", or multihead's
    name where ``standard`` is False or transformers' SDPA graph cannot be exported)."""
    from multihead.extras import quiet_logs, require
    from multihead.quantize import is_quantized

    require("onnxscript", "multihead.hf.export_onnx")
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"export_onnx takes a transformers PreTrainedModel; got {type(model).__name__}.")
    if is_quantized(model):
        raise ValueError("export_onnx: the model is quantized (PyTorch's dynamic int8 kernels have no ONNX form); "
                         "export the float model and quantize the ONNX file with onnxruntime.quantization.")
    if "attention_mask" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"export_onnx: {type(model).__name__}.forward takes no attention_mask; the exported graph's "
                         "inputs are input_ids and attention_mask (B, L).")
    names = input_names(model)
    xs = _export_example(example if example is not None else probe_inputs(model), names)
    if getattr(model.config, "use_cache", False) and any(getattr(m, "is_causal", False)
                                                        for m in attention_modules(model).values()):
        raise ValueError("export_onnx: a decoder would make a key/value cache; set model.config.use_cache = False "
                         "to export the one-pass graph.")
    _refuse_full_size(model)
    with _padded_eval(model):
        L_max = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
        B, L = torch.export.Dim("B"), torch.export.Dim("L", max=L_max)
        with torch.no_grad():
            out_name = next(iter(model(**dict(zip(names, xs))).keys()))  # last_hidden_state, logits, ...

        def write() -> None:
            with warnings.catch_warnings(), quiet_logs("torch.onnx"):  # the exporter's notices, not the user's
                warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
                warnings.filterwarnings("ignore", message=r"# The axis name: \w+ will not be used")  # B, L shared
                torch.onnx.export(_TokensToHidden(model, "token_type_ids" in names).eval(), xs, str(path), dynamo=True,
                                  input_names=names, output_names=[out_name],
                                  dynamic_shapes={n: {0: B, 1: L} for n in names}, verbose=False)

        own = model.config._attn_implementation
        if standard:
            try:
                with standard_attention(model) as used:
                    write()
                return used
            except Exception as e:  # noqa: BLE001 - transformers' SDPA graph cannot be exported here (a layer with no
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"  # head left: its -1
                warnings.warn(f"export_onnx: transformers' SDPA graph could not be exported ({why}); exporting "
                              "multihead's attention function's graph instead", RuntimeWarning, stacklevel=3)
        write()
        return own


def _written_and_checked(model: nn.Module, f: Path, example: dict | None, check) -> tuple[str, str | None]:
    """``f`` written with transformers' SDPA graph and checked (``check(path)``); where that graph cannot be exported or
    fails its check (a layer with no head left: a -1 reshape of zero elements), multihead's attention function's
    graph, itself checked. (the attention the file holds, why the standard graph was not kept or None)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", RuntimeWarning)
        attention = _export_onnx(model, f, example, standard=True)
    fallback = next((str(w.message) for w in said if "SDPA graph" in str(w.message)), None)
    try:
        check(f)
    except Exception as e:  # noqa: BLE001 - ONNX Runtime's and verify's failures share no base class
        if attention == model.config._attn_implementation:  # multihead's graph already: nothing to fall back to
            raise
        fallback = f"transformers' SDPA graph failed its check ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        attention = _export_onnx(model, f, example, standard=False)
        check(f)
    return attention, fallback


def _eager(model: nn.Module, f: Path, example: dict | None, check) -> tuple[dict[str, Path], str | None]:
    """The eager-attention graph beside the fp32 file ``f`` (:func:`eager_onnx`, each layer's head count written:
    :func:`write_head_counts`), checked (``check(path)``) and quantized like the plain one: ({"onnx_eager",
    "onnx_eager_int8": path}, None), or ({}, why) where it cannot be written or fails its check (it is optional: the
    SDPA graph ``f`` stays). The graph users get from ``torch.onnx.export`` of a model loaded with
    ``attn_implementation="eager"``, at the pruned size; the form ONNX Runtime's optimizer fuses (:func:`_optimized`)."""
    eager = f.with_name(ONNX_EAGER_FILE)
    try:
        with _padded_eval(model):
            names = input_names(model)
            import onnx

            eager_onnx(_TokensToHidden(model, "token_type_ids" in names), model,
                       _export_example(example if example is not None else probe_inputs(model), names), names,
                       eager, output=onnx.load(str(f), load_external_data=False).graph.output[0].name)
        write_head_counts(eager)
        check(eager)
        return {"onnx_eager": eager, "onnx_eager_int8": quantize_standard(eager, f.with_name(ONNX_EAGER_INT8_FILE),
                                                                          matmul_only=True)}, None
    except Exception as e:  # noqa: BLE001 - the exporters' and the check's failures share no base class
        for name in (eager, f.with_name(ONNX_EAGER_INT8_FILE)):
            name.unlink(missing_ok=True)
        return {}, f"the eager graph could not be written ({type(e).__name__}: {str(e).splitlines()[0][:200]})"


def _optimizer_pair(make: Callable[[], dict], out: Path, out_int8: Path, keys: tuple[str, str], check,
                    failed: str = "") -> tuple[dict[str, Path], dict]:
    """``make()`` writes ``out`` through ONNX Runtime's optimizer and returns its record; where it wrote the file,
    ``out`` is checked (``check(path)``) and quantized like the plain one into ``out_int8``: ({keys[0]: out, keys[1]:
    out_int8} or {}, the record). The optimizer is optional: its failure removes both files and is said in the
    record's note (``failed`` appended)."""
    try:
        fused = make()
        if not fused.get("written"):
            out.unlink(missing_ok=True)
            return {}, fused | {"written": False}
        check(out)
        quantize_standard(out, out_int8, matmul_only=True)
        return dict(zip(keys, (out, out_int8))), fused
    except Exception as e:  # noqa: BLE001 - the optimizer's failures share no base class
        for name in (out, out_int8):
            name.unlink(missing_ok=True)
        return {}, {"written": False, "fused": {}, "note": f"ONNX Runtime's optimizer failed on this graph "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}){failed}"}


def _optimized(model: nn.Module, f: Path, eager: Path | None, check) -> tuple[dict[str, Path], dict]:
    """The optimized files beside the fp32 file ``f``, checked (``check(path)``) and quantized like the plain one:
    ({"onnx_optimized", "onnx_optimized_int8": path} or {}, what the optimizer fused). First the eager-attention
    graph ``eager`` (:func:`_eager`: each layer's head count written), the form ONNX Runtime's optimizer fuses into one
    ``Attention`` op per layer; where it fuses no attention there (or there is no such graph), ``f`` itself through
    the optimizer. The optimizer is optional: its failure leaves the plain files and is said in the record."""
    out, out_int8 = f.with_name(ONNX_OPT_FILE), f.with_name(ONNX_OPT_INT8_FILE)
    return _optimizer_pair(lambda: _eager_fused(model, f, eager, out), out, out_int8,
                           ("onnx_optimized", "onnx_optimized_int8"), check, "; the plain files are written")


def _attention_form(model: nn.Module, eager: Path | None, check) -> tuple[dict[str, Path], dict]:
    """The eager graph ``eager`` through ONNX Runtime's optimizer with every fusion but GELU's (:func:`optimize`,
    ``fuse_gelu=False``: each layer's attention one ``Attention`` op, its layer norms and the embeddings fused, the GELU
    left as exported), checked (``check(path)``) and quantized like the plain one: ({"onnx_attention",
    "onnx_attention_int8": path} or {}, what the optimizer fused and what it could not). On all-MiniLM-L6-v2 pruned 31%,
    int8, on an Intel Xeon (avx512_vnni, 2 threads; ``bench/results/issue80_minilm_xeon/serve_forms_run*.md``), the
    fused GELU made the fused-attention file 6-9% slower at batch 16 and 64; without it that file is the fastest form
    at batch 1. Written only where attention is fused (else it would repeat the eager graph); optional like the other
    optimized file."""
    if eager is None or ORT_MODEL_TYPES.get(getattr(model.config, "model_type", "")) is None:
        return {}, {"written": False, "fused": {}, "note": "no eager graph, or no optimizer pass for the model type"}
    out, out_int8 = eager.with_name(ONNX_ATTENTION_FILE), eager.with_name(ONNX_ATTENTION_INT8_FILE)

    def make() -> dict:
        fused = optimize(model, eager, out, fuse_gelu=False)
        attention = sum(v for k, v in fused["fused"].items() if "Attention" in k)
        return fused if fused["written"] and attention else fused | {"written": False}

    return _optimizer_pair(make, out, out_int8, ("onnx_attention", "onnx_attention_int8"), check)


def _eager_fused(model: nn.Module, f: Path, eager: Path | None, out: Path) -> dict:
    """``out``: the eager graph ``eager`` (its head counts written) through :func:`optimize` where that fuses attention,
    else the file ``f`` through it; :func:`optimize`'s record with "graph" (which of the two) added."""
    why = None if eager is not None else "no eager graph was written"
    if eager is not None and ORT_MODEL_TYPES.get(getattr(model.config, "model_type", "")) is not None:
        fused = optimize(model, eager, out)
        if fused["written"] and sum(v for k, v in fused["fused"].items() if "Attention" in k):
            return fused | {"graph": f"eager attention (TorchScript exporter, {eager.name}), head counts written"}
        why = fused["note"]
    fused = optimize(model, f, out)
    return fused | {"graph": f"{f.name}'s" + (f" (the eager one: {why})" if why else "")}


def eager_onnx(wrapper: nn.Module, model: nn.Module, xs: tuple[Tensor, ...], names: list[str], path: Path, *,
               output: str = "last_hidden_state") -> Path:
    """``wrapper`` (a module calling ``model`` on ``xs``, the graph's inputs ``names``, each (B, L); its output named
    ``output``) written as ONNX
    with ``model``'s attention switched to transformers' eager function (MatMul, scale, Add of the mask, Softmax,
    MatMul: the pattern ONNX Runtime's attention fusion matches) by ``torch.onnx.export``'s TorchScript exporter
    (``dynamo=False``, opset 17; B and L dynamic), the way optimum-style exports write transformers encoders."""
    from multihead.extras import quiet_logs

    with _attention(model, "eager") as used:
        if used != "eager":
            raise RuntimeError(f"transformers kept {used!r} attention; the eager graph needs 'eager'")
        with warnings.catch_warnings(), quiet_logs("torch.onnx"):
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notices
            torch.onnx.export(wrapper.eval(), xs, str(path), dynamo=False, opset_version=17, input_names=names,
                              output_names=[output], dynamic_axes={n: {0: "B", 1: "L"} for n in names})
    import onnx

    g = onnx.load(str(path))  # constants the exporter left unread: ONNX Runtime warns of each on every load
    used = {i for n in g.graph.node for i in n.input}
    for t in [t for t in g.graph.initializer if t.name not in used]:
        g.graph.initializer.remove(t)
    onnx.save(g, str(path))
    return path


def write_head_counts(path: Path) -> int:
    """Rewrite the ONNX file ``path`` so that each reshape splitting a projection into heads, (B, L, E') -> (B, L, -1, D)
    (transformers' modules reshape with -1 heads), names its layer's head count for -1: the projection's width over D,
    read from its weight. ONNX Runtime's attention fusion reads each layer's heads there (``num_heads=0``); a pruned
    model's layers differ. The same computation (a -1 stands for exactly that count). Returns how many were written."""
    import numpy as np
    import onnx
    from onnx import numpy_helper
    from onnxruntime.transformers.onnx_model import OnnxModel

    g = OnnxModel(onnx.load(str(path)))
    written = 0
    for node in g.get_nodes_by_op_type("Reshape"):
        concat = g.get_parent(node, 1)  # Concat(B, L, -1, D)
        if concat is None or concat.op_type != "Concat" or len(concat.input) != 4:
            continue
        h, d = g.get_constant_value(concat.input[2]), g.get_constant_value(concat.input[3])
        if h is None or d is None or np.size(h) != 1 or np.size(d) != 1 or int(np.ravel(h)[0]) != -1:
            continue
        proj = g.match_parent_path(node, ["Add", "MatMul"], [0, None])  # x @ W + b
        w = g.get_initializer(proj[1].input[1]) if proj is not None else None
        if w is None or len(w.dims) != 2 or w.dims[1] % int(np.ravel(d)[0]):
            continue
        heads = numpy_helper.from_array(np.array([w.dims[1] // int(np.ravel(d)[0])], dtype=np.int64),
                                        f"{node.name}/heads")
        g.add_initializer(heads)
        concat.input[2] = heads.name
        written += 1
    if written:  # the -1s no node reads now: ONNX Runtime would warn of each on every load
        g.prune_graph()
    g.save_model_to_file(str(path))
    return written


def quantize_standard(source: Path, out: Path, *, matmul_only: bool = False) -> Path:
    """``source`` quantized the way ONNX Runtime's documentation does it for transformers on a CPU:
    ``quantize_dynamic`` with int8 weights, one scale per output channel, its default operators (the embeddings'
    gathers included); ``matmul_only``: the matrix products alone (MatMul, and the projections of an ``Attention`` op
    ONNX Runtime's optimizer fused), as torch's own int8 model quantizes its Linear layers (what :func:`export`
    writes: within torch's int8 rounding of the model; the embeddings cost no time)."""
    from multihead.extras import quiet_logs, require

    require("onnxruntime", "int8 quantization")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    ops = {"op_types_to_quantize": ["MatMul", "Attention"]} if matmul_only else {}
    with quiet_logs(""):  # onnxruntime's "consider pre-processing" advice goes to the root logger
        quantize_dynamic(str(source), str(out), weight_type=QuantType.QInt8, per_channel=True,
                         extra_options={"DefaultTensorType": 1}, **ops)  # FLOAT where shape inference stops at a fused op
    return out


def optimize(model: nn.Module, source: Path, out: Path, *, heads_from_config: bool = False,
             fuse_gelu: bool = True) -> dict:
    """``source`` through ONNX Runtime's transformer optimizer (``onnxruntime.transformers.optimizer``, the model type
    from the config: :data:`ORT_MODEL_TYPES`), written to ``out`` when the optimizer knows the type: {"model_type",
    "fused": {op: count}, "written": bool, "note": what it could not fuse (None when attention was fused too)}. The
    attention fusion reads each layer's head count from the graph's reshapes (``num_heads=0``; a -1 there fuses
    nothing: :func:`write_head_counts`); ``heads_from_config``: the config's ``num_attention_heads`` and
    ``hidden_size`` stand for a -1, as optimum passes them (right for an unpruned model only); ``fuse_gelu``: False
    leaves the GELU as exported (the optimizer's GELU fusions, with and without the bias, off: ``FusionOptions``)."""
    from multihead.extras import quiet_logs

    cfg = model.config
    kind = ORT_MODEL_TYPES.get(getattr(cfg, "model_type", ""))
    if kind is None:
        return {"model_type": getattr(cfg, "model_type", None), "fused": {}, "written": False,
                "note": f"ONNX Runtime's transformer optimizer has no pass for model type {cfg.model_type!r}"}
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions(kind)
    options.enable_gelu = options.enable_bias_gelu = fuse_gelu
    with quiet_logs("onnxruntime"), quiet_logs(""):
        heads = (int(cfg.num_attention_heads), int(cfg.hidden_size)) if heads_from_config else (0, 0)
        opt = optimizer.optimize_model(str(source), model_type=kind, num_heads=heads[0], hidden_size=heads[1],
                                       optimization_options=options)
        fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        graph = opt.model.graph  # constants the fused ops no longer read: ONNX Runtime warns of each on every load
        used = {i for n in graph.node for i in n.input}
        for t in [t for t in graph.initializer if t.name not in used]:
            graph.initializer.remove(t)
        opt.save_model_to_file(str(out))
    attention = sum(v for k, v in fused.items() if "Attention" in k)
    note = None if attention else (
        "ONNX Runtime's optimizer fused no attention in this graph (transformers' SDPA masks are not the pattern it "
        f"matches): it fused {', '.join(f'{k} x{v}' for k, v in fused.items()) or 'nothing'}")
    return {"model_type": kind, "fused": fused, "written": True, "note": note}


# --- the peers' ONNX files: the unpruned model exported the way ONNX Runtime's documentation does it ---

#: the peers' ONNX files' labels: (key, how ONNX Runtime's documentation makes it)
ONNX_STANDARD = {"onnx": "torch.onnx.export", "onnx_int8": "torch.onnx.export + quantize_dynamic",
                 "onnx_optimized": "torch.onnx.export + ORT optimizer",
                 "onnx_optimized_int8": "torch.onnx.export + ORT optimizer + quantize_dynamic",
                 "onnx_eager": "eager attention, torch.onnx.export (TorchScript)",
                 "onnx_eager_int8": "eager attention, torch.onnx.export (TorchScript) + quantize_dynamic",
                 "onnx_eager_optimized": "eager attention, torch.onnx.export (TorchScript) + ORT optimizer",
                 "onnx_eager_optimized_int8": "eager attention, torch.onnx.export (TorchScript) + ORT optimizer + "
                                              "quantize_dynamic"}


def _onnx_standard(model: nn.Module, xs: tuple, names: list[str], d: Path, log=None) -> dict[str, Path]:
    """ONNX Runtime's files of the unpruned ``model`` in ``d`` (keys as :data:`ONNX_STANDARD`; the peer's part of
    :func:`multihead.deploy.peers.standard_files`): ``torch.onnx.export`` of the model (its defaults, both sizes
    dynamic, traced on ``xs`` named ``names``), ONNX Runtime's ``quantize_dynamic`` (int8 weights, per channel), ONNX
    Runtime's transformer optimizer (where it has a pass for the model type) and the optimized file quantized the same
    way; then the same from the eager graph (:func:`_eager_files`)."""
    from multihead.extras import quiet_logs

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
    return out | _eager_files(model, xs, names, d, log)


def _eager_files(model, xs: tuple, names: list[str], d: Path, log=None) -> dict[str, Path]:
    """{"onnx_eager", "onnx_eager_int8"[, "onnx_eager_optimized", "onnx_eager_optimized_int8"]: path} in ``d``:
    ``model`` with transformers' eager attention through the TorchScript exporter
    (:func:`multihead.deploy.onnx.eager_onnx`, inputs ``xs`` named ``names``) -- the plain export of the model loaded
    with ``attn_implementation="eager"`` -- and ``quantize_dynamic`` per channel; then, where ONNX Runtime's optimizer
    has a pass for the model type, that graph through it given the config's head count and hidden size (as optimum
    gives them), quantized the same way; {} where the export fails (told to ``log``)."""
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


def export(model, example: dict) -> Path:
    """``model`` written as ONNX (:func:`export_onnx`, traced on ``example``'s input_ids and
    attention_mask) into a new folder of :func:`scratch`: the file every runtime here starts from. A model with the
    same class, config and weights (by content) is exported once per process: the exporter takes seconds
    even for a tiny model, and ``prune --hf`` exports the same checkpoint at every run."""
    key = _fingerprint(model)
    if key is None or key not in _EXPORTS or not _EXPORTS[key].is_file():
        d = scratch()
        f = export_onnx(model, d / "fp32.onnx", example={k: example[k] for k in ("input_ids", "attention_mask")})
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
    return ort_session(quantize_standard(f, f.with_name("int8.onnx"), matmul_only=True))

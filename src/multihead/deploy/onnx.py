"""A (pruned) transformers model where prediction happens: ONNX for ONNX Runtime and fastembed, OpenVINO IR.

:func:`export_onnx` writes one ONNX file; :func:`export` writes a model directory's runtime folders, the
layout sentence-transformers and fastembed read::

    DIR/onnx/model.onnx                 fp32, inputs input_ids, attention_mask (and token_type_ids where the
                                        model has token types), output last_hidden_state (or logits)
    DIR/onnx/model_int8.onnx            int8 weights of the matrix products, one scale per output channel (onnxruntime's
                                        quantize_dynamic), activations quantized per call
    DIR/openvino/openvino_model.xml     OpenVINO IR, fp32 (the openvino extra): the model through OpenVINO's PyTorch
                                        frontend, as optimum-intel converts (else model.onnx through its ONNX one),
                                        each attention op's mask read from attention_mask where the traced mask is
                                        the padding mask alone (checked), no same-shape reshape after it
    DIR/openvino/openvino_model_int8.xml  NNCF static int8, calibrated on the batches given (the openvino extra),
                                        each attention op's query and key from one int8 product where NNCF's
                                        graph allows it (the outputs checked equal; else NNCF's model as is)

    DIR/onnx/model_optimized.onnx       ONNX Runtime's transformer optimizer's file (its fusions: each layer's
    DIR/onnx/model_optimized_int8.onnx  attention into one Attention op, layer norms with the residual add, GELU with
                                        its bias, ...; ONNX Runtime only), and quantized the same way: written where
                                        the optimizer knows the model's type, from the eager-attention graph with each
                                        layer's head count written (the form it fuses attention in), else model.onnx
    DIR/onnx/export.json                the attention model.onnx holds ("sdpa" or "multihead"), the graph the
                                        optimizer was given, what it fused (op: count) and what it could not, how
                                        the OpenVINO files were made

The graph is the model's own transformers graph with transformers' SDPA attention -- the graph ``torch.onnx.export``
gives for the unpruned model, the one users export and ONNX Runtime's optimizer knows -- at the pruned size: each
attention module's projections hold its kept heads only (checked on the written graph); a family without SDPA is
exported through multihead's attention function. A model whose heads are cut by gates or stored as zeros is
refused, naming the module. Every file is run once on padded batches and compared with the torch model before it
is kept.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from multihead.hf.attention import PreTrainedModel, attention_modules
from multihead.hf.layouts import probe_inputs

ONNX_DIR, ONNX_FILE, ONNX_INT8_FILE = "onnx", "model.onnx", "model_int8.onnx"
ONNX_OPT_FILE, ONNX_OPT_INT8_FILE, EXPORT_JSON = "model_optimized.onnx", "model_optimized_int8.onnx", "export.json"
#: transformers' model types ONNX Runtime's transformer optimizer has a pass for (``optimizer.MODEL_TYPES``'s names)
ORT_MODEL_TYPES = {"bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "distilbert": "bert", "electra": "bert",
                   "mpnet": "bert", "camembert": "bert", "deberta-v2": "bert", "gpt2": "gpt2"}
OPENVINO_DIR, OPENVINO_FILE, OPENVINO_INT8_FILE = "openvino", "openvino_model.xml", "openvino_model_int8.xml"


class _TokensToHidden(nn.Module):
    """(input_ids (B, L), attention_mask (B, L)[, token_type_ids (B, L)]) -> the model's first output (last hidden
    state or logits)."""

    def __init__(self, model: nn.Module, token_types: bool):
        super().__init__()
        self.model, self.token_types = model, token_types

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        kw = {"token_type_ids": token_type_ids} if self.token_types else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kw)
        return out[0]  # (B, L, E) or (B, L, vocab)


def input_names(model: nn.Module) -> list[str]:
    """The exported graph's inputs: ``input_ids`` and ``attention_mask``, and ``token_type_ids`` where the model
    has more than one token type (BERT's tokenizer gives them; RoBERTa's, with one type, does not)."""
    names = ["input_ids", "attention_mask"]
    if ("token_type_ids" in inspect.signature(model.forward).parameters
            and (getattr(model.config, "type_vocab_size", 0) or 0) > 1):
        names.append("token_type_ids")
    return names


def _export_example(x: dict, names: list[str]) -> tuple[Tensor, ...]:
    """The graph's inputs (each (B, L), B, L >= 2: a size of 1 would be specialised as a constant) from an
    example's inputs, checked."""
    ids = x.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError("export_onnx: example must hold input_ids (B, L).")
    am = x.get("attention_mask", torch.ones_like(ids))
    if not isinstance(am, Tensor) or am.shape != ids.shape or not bool(((am == 0) | (am == 1)).all()):
        got = tuple(am.shape) if isinstance(am, Tensor) else type(am).__name__
        raise ValueError(f"export_onnx: attention_mask must be a (B, L) padding mask of 0 and 1 like input_ids "
                         f"{tuple(ids.shape)}; got {got}. Other mask forms (4-D, float biases) are not exported.")
    xs = [ids, am] + ([x.get("token_type_ids", torch.zeros_like(ids))] if "token_type_ids" in names else [])
    if ids.shape[1] < 2:
        xs = [t.repeat(1, 2) for t in xs]  # (B, 1) -> (B, 2)
    if ids.shape[0] < 2:
        xs = [t.repeat(2, 1) for t in xs]  # (1, L) -> (2, L)
    return tuple(xs)


def _refuse_full_size(model: nn.Module) -> None:
    """ValueError naming the first attention module whose heads are cut by something the weights do not hold (gates
    or other hooks that change its heads), or whose heads are stored as zeros (a pruned model read at full size):
    either would be written as the full-size model with zeros."""
    from multihead.heads.surgery import out_in

    for name, m in attention_modules(model).items():
        hooks = m.attention_hooks
        if hooks.transforms:
            raise ValueError(f"export: {name} ({type(m).__name__}) has hooks that change its heads (heads.gated or a "
                             "transform): the file would compute the full-size model with them; cut the heads with "
                             "heads.prune (or leave the hooks' context) before exporting.")
        layout = hooks.layout
        if layout is None:
            continue
        o = layout.projections(m, hooks.parent)[3]
        H, D = out_in(o).shape[1] // layout.head_dim(m), layout.head_dim(m)
        if H < 2:  # no head, or the one a family that cannot run without heads keeps (zero columns, by design)
            continue
        cols = out_in(o).detach().reshape(-1, H, D)  # (E, H, D): head h's output columns
        zero = [h for h in range(H) if not bool(cols[:, h].any())]
        if zero:
            raise ValueError(f"export: {name} ({type(m).__name__}) holds heads {zero} of {H} whose output weights are "
                             "all zero (a pruned model read at full size, as AutoModel.from_pretrained reads a prune "
                             "--hf folder): load it with multihead.hf.load(DIR), which cuts them, to export it at its "
                             "pruned size.")


@contextlib.contextmanager
def standard_attention(model: nn.Module):
    """Inside: ``model`` computes attention with transformers' own SDPA function (the graph users export, at whatever
    size each module now has: transformers' modules reshape with -1 heads) where its class supports SDPA; multihead's
    function otherwise. Yields the implementation used; the model's own is restored after."""
    with _attention(model, "sdpa" if getattr(model, "_supports_sdpa", False) else None) as used:
        yield used


@contextlib.contextmanager
def _attention(model: nn.Module, use: str | None):
    """Inside: ``model`` computes attention with transformers' implementation ``use`` (None: its own); yields the one in
    effect (transformers may decline and keep the old one); the model's own is restored after."""
    previous = model.config._attn_implementation
    if use is None or use == previous:
        yield previous
        return
    try:
        model.set_attn_implementation(use)
        yield model.config._attn_implementation
    finally:
        model.set_attn_implementation(previous)


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


@contextlib.contextmanager
def _padded_eval(model: nn.Module):
    """Inside: ``model`` in eval mode and padded (a padding-free model's packing off: ONNX gets the padded graph, no
    data-dependent shapes); both restored after."""
    from multihead.hf import packed as hf_packed

    packing = model.__dict__.get(hf_packed.KEY)
    was, model_training = (packing.enabled if packing is not None else None), model.training
    if packing is not None:
        packing.enabled = False
    model.eval()
    try:
        yield model
    finally:
        if packing is not None:
            packing.enabled = was
        model.train(model_training)


def export(model: nn.Module, folder: str | Path, *, calibration: list[dict] | None = None,
           example: dict | None = None, openvino: bool | None = None) -> dict[str, Path]:
    """Write ``model`` (pruned or not) into ``folder``'s runtime folders (see the module's docstring): ONNX fp32
    and int8 always (the ``onnx`` extra), OpenVINO IR fp32 where ``openvino`` is installed and int8 where ``nncf``
    is too and ``calibration`` is given (a list of batches {"input_ids", "attention_mask"[, "token_type_ids"]}
    (B, L) of text like the model's: static quantization needs the activations' ranges). Each fp32 file is run
    on two padded batches and must equal the torch model on the real tokens (float rounding), else it is
    deleted and RuntimeError says by how much. Returns a dict of paths: ``"onnx"`` and ``"onnx_int8"`` always,
    ``"onnx_optimized"`` and ``"onnx_optimized_int8"`` where ONNX Runtime's optimizer applies, ``"openvino"`` and
    ``"openvino_int8"`` where those are written. A plain ``onnxruntime.InferenceSession(path)``
    runs a file on the tokenizer's outputs. ``openvino``:
    None writes the OpenVINO files where the extra is installed, True requires them (ImportError naming the extra),
    False leaves them out."""
    from multihead.extras import require

    ort = require("onnxruntime", "multihead.hf.export")
    folder = Path(folder)
    (folder / ONNX_DIR).mkdir(parents=True, exist_ok=True)
    names = input_names(model)
    so = ort.SessionOptions()  # the check runs beside torch: as many threads as torch, none left spinning
    so.intra_op_num_threads, so.inter_op_num_threads = torch.get_num_threads(), 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")

    def check(f: Path) -> None:
        session = ort.InferenceSession(str(f), so, providers=["CPUExecutionProvider"])
        verify(model, lambda feed: session.run(None, feed)[0], names, f"{f} in ONNX Runtime")

    f = folder / ONNX_DIR / ONNX_FILE
    attention, fallback = _written_and_checked(model, f, example, check)
    quantize_standard(f, f.with_name(ONNX_INT8_FILE), matmul_only=True)
    written = {"onnx": f, "onnx_int8": f.with_name(ONNX_INT8_FILE)}
    optimized, fused = _optimized(model, f, example, check)
    written |= optimized
    (folder / ONNX_DIR / EXPORT_JSON).write_text(json.dumps({"attention": attention, "fallback": fallback,
                                                             "optimizer": fused}, indent=2))
    if openvino is False:
        return written
    try:
        written |= _openvino(model, f, folder / OPENVINO_DIR, names, calibration, example)
    except ImportError:
        if openvino:
            raise
        # the openvino extra is not installed: ONNX only
    except RuntimeError as e:  # OpenVINO's converter refuses the graph (e.g. a layer with no head left)
        import shutil

        shutil.rmtree(folder / OPENVINO_DIR, ignore_errors=True)
        first = next((ln.strip() for ln in str(e).splitlines() if "Conversion failed" in ln or "not supported" in ln),
                     str(e).splitlines()[0] if str(e) else type(e).__name__)
        warnings.warn(f"export: OpenVINO cannot read {f} ({first[:200]}); no openvino/ folder written, the ONNX files "
                      "are.", RuntimeWarning, stacklevel=2)
    return written


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


def _optimized(model: nn.Module, f: Path, example: dict | None, check) -> tuple[dict[str, Path], dict]:
    """The optimized files beside the fp32 file ``f``, checked (``check(path)``) and quantized like the plain one:
    ({"onnx_optimized", "onnx_optimized_int8": path} or {}, what the optimizer fused). First the eager-attention
    graph with each layer's head count written (:func:`eager_onnx`, :func:`write_head_counts`), the form ONNX Runtime's
    optimizer fuses into one ``Attention`` op per layer; where it fuses no attention there (or that graph cannot be
    written), ``f`` itself through the optimizer. The optimizer is optional: its failure leaves the plain files and
    is said in the record."""
    out, out_int8 = f.with_name(ONNX_OPT_FILE), f.with_name(ONNX_OPT_INT8_FILE)
    try:
        fused = _eager_fused(model, f, out, example)
        if not fused.get("written"):
            return {}, fused
        check(out)
        quantize_standard(out, out_int8, matmul_only=True)
        return {"onnx_optimized": out, "onnx_optimized_int8": out_int8}, fused
    except Exception as e:  # noqa: BLE001 - the optimizer's failures share no base class
        for name in (out, out_int8):
            name.unlink(missing_ok=True)
        return {}, {"written": False, "fused": {}, "note": f"ONNX Runtime's optimizer failed on this graph "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the plain files are written"}


def _eager_fused(model: nn.Module, f: Path, out: Path, example: dict | None) -> dict:
    """``out``: the eager graph with its head counts through :func:`optimize` where that fuses attention, else the file
    ``f`` through it; :func:`optimize`'s record with "graph" (which of the two) added."""
    eager, why = f.with_name("eager.onnx"), None
    if ORT_MODEL_TYPES.get(getattr(model.config, "model_type", "")) is not None:
        try:
            with _padded_eval(model):
                names = input_names(model)
                import onnx

                eager_onnx(_TokensToHidden(model, "token_type_ids" in names), model,
                           _export_example(example if example is not None else probe_inputs(model), names), names,
                           eager, output=onnx.load(str(f), load_external_data=False).graph.output[0].name)
            counts = write_head_counts(eager)
            fused = optimize(model, eager, out)
            if fused["written"] and sum(v for k, v in fused["fused"].items() if "Attention" in k):
                return fused | {"graph": f"eager attention (TorchScript exporter), {counts} head counts written"}
            why = fused["note"]
        except Exception as e:  # noqa: BLE001 - the eager graph is optional: the exporters' failures share no base
            why = f"the eager graph could not be written ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        finally:
            eager.unlink(missing_ok=True)
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


def optimize(model: nn.Module, source: Path, out: Path, *, heads_from_config: bool = False) -> dict:
    """``source`` through ONNX Runtime's transformer optimizer (``onnxruntime.transformers.optimizer``, the model type
    from the config: :data:`ORT_MODEL_TYPES`), written to ``out`` when the optimizer knows the type: {"model_type",
    "fused": {op: count}, "written": bool, "note": what it could not fuse (None when attention was fused too)}. The
    attention fusion reads each layer's head count from the graph's reshapes (``num_heads=0``; a -1 there fuses
    nothing: :func:`write_head_counts`); ``heads_from_config``: the config's ``num_attention_heads`` and
    ``hidden_size`` stand for a -1, as optimum passes them (right for an unpruned model only)."""
    from multihead.extras import quiet_logs

    cfg = model.config
    kind = ORT_MODEL_TYPES.get(getattr(cfg, "model_type", ""))
    if kind is None:
        return {"model_type": getattr(cfg, "model_type", None), "fused": {}, "written": False,
                "note": f"ONNX Runtime's transformer optimizer has no pass for model type {cfg.model_type!r}"}
    from onnxruntime.transformers import optimizer

    with quiet_logs("onnxruntime"), quiet_logs(""):
        heads = (int(cfg.num_attention_heads), int(cfg.hidden_size)) if heads_from_config else (0, 0)
        opt = optimizer.optimize_model(str(source), model_type=kind, num_heads=heads[0], hidden_size=heads[1])
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


def fastembed(folder: str | Path, *, int8: bool = False, normalize: bool = True, name: str | None = None):
    """fastembed's ``TextEmbedding`` of a folder :func:`export` wrote (beside the tokenizer files and config.json,
    as ``prune --hf`` leaves ``OUT/model``): registered as a custom model with mean pooling (sentence-transformers'
    MiniLM pools so) over ``onnx/model.onnx`` (``int8``: ``onnx/model_int8.onnx``), its dimension read from
    config.json, then opened from the folder itself (no download), with as many threads as torch. The ``fastembed``
    extra."""
    import json

    from multihead.extras import require

    fe = require("fastembed", "multihead.hf.fastembed")
    from fastembed.common.model_description import ModelSource, PoolingType

    folder = Path(folder)
    f = folder / ONNX_DIR / (ONNX_INT8_FILE if int8 else ONNX_FILE)
    if not f.is_file() or not (folder / "config.json").is_file():
        raise ValueError(f"fastembed: {folder} has no {f.relative_to(folder)} beside a config.json: give a folder "
                         "written by multihead.hf.export (prune --hf writes OUT/model).")
    dim = int(json.loads((folder / "config.json").read_text())["hidden_size"])
    name = name or f"local/{folder.resolve().parent.name}-{folder.name}{'-int8' if int8 else ''}"
    known = {d["model"] for d in fe.TextEmbedding.list_supported_models()}
    if name not in known:
        fe.TextEmbedding.add_custom_model(model=name, pooling=PoolingType.MEAN, normalization=normalize,
                                          sources=ModelSource(hf=name), dim=dim,
                                          model_file=str(f.relative_to(folder)))
    return fe.TextEmbedding(model_name=name, specific_model_path=str(folder), threads=torch.get_num_threads())


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


def verify(model: nn.Module, run, names: list[str], what: str) -> float:
    """Run ``run`` ({name: ndarray (B, L)} -> ndarray) on two padded batches of sizes and lengths the export never
    saw and compare with the torch model on the real tokens: the largest difference, which must stay within
    float rounding (1e-4 of the output's scale, at least 1e-4) or RuntimeError names the file and the figure."""
    worst = 0.0
    vocab = int(getattr(model.config, "vocab_size", 100) or 100)
    for B, L in ((3, 11), (1, 5)):
        g = torch.Generator().manual_seed(B * 100 + L)
        ids = torch.randint(3, min(vocab, 1000), (B, L), generator=g)  # (B, L)
        am = torch.ones(B, L, dtype=torch.long)  # (B, L)
        am[B - 1, max(1, L // 3):] = 0
        x = {"input_ids": ids, "attention_mask": am}
        if "token_type_ids" in names:
            x["token_type_ids"] = (torch.arange(L) >= L // 2).long().expand(B, L).contiguous()  # (B, L)
        got = torch.from_numpy(run({n: x[n].numpy() for n in names}))
        with torch.no_grad():
            want = model(**x)[0]  # (B, L, E) or (B, L, V)
        keep = am.bool()
        err = float((got[keep] - want[keep]).abs().max())
        scale = float(want[keep].abs().max())
        if not err <= 1e-4 * max(1.0, scale):
            raise RuntimeError(f"export: {what} computes outputs {err:.3g} away from the torch model's (scale "
                               f"{scale:.3g}) at batch {B}, length {L}: the file is not the model; please report it.")
        worst = max(worst, err)
    return worst

"""A (pruned) transformers encoder's folder of runtime files: ONNX for ONNX Runtime and fastembed, OpenVINO IR.

:func:`export` (``multihead.hf.export``) writes a model directory's runtime folders, the layout sentence-transformers
and fastembed read, each file made in its runtime's room (:mod:`multihead.deploy.onnx`,
:mod:`multihead.deploy.openvino`)::

    DIR/onnx/model.onnx                 fp32, inputs input_ids, attention_mask (and token_type_ids where the
                                        model has token types), output last_hidden_state (or logits)
    DIR/onnx/model_int8.onnx            int8 weights of the matrix products, one scale per output channel (onnxruntime's
                                        quantize_dynamic), activations quantized per call
    DIR/onnx/model_eager.onnx           the eager-attention graph (MatMul, Softmax, MatMul per layer: what
    DIR/onnx/model_eager_int8.onnx      torch.onnx.export gives for a model loaded with attn_implementation="eager"),
                                        each layer's head count written; and quantized the same way
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
    DIR/onnx/model_attention.onnx       the same optimizer on the eager graph with its GELU fusions off (attention,
    DIR/onnx/model_attention_int8.onnx  layer norms, embeddings fused; the GELU as exported), and quantized the same
                                        way: written where it fuses attention
    DIR/onnx/serve.onnx                 the file to serve in each runtime: the fastest of that runtime's forms above
    DIR/onnx/serve_int8.onnx            on this machine (:mod:`multihead.deploy.serve`; a hard link to it, else a
    DIR/openvino/serve.xml, serve_int8.xml  copy), at ``serve_batch`` or by the geometric mean over batch 1, 16, 64
    DIR/onnx/export.json                the attention model.onnx holds ("sdpa" or "multihead"), the graph the
                                        optimizer was given, what it fused (op: count) and what it could not (and in
                                        model_attention.onnx: "attention_form"), how
                                        the OpenVINO files were made, which form each serving file is, each form's
                                        time and the CPU's flags ("serve")

Every file is run once on padded batches and compared with the torch model before it is kept
(:mod:`multihead.deploy.check`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from multihead.deploy.check import verify
from multihead.deploy.onnx import (
    EXPORT_JSON,
    ONNX_DIR,
    ONNX_FILE,
    ONNX_INT8_FILE,
    _attention_form,
    _eager,
    _optimized,
    _written_and_checked,
    quantize_standard,
)
from multihead.deploy.openvino import OPENVINO_DIR, _openvino
from multihead.deploy.trace import input_names


def export(model: nn.Module, folder: str | Path, *, calibration: list[dict] | None = None,
           example: dict | None = None, openvino: bool | None = None, serve: bool = True,
           serve_batch: int | None = None) -> dict[str, Path]:
    """Write ``model`` (pruned or not) into ``folder``'s runtime folders (see the module's docstring): ONNX fp32
    and int8 always (the ``onnx`` extra), OpenVINO IR fp32 where ``openvino`` is installed and int8 where ``nncf``
    is too and ``calibration`` is given (a list of batches {"input_ids", "attention_mask"[, "token_type_ids"]}
    (B, L) of text like the model's: static quantization needs the activations' ranges). Each fp32 file is run
    on two padded batches and must equal the torch model on the real tokens (float rounding), else it is
    deleted and RuntimeError says by how much. Returns a dict of paths: ``"onnx"`` and ``"onnx_int8"`` always,
    ``"onnx_eager"`` and ``"onnx_eager_int8"`` where the eager graph can be written, ``"onnx_optimized"`` and
    ``"onnx_optimized_int8"`` where ONNX Runtime's optimizer applies (``"onnx_attention"``, ``"onnx_attention_int8"``
    where it fuses attention in the eager graph), ``"openvino"`` and ``"openvino_int8"`` where
    those are written, and with ``serve`` the files to serve: ``"serve"``, ``"serve_int8"`` (``onnx/serve.onnx``,
    ``onnx/serve_int8.onnx``), ``"openvino_serve"``, ``"openvino_serve_int8"`` where OpenVINO's are written. A plain
    ``onnxruntime.InferenceSession(path)`` runs a file on the tokenizer's outputs. ``openvino``: None writes the
    OpenVINO files where the extra is installed, True requires them (ImportError naming the extra), False leaves them
    out. ``serve``: time each runtime's forms here (a few seconds, on random tokens:
    :func:`multihead.deploy.serve.measure`) and write the fastest under its serving name
    (:data:`multihead.deploy.serve.SERVE`), fastest at batch ``serve_batch`` (a positive whole number) or, by default,
    by the geometric mean over batch 1, 16 and 64; False writes no serving file (``prune --hf`` chooses it from its
    own runtime table: :func:`multihead.deploy.serve.write`)."""
    from multihead.deploy import serve as serving
    from multihead.extras import require

    serving.check_serve_batch(serve_batch)
    ort = require("onnxruntime", "multihead.hf.export")
    folder = Path(folder)
    (folder / ONNX_DIR).mkdir(parents=True, exist_ok=True)
    serving.remove(folder)  # the old serving files, before their forms are written again
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
    eager, no_eager = _eager(model, f, example, check)
    written |= eager
    optimized, fused = _optimized(model, f, eager.get("onnx_eager"), check)
    written |= optimized
    attention_form, attention_fused = _attention_form(model, eager.get("onnx_eager"), check)
    written |= attention_form
    (folder / ONNX_DIR / EXPORT_JSON).write_text(json.dumps({"attention": attention, "fallback": fallback,
                                                             "eager": no_eager, "optimizer": fused,
                                                             "attention_form": attention_fused}, indent=2))
    if openvino is not False:
        written |= _openvino_files(model, f, folder, names, calibration, example, required=bool(openvino))
    if serve:
        times = serving.measure(written, serving.synthetic_batches(model))
        written |= serving.served(folder, serving.write(folder, written, times, serve_batch,
                                                        measured_on="random tokens, 32 per row, no padding"))
    return written


def _openvino_files(model: nn.Module, f: Path, folder: Path, names: list[str], calibration: list[dict] | None,
                    example: dict | None, *, required: bool) -> dict[str, Path]:
    """The OpenVINO files of :func:`export` ({} without the extra unless ``required``, or where OpenVINO cannot read
    the graph: a warning says so)."""
    try:
        return _openvino(model, f, folder / OPENVINO_DIR, names, calibration, example)
    except ImportError:
        if required:
            raise
        return {}  # the openvino extra is not installed: ONNX only
    except RuntimeError as e:  # OpenVINO's converter refuses the graph (e.g. a layer with no head left)
        import shutil

        shutil.rmtree(folder / OPENVINO_DIR, ignore_errors=True)
        first = next((ln.strip() for ln in str(e).splitlines() if "Conversion failed" in ln or "not supported" in ln),
                     str(e).splitlines()[0] if str(e) else type(e).__name__)
        warnings.warn(f"export: OpenVINO cannot read {f} ({first[:200]}); no openvino/ folder written, the ONNX files "
                      "are.", RuntimeWarning, stacklevel=3)
        return {}

"""Where prediction happens: a (pruned) model written as each runtime's files at its pruned size, every file checked
against the torch model before it is kept, and timed against the peers' files of the same runtime.

One room per runtime, each the whole story of it, the peers' standard files (the unpruned model made into that
runtime's files the way its documentation does it) beside its own:

- :mod:`multihead.deploy.onnx`: the ONNX export, ONNX Runtime's transformer optimizer, int8 quantization; the peers'
  ``torch.onnx.export`` files, plain, optimized and quantized;
- :mod:`multihead.deploy.openvino`: OpenVINO's conversion, its graph rewrites, NNCF's static int8; the peers'
  ``convert_model`` files and their NNCF int8;
- :mod:`multihead.deploy.fastembed`: the ONNX files opened as fastembed's ``TextEmbedding``;
- :mod:`multihead.deploy.gguf`: a Llama decoder as llama.cpp's GGUF (per-layer head counts for an uneven cut; the
  peer is the unpruned model through the same writer, as llama.cpp's convert_hf_to_gguf.py writes it);
- :mod:`multihead.deploy.genai`: a Llama decoder as ONNX Runtime GenAI's model, through its own builder; the peer is
  that builder run on the unpruned checkpoint (``standard_genai``).

What the rooms share: :mod:`multihead.deploy.check` (every comparison of a written file with the torch model),
:mod:`multihead.deploy.trace` (the graph the encoder rooms trace), :mod:`multihead.deploy.session` (a file opened and
called like the model; the process's scratch folders for the files it makes), :mod:`multihead.deploy.llama` (a
decoder's head counts read from its weights, its refusals, its standard transformers folder),
:mod:`multihead.deploy.folder` (an encoder's folder of ONNX and OpenVINO files: ``multihead.hf.export``). Above them,
:mod:`multihead.deploy.peers` (the index of every runtime's standard files, made once per process),
:mod:`multihead.deploy.compare` (the runtime table: the pruned files against the peers, beside the bound of the work
removed) and :mod:`multihead.deploy.serve` (each runtime's file to serve: the fastest of its forms on this machine).
The documented writers stay reachable as ``multihead.hf.export``, ``multihead.hf.export_onnx`` and
``multihead.hf.fastembed``.
"""

__all__: list[str] = []

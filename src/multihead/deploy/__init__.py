"""Where prediction happens: a (pruned) model written as each runtime's files at its pruned size, every file checked
against the torch model before it is kept, and timed against the peers' files of the same runtime.

One room per runtime, each holding the whole story of it: :mod:`multihead.deploy.onnx` (the ONNX export, ONNX
Runtime's optimizer and quantization), :mod:`multihead.deploy.gguf` (llama.cpp's GGUF, ONNX Runtime GenAI), and
beside them :mod:`multihead.deploy.peers` (the unpruned model made into each runtime's files the way its
documentation does it) and :mod:`multihead.deploy.compare` (the runtime table: pruned against peers, beside the
bound of the work removed). The documented writers stay reachable as ``multihead.hf.export``,
``multihead.hf.export_onnx`` and ``multihead.hf.fastembed``.
"""

__all__: list[str] = []

"""The decoder runtime table: SmolLM2-135M with one key/value group of three cut in every layer, in ONNX Runtime GenAI
and llama.cpp, against the unpruned model converted by each runtime's own tools (decode tokens/s at 256, 2048 and
8192 tokens of context, prefill, KV-cache bytes per token, peak memory, beside the bound of the work removed).
The measurement is :mod:`multihead.apps.bench.decoder_runtimes`; this writes its table into
``bench/results/decoder_runtimes.md``.

    .venv/bin/python bench/decoder_runtimes.py                    # ONNX Runtime GenAI (and llama.cpp when installed)
    .venv/bin/python bench/decoder_runtimes.py --rounds 5 --contexts 256 2048 8192 --decode 16
    make decoder-llama-cpp                                        # builds llama-cpp-python, then runs this
"""

from pathlib import Path

from multihead.apps.bench import decoder_runtimes

if __name__ == "__main__":
    decoder_runtimes.main(out=Path(__file__).resolve().parent / "results" / "decoder_runtimes.md")

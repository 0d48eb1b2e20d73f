"""``multihead bench``: the workloads timed against the peers (bench: W1-W4, decode_bench: W5, cp_bench: W6,
hf_bench: W7); and the decoder runtime table bench/decoder_runtimes.py writes (decoder_runtimes)."""

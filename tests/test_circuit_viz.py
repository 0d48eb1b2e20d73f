"""A circuit seen (viz.circuit): the layout placed from the graph (layers as rows, q/k/v ports, a grouped key/value
head's edges ending under its group), the matplotlib picture with one curve per kept edge, the offline page in
Chromium (an SVG path per edge, hover gives its score, the wheel zooms, drag pans, no request), the explorer's heads
outlined where a circuit touches them; and ``multihead circuit --hf DIR`` on a tiny GPT-2 saved here: every file it
writes loads back and circuit.json equals edge_attribution / faithfulness / faithfulness_curve computed in memory;
bad input refused in one line before the model loads."""

from __future__ import annotations

import json
import re

import pytest
import torch

import multihead
from multihead import heads
from multihead.viz import circuit_figure, circuit_html, circuit_layout, explorer, faithfulness_figure
from test_circuits import _pair, _two_layers
from test_patching import _logit_diff, tiny_gpt2
from test_viz import ARGS, _chromium, _open, _show


@pytest.fixture(scope="module")
def small():
    model = _two_layers()
    clean, corrupted = _pair()
    return model, clean, corrupted, heads.edge_attribution(model, clean, corrupted, _logit_diff)


def _payload(page: str) -> dict:
    return json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))


def test_layout_rows_nodes_and_ports(small):
    """Rows: embed, layer 0, layer 1, logits; one node a head; each kept edge from its writer's node to its reader's
    port (q left of the head, v right), strongest first with its own score; filled nodes are those the edges touch;
    an edge outside the graph and patch_edges' scores are refused."""
    _, _, _, s = small
    kept = s.circuit(0.2, how="top")  # the raw top 17: the layout's order is the scores'
    lay = circuit_layout(s, kept)
    assert [r["label"] for r in lay["rows"]] == ["embed", "layer 0", "layer 1", "logits"]
    assert [n["id"] for n in lay["nodes"]] == ["embed"] + [f"layers.{i}.h{h}" for i in range(2) for h in range(4)] + \
        ["logits"]
    assert [(e["writer"], e["reader"], e["score"]) for e in lay["edges"]] == [(w, r, v) for w, r, v in s.top(len(kept))]
    pos = {n["id"]: (n["x"], n["y"]) for n in lay["nodes"]}
    for e in lay["edges"]:
        assert (e["x1"], e["y1"]) == pos[e["from"]]
        head = pos[e["to"][0]]
        offset = {"q": -0.22, "k": 0.0, "v": 0.22, "logits": 0.0}[e["kind"]]
        assert e["y2"] == head[1] and e["x2"] == pytest.approx(head[0] + offset)
    touched = {e["from"] for e in lay["edges"]} | {t for e in lay["edges"] for t in e["to"]}
    assert {n["id"] for n in lay["nodes"] if n["kept"]} == touched
    assert lay["max"] == pytest.approx(abs(s.top(1)[0][2]))
    with pytest.raises(ValueError, match=r"circuit edge \('layers.1.h0', 'layers.0.q0'\) is not in the scores' graph"):
        circuit_layout(s, [("layers.1.h0", "layers.0.q0")])
    model, clean, corrupted, _ = small
    exact = heads.patch_edges(model, clean, corrupted, _logit_diff, kept[:2])
    with pytest.raises(ValueError, match="not patch_edges' chosen ones"):
        circuit_layout(exact)


def test_grouped_key_value_heads_end_under_their_group():
    """Llama with 4 query heads sharing 2 key/value heads: a key edge into group 1 ends under heads 2 and 3 (their
    mean), and both heads count as touched; the MLP of a layer sits above its heads."""
    T = pytest.importorskip("transformers")
    import multihead.hf as mhf

    torch.manual_seed(0)
    model = mhf.attach(T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval())
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(2))
    g = heads.circuit_graph(model, {"input_ids": ids})  # the graph alone: the scores here are the edges' order
    s = heads.EdgeScores(g, list(g.edges), torch.arange(len(g.edges), dtype=torch.float64), 0.0, 1.0, "eap", "denoise")
    a = "model.layers.1.self_attn"
    lay = circuit_layout(s, [("embed", f"{a}.k1"), ("model.layers.0.mlp", "logits")])
    pos = {n["id"]: n for n in lay["nodes"]}
    k = next(e for e in lay["edges"] if e["reader"] == f"{a}.k1")
    assert k["to"] == [f"{a}.h2", f"{a}.h3"] and k["x2"] == pytest.approx((pos[f"{a}.h2"]["x"] + pos[f"{a}.h3"]["x"]) / 2)
    assert pos[f"{a}.h2"]["kept"] and pos[f"{a}.h3"]["kept"] and not pos[f"{a}.h0"]["kept"]
    assert pos["model.layers.0.mlp"]["y"] > pos["model.layers.0.self_attn.h0"]["y"]
    assert f"{a}.k1" in pos[f"{a}.h2"]["names"]


def test_the_figure_draws_one_curve_per_edge_and_the_faithfulness_curve(small, tmp_path):
    from matplotlib.patches import PathPatch

    _, _, _, s = small
    kept = s.circuit(0.1)
    fig = circuit_figure(s, kept)
    ax = fig.axes[0]
    curves = [p for p in ax.patches if isinstance(p, PathPatch)]
    assert len(curves) == len(kept)
    widths = sorted(p.get_linewidth() for p in curves)
    assert widths[-1] == pytest.approx(5.0) and widths[0] < widths[-1]  # the strongest edge the widest
    assert [t.get_text() for t in ax.get_yticklabels()] == ["embed", "layer 0", "layer 1", "logits"]
    fig.savefig(tmp_path / "c.png", dpi=80)
    assert (tmp_path / "c.png").stat().st_size > 1000

    class Curve:
        budgets, f, cpr, cmd = [0.01, 0.1, 1.0], [0.2, 0.6, 1.0], 0.7, 0.3

    fig = faithfulness_figure(Curve, at=(0.05, 0.5))
    assert "CPR 0.700" in fig.axes[0].get_title() and fig.axes[0].get_xscale() == "log"
    model, clean, corrupted, _ = small  # a curve of two constructions: a line each, its areas in the legend
    curve = heads.faithfulness_curve(model, clean, corrupted, _logit_diff, s, budgets=[0.05, 0.2, 1.0])
    ax = faithfulness_figure(curve).axes[0]
    drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert drawn == {f"{c.how}: CPR {c.cpr:.3f}, CMD {c.cmd:.3f}": c.f for c in curve.curves.values()}
    assert list(curve.curves) == ["pruned", "greedy"] and f"CPR {curve['pruned'].cpr:.3f}" in ax.get_title()


def test_the_page_in_chromium(small, tmp_path):
    """Self-contained (no address outside the page), its data the layout; in Chromium: one path per edge, hovering
    the strongest shows its writer, reader and score, the wheel zooms and a drag pans (the viewBox moves), no error."""
    _, _, _, s = small
    kept = s.circuit(0.2)
    page = circuit_html(s, kept, tmp_path / "c.html", title="<b>t</b>")
    assert page == (tmp_path / "c.html").read_text() and "<b>t</b>" not in page
    assert not re.search(r"(src|href)=\"https?:", page) and "http://" not in page.replace("http-equiv", "").replace(
        'xmlns="http://www.w3.org/2000/svg"', "").replace('"http://www.w3.org/2000/svg"', "")
    data = _payload(page)
    assert data["edges"] == json.loads(json.dumps(circuit_layout(s, kept)["edges"]))
    exe, sync_api = _chromium()
    w, r, v = s.top(1)[0]

    def act(page):
        n = page.eval_on_selector_all("path.edge", "els => els.length")
        page.hover("path.edge:last-of-type")  # the strongest, drawn last
        info = page.text_content("#info")
        before = page.get_attribute("#view", "viewBox")
        page.mouse.move(400, 300)
        page.mouse.wheel(0, -300)
        page.wait_for_function(f"document.getElementById('view').getAttribute('viewBox') !== {before!r}")
        zoomed = page.get_attribute("#view", "viewBox")
        page.mouse.move(400, 300)
        page.mouse.down()
        page.mouse.move(450, 320)
        page.mouse.up()
        return n, info, before, zoomed, page.get_attribute("#view", "viewBox")

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1000, "height": 800})
            errors, outside = [], []
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.on("request", lambda q: outside.append(q.url) if not q.url.startswith("file:") else None)
            tab.goto((tmp_path / "c.html").as_uri())
            tab.wait_for_selector("body[data-ready='1']", state="attached")
            n, info, before, zoomed, panned = act(tab)
        finally:
            browser.close()
    assert outside == []
    assert errors == []
    assert n == len(kept) and info.startswith(f"{w} → {r}") and f"{v:.5g}"[:5] in info
    assert float(zoomed.split()[2]) < float(before.split()[2]) and panned.split()[:2] != zoomed.split()[:2]


def test_the_explorer_outlines_the_circuits_heads(small, tmp_path):
    """explorer(..., circuit=EdgeScores.top(n)): the heads the edges touch are outlined and count their edges, the
    enlarged head lists its edges with scores; a malformed edge and a head of a module the capture lacks are refused."""
    model, clean, _, s = small
    with torch.no_grad(), multihead.capture(model) as cap:
        model(clean)
    top = s.top(6)
    want = {}
    for i, (w, r, _) in enumerate(top):
        for name in (w, r):
            if name not in ("embed", "logits"):
                want.setdefault(f"{name.rsplit('.', 1)[0]}:{name.rsplit('.', 1)[1][1:]}", set()).add(i)
    p = explorer(cap, None, tmp_path / "e.html", circuit=top)
    exe, sync_api = _chromium()
    mod = {"layers.0": 0, "layers.1": 1}
    key, edges = next(iter(want.items()))
    m, h = key.split(":")

    def act(page):
        got = page.eval_on_selector_all("#thumbs canvas[data-circuit]", "els => els.map(e => [e.dataset.module + ':' + "
                                        "e.dataset.head, +e.dataset.circuit, e.style.outline])")
        _show(page, int(h), module=mod[m])
        return got, page.text_content("#circuitinfo"), page.text_content("#circuitnote")

    (got, listed, note), errors = _open(p, exe, sync_api, act)
    assert errors == []
    names = {f"{n}:{i}": f"{mod[n]}:{i}" for n in mod for i in range(4)}
    assert sorted(got) == sorted([names[k], len(v), got[0][2]] for k, v in want.items()) and "solid" in got[0][2]
    assert len(listed.splitlines()) == len(edges) and note.startswith("Circuit: 6 edges")
    for i in edges:
        assert f"{top[i][0]} → {top[i][1]}" in listed
    with pytest.raises(TypeError, match=r"circuit takes edges \(writer, reader\)"):
        explorer(cap, None, None, circuit=["layers.0.h1"])
    with pytest.raises(ValueError, match=r"circuit: layers.1.h2 is a head of layers.1, which the capture lacks"):
        explorer({"layers.0": cap["layers.0"]}, None, None, circuit=[("layers.0.h1", "layers.1.h2")])


CLEAN, CORRUPTED = "when mary and john went out john gave a drink to", "when mary and john went out mary gave a drink to"


def test_the_circuit_command_writes_what_the_library_computes(tmp_path, capsys):
    """multihead circuit --hf DIR (EAP-IG, 3 steps, 5%): circuit.json loads back equal to edge_attribution,
    faithfulness at the budget and faithfulness_curve on the same model in memory; circuit.md's table, the pictures,
    the page and the explorer are written."""
    import multihead.hf as mhf
    from multihead.apps.patch.circuit import FILES
    from multihead_cli import main

    d, model, vocab = tiny_gpt2(tmp_path)
    out = tmp_path / "circuit"
    assert main(["circuit", "--hf", str(d), "--clean", CLEAN, "--corrupted", CORRUPTED, "--metric",
                 "logit-diff:mary,john", "--method", "eap-ig", "--steps", "3", "--budget", "5%", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    got = json.loads((out / "circuit.json").read_text())
    mhf.attach(model)
    ids = {t: {"input_ids": torch.tensor([[vocab[w] for w in t.split()]]),
               "attention_mask": torch.ones(1, len(t.split()), dtype=torch.long)} for t in (CLEAN, CORRUPTED)}

    def metric(o):
        return o.logits[:, -1, vocab["mary"]] - o.logits[:, -1, vocab["john"]]

    s = heads.edge_attribution(model, ids[CLEAN], ids[CORRUPTED], metric, method="eap-ig", steps=3)
    assert [tuple(e[:2]) for e in got["edges"]] == s.edges and got["steps"] == 3 and got["method"] == "eap-ig"
    assert torch.allclose(torch.tensor([e[2] for e in got["edges"]], dtype=torch.float64), s.scores, atol=1e-6)
    assert got["nodes"]["writers"] == s.graph.writers and got["nodes"]["readers"] == s.graph.readers
    kept = s.circuit(0.05)
    assert [tuple(e) for e in got["circuit"]["edges"]] == kept and got["budget"] == 0.05
    f = heads.faithfulness(model, ids[CLEAN], ids[CORRUPTED], metric, kept)
    c = got["circuit"]
    assert (c["f"], c["circuit_metric"], c["full"], c["empty"]) == pytest.approx((f.f, f.circuit, f.full, f.empty),
                                                                                abs=1e-5)
    assert c["kept"] == f.kept == len(kept) and c["total"] == len(s.edges)
    assert c["heads"] == [n["id"] for n in circuit_layout(s, kept)["nodes"] if n["kind"] == "head" and n["kept"]]
    curve = heads.faithfulness_curve(model, ids[CLEAN], ids[CORRUPTED], metric, s)
    assert got["curve"]["f"] == pytest.approx(curve.f, abs=1e-5) and got["curve"]["kept"] == curve.kept
    assert (got["curve"]["cpr"], got["curve"]["cmd"]) == pytest.approx((curve.cpr, curve.cmd), abs=1e-5)
    assert list(got["curve"]["constructions"]) == ["pruned", "greedy"] == list(curve.curves)
    for how, one in got["curve"]["constructions"].items():  # each construction's curve, as the library's
        assert one["kept"] == curve[how].kept and one["f"] == pytest.approx(curve[how].f, abs=1e-5)
        assert (one["cpr"], one["cmd"]) == pytest.approx((curve[how].cpr, curve[how].cmd), abs=1e-5)
    md = (out / "circuit.md").read_text()
    assert f"| eap-ig | 3 | 5.00% | {len(kept)} of {len(s.edges)} | {f.f:.4f} | {curve.cpr:.4f} | {curve.cmd:.4f} |" in md
    assert f"Kept heads ({len(c['heads'])}): " in md and f"{f.f:.4f}" in printed
    for name in FILES:
        assert (out / name).stat().st_size > 1000, name
    assert len(_payload((out / "circuit.html").read_text())["edges"]) == len(kept)
    assert len(_payload((out / "explorer.html").read_text())["circuit"]["edges"]) == len(kept)


@pytest.mark.parametrize("change,said", [
    ({"--corrupted": "when mary went out"}, "--clean is 11 tokens and --corrupted 4: edges are compared position by "
                                            "position"),
    ({"--budget": "0%"}, "--budget must be a share of the edges in (0, 100%], e.g. 1% or 0.01; got '0%'"),
    ({"--budget": "150%"}, "--budget must be a share of the edges in (0, 100%]"),
    ({"--method": "acdc"}, "--method must be one of eap, eap-ig, atp*; got 'acdc'"),
    ({"--steps": "0"}, "--steps must be a whole number >= 1"),
])
def test_the_circuit_command_refuses_bad_input_in_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch,
                                                                                  change, said):
    import multihead.hf as mhf
    from multihead_cli import main

    d, _, _ = tiny_gpt2(tmp_path)
    loaded = []
    monkeypatch.setattr(mhf, "attach", lambda *a, **kw: loaded.append(1))
    capsys.readouterr()  # saving the checkpoint's progress bar
    argv = {"--hf": str(d), "--clean": CLEAN, "--corrupted": CORRUPTED, "--metric": "logit-diff:mary,john",
            "--out": str(tmp_path / "o"), **change}
    assert main(["circuit", *[x for kv in argv.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1 and loaded == [], err
    assert not (tmp_path / "o").exists()

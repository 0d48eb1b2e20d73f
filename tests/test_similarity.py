"""Similarity between a class's submissions (issue 65, 4b: ``multihead check --similarity --starter FILE``): two
near-copies (names renamed, comments reworded and moved) found, an independent module not, the starter's code
counting in no pair and shown in no match, every line shown made safe, submissions read as text only (a link out of
the class folder never read); a starter that is missing or does not parse refused in one line before any grading."""

from __future__ import annotations

import pytest

from multihead.grader import classroom, similarity
from multihead_cli import main

pytest.importorskip("copydetect")

STARTER = '''"""Homework 3: multi-head attention. Fill in forward; do not change the helpers."""
import math

import torch
from torch import nn


def check_shapes(q, k, v):
    """Raise if the inputs do not share a batch size and a width."""
    if q.shape[0] != k.shape[0] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"shapes differ: {tuple(q.shape)} {tuple(k.shape)} {tuple(v.shape)}")
    return q.shape[0]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"
        # TODO: your layers here
'''
#: the starter's line the test looks for in the matches: far from where a learner's code begins
STARTER_LINE = 'raise ValueError(f"shapes differ: {tuple(q.shape)} {tuple(k.shape)} {tuple(v.shape)}")'

ADA = STARTER + '''        self.h = num_heads
        self.d = d_model // num_heads
        # one projection each for queries, keys, values, output
        self.wq = nn.Linear(d_model, d_model)
        self.wk = nn.Linear(d_model, d_model)
        self.wv = nn.Linear(d_model, d_model)
        self.wo = nn.Linear(d_model, d_model)

    def split(self, x, batch):
        # (B, L, E) -> (B, H, L, D)
        return x.view(batch, -1, self.h, self.d).transpose(1, 2)

    def forward(self, q, k, v):
        batch = check_shapes(q, k, v)
        length = q.shape[1]
        queries = self.split(self.wq(q), batch)
        keys = self.split(self.wk(k), batch)
        values = self.split(self.wv(v), batch)
        scores = torch.matmul(queries, keys.transpose(-2, -1)) / math.sqrt(self.d)
        weights = torch.softmax(scores, dim=-1)
        context = torch.matmul(weights, values)  # <script>alert(1)</script> | \x1b[2J\x1b]0;ALL SUBMISSIONS OK\x07
        # back to (B, L, E)
        context = context.transpose(1, 2).contiguous().view(batch, length, self.h * self.d)
        return self.wo(context)
'''
# Ada's, every name renamed, the comments reworded and moved
BEN = STARTER + '''        # the heads and their width
        self.n_heads = num_heads
        self.head_dim = d_model // num_heads
        self.lin_q = nn.Linear(d_model, d_model)
        self.lin_k = nn.Linear(d_model, d_model)
        self.lin_v = nn.Linear(d_model, d_model)
        self.lin_out = nn.Linear(d_model, d_model)  # output projection

    def split(self, t, bs):
        return t.view(bs, -1, self.n_heads, self.head_dim).transpose(1, 2)  # split into heads

    def forward(self, q, k, v):
        # my attention
        bs = check_shapes(q, k, v)
        n = q.shape[1]
        Q = self.split(self.lin_q(q), bs)
        K = self.split(self.lin_k(k), bs)
        V = self.split(self.lin_v(v), bs)
        s = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(self.head_dim)
        a = torch.softmax(s, dim=-1)
        out = torch.matmul(a, V)  # <script>alert(1)</script> | \x1b[2J\x1b]0;ALL SUBMISSIONS OK\x07
        out = out.transpose(1, 2).contiguous().view(bs, n, self.n_heads * self.head_dim)
        return self.lin_out(out)
'''
# written apart: one fused projection, the softmax by hand
CY = STARTER + '''        self.heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.scale = (d_model // num_heads) ** -0.5

    def forward(self, q, k, v):
        check_shapes(q, k, v)
        B, L, E = q.shape
        w = self.qkv.weight.chunk(3, dim=0)
        parts = [torch.nn.functional.linear(t, wi) for t, wi in zip((q, k, v), w)]
        qh, kh, vh = (p.reshape(B, p.shape[1], self.heads, E // self.heads).permute(0, 2, 1, 3) for p in parts)
        att = (qh @ kh.transpose(-1, -2)) * self.scale
        att = (att - att.amax(-1, keepdim=True)).exp()
        att = att / att.sum(-1, keepdim=True)
        return self.proj((att @ vh).permute(0, 2, 1, 3).reshape(B, L, E))
'''


@pytest.fixture
def klass(tmp_path):
    """The class folder (ada, ben: near-copies; cy: her own), a link to a file outside it, and the starter."""
    folder = tmp_path / "class"
    folder.mkdir()
    for name, text in (("ada", ADA), ("ben", BEN), ("cy", CY)):
        (folder / f"{name}.py").write_text(text)
    secret = tmp_path / "teacher_solution.py"
    secret.write_text(ADA.replace("# back to (B, L, E)", "# TEACHER-ONLY-7f3a"))
    (folder / "dan.py").symlink_to(secret)
    (tmp_path / "starter.py").write_text(STARTER)
    return folder


def test_the_near_copies_are_found_the_independent_one_is_not_and_the_starter_counts_in_no_pair(klass):
    files = [f for f, _ in classroom.targets([str(klass)], "MultiHeadAttention")]
    sim = similarity.compare(files, starter=klass.parent / "starter.py")
    assert [(p.a, p.b) for p in sim.pairs] == [("ada.py", "ben.py")], sim.pairs
    pair = sim.pairs[0]
    assert pair.share_a > 0.9 and pair.share_b > 0.9, pair
    assert sim.clusters == [["ada.py", "ben.py"]] and sim.compared == 3
    # the link out of the class folder is never read: not compared, its target's text nowhere
    assert sim.skipped == [("dan.py", sim.skipped[0][1])] and "outside the class folder" in sim.skipped[0][1]
    assert all("TEACHER-ONLY" not in t for t in sim.texts.values())
    # the matching lines: the learners' own code, none of the starter's
    ada_lines = ADA.split("\n")
    shown = {ada_lines[i - 1].strip() for m in pair.matches for i in range(m.a[0], m.a[1] + 1)}
    assert "weights = torch.softmax(scores, dim=-1)" in shown and STARTER_LINE not in shown
    assert all(m.a[0] > len(STARTER.split("\n")) - 1 for m in pair.matches), pair.matches
    # without the starter, what every submission was handed counts: the independent module shares it with the others
    plain = similarity.compare(files)
    with_starter = {(p.a, p.b): p.share for p in similarity.compare(files, starter=klass.parent / "starter.py",
                                                                    threshold=0.01).pairs}
    without = {(p.a, p.b): p.share for p in similarity.compare(files, threshold=0.01).pairs}
    assert without[("ada.py", "cy.py")] > 2 * with_starter.get(("ada.py", "cy.py"), 0.0)
    assert ("ada.py", "ben.py") in {(p.a, p.b) for p in plain.pairs}


def test_the_side_by_side_and_the_summary_are_safe_text(klass, tmp_path):
    files = [f for f, _ in classroom.targets([str(klass)], "MultiHeadAttention")]
    sim = similarity.compare(files, starter=klass.parent / "starter.py")
    out = similarity.write_side_by_side(sim, tmp_path / "out" / "similarity.md").read_text()
    # the lines side by side: Ada's line beside Ben's, renamed names and all
    row = next(r for r in out.split("\n") if "torch.softmax(scores" in r)
    assert "torch.softmax(s, dim=-1)" in row, row
    assert STARTER_LINE not in out
    for text in (out, similarity.markdown(sim), "\n".join(similarity.lines(sim))):
        assert "\x1b" not in text and "\x07" not in text and "<script>" not in text
    assert "\\x1b[2J" in out and "&lt;script&gt;" in out and "&#124;" in out  # shown, escaped as text


def test_the_command_reports_pairs_and_clusters_in_the_summary(klass, tmp_path, capsys, monkeypatch):
    """Through ``multihead check``: the pairs and clusters printed and in summary.md, the matching lines in
    similarity.md. The grading itself is replaced by rows of its shape (it is tested in test_grader.py; here only
    what --similarity adds is)."""
    def rows_of(files, **_):  # a refused file's row as grade_file writes it; the others OK
        return [classroom._row(f, "error" if classroom.refused(f, klass) else "ok", scheme=None, seed=1)
                for f, _ in files]

    monkeypatch.setattr(classroom, "grade_many", rows_of)
    summ = tmp_path / "summary"
    code = main(["check", str(klass), "--name", "MultiHeadAttention", "--similarity", "--starter",
                 str(klass.parent / "starter.py"), "--summary", str(summ)])
    out = capsys.readouterr().out
    assert code == 1  # dan.py, the link, is refused in its own row; the others' rows are ok
    assert "1 of 3 pairs share at least 50% of either one's code" in out and "cluster 1: ada.py, ben.py" in out, out
    md = (summ / "summary.md").read_text()
    assert "## Similar submissions" in md and "| ada.py | ben.py |" in md and "1. ada.py, ben.py" in md, md
    assert "cy.py" not in md.split("## Similar submissions")[1].split("Not compared")[0]
    assert "torch.softmax(s, dim=-1)" in (summ / "similarity.md").read_text()


def test_a_bad_starter_is_refused_in_one_line_before_any_grading(klass, tmp_path, capsys, monkeypatch):
    def never(*_, **__):
        raise AssertionError("graded before the starter was checked")

    monkeypatch.setattr(classroom, "grade_many", never)
    bad = tmp_path / "bad_starter.py"
    bad.write_text(STARTER + "    def forward(self, q, k, v)\n        pass\n")
    args = ["check", str(klass), "--name", "MultiHeadAttention", "--similarity", "--starter"]
    for starter, said in ((bad, "does not parse as Python (line 20: expected ':')"),
                          (tmp_path / "nowhere.py", "does not exist; give the file the class was handed"),
                          (tmp_path, "is not a regular file")):
        assert main([*args, str(starter)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"multihead check: --starter {starter} ") and said in err, err
    for extra, said in ((["--shard", "1/2", "--seed", "1"], "--similarity compares the whole class"),):
        assert main([*args, str(klass.parent / "starter.py"), *extra]) == 2
        assert said in capsys.readouterr().err
    assert main(["check", str(klass), "--name", "MultiHeadAttention", "--starter", str(klass.parent / "starter.py")]) == 2
    assert "--starter and --similar-above are for --similarity" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"threshold must be a share in \(0, 1\]"):
        similarity.compare([klass / "ada.py", klass / "ben.py"], threshold=1.5)
    with pytest.raises(ValueError, match="give two or more submissions; got 1"):
        similarity.compare([klass / "ada.py"])

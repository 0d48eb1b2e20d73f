"""Similarity between a class's submissions: every pair compared by copydetect's winnowed fingerprints (MOSS's method:
the code tokenized by Pygments, comments and spacing dropped, every name and string replaced by one letter, so renamed
variables and moved comments do not hide a copy), the teacher's starter code left out (copydetect's "boilerplate":
a fingerprint the starter holds counts in no pair), the pairs that share at least ``threshold`` of either
submission's code, their clusters (the submissions such pairs join), and each pair's matching lines side by side.

Submissions are untrusted and read here as text only, never imported: only those
:func:`~multihead.grader.classroom.refused` lets through (regular files inside the class folder; a link out of it
is never read), at most :data:`MAX_BYTES` each, a notebook (.ipynb) by its code cells. Every line shown is
:func:`~multihead.grader.report.safe` text, and HTML-escaped where it lands in markdown.

    sim = compare(files, starter="starter.py")      # files: the class's paths; the starter's text left out
    print("\\n".join(lines(sim)))                    # pairs at or above the threshold, clusters
    write_side_by_side(sim, Path("class/similarity.md"))
"""

from __future__ import annotations

import ast
import bisect
import html
import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from multihead.grader import classroom
from multihead.grader.report import safe

__all__ = ["MAX_BYTES", "NOISE", "THRESHOLD", "Match", "Pair", "Similarity", "compare", "lines", "load_starter",
           "markdown", "write_side_by_side"]

#: a pair is reported when the code it shares is at least this share of either submission's (the starter's left out)
THRESHOLD = 0.5
#: copydetect's noise threshold (its default): a match shorter than this many characters of tokenized code is noise
NOISE = 25
#: a submission larger than this is not compared (said in the result): course modules are a few kilobytes
MAX_BYTES = 1 << 20
#: the most rows of matching lines shown for one pair
MAX_ROWS = 200


@dataclass
class Match:
    """One run of matching code: its lines (first, last; 1-based, inclusive) in the pair's first and second
    submission."""

    a: tuple[int, int]
    b: tuple[int, int]


@dataclass
class Pair:
    """Two submissions (their paths under the class folder) and the share of each one's code found in the other
    (copydetect's similarity: matched tokens over the tokens fingerprinted, the starter's left out)."""

    a: str
    b: str
    share_a: float
    share_b: float
    matches: list[Match] = field(default_factory=list)

    @property
    def share(self) -> float:
        """The larger of the two shares (what the threshold is compared with)."""
        return max(self.share_a, self.share_b)


@dataclass
class Similarity:
    """What :func:`compare` found: the pairs at or above ``threshold`` (most similar first), the ``clusters`` they
    join (largest first), how many submissions were ``compared``, those ``skipped`` (name, why) and each compared
    submission's ``texts`` (for the side by side)."""

    threshold: float
    starter: str | None
    pairs: list[Pair]
    clusters: list[list[str]]
    compared: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)

    def cluster_of(self, name: str) -> int:
        """The 1-based number of the cluster holding ``name`` (0: none)."""
        return next((i for i, c in enumerate(self.clusters, 1) if name in c), 0)


def _code(path: Path) -> str:
    """A file's code as text: a notebook's code cells (each after a ``# In[N]`` line), else the file decoded as
    UTF-8 (an undecodable byte replaced)."""
    if path.suffix == ".ipynb":
        from multihead.grader import notebook

        return "\n".join(f"# In[{i}]\n{src}" for i, src in notebook.cells(path))
    return path.read_bytes().decode("utf-8", errors="replace")


def load_starter(path: str | os.PathLike) -> str:
    """The teacher's starter code (a .py file, or a notebook's code cells), as text; a ValueError naming the file,
    what is wrong and the fix where it does not exist, is not a regular file, is not UTF-8 or does not parse as
    Python -- raised before any grading."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--starter {safe(p, 300)} does not exist; give the file the class was handed (the code "
                         "every submission starts from).")
    if not p.is_file():
        raise ValueError(f"--starter {safe(p, 300)} is not a regular file; give the starter's .py (or .ipynb) file.")
    try:
        text = _code(p) if p.suffix == ".ipynb" else p.read_text(encoding="utf-8")
        ast.parse(text, filename=p.name)
    except UnicodeDecodeError as e:
        raise ValueError(f"--starter {safe(p, 300)} is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                         "UTF-8.") from None
    except SyntaxError as e:
        raise ValueError(f"--starter {safe(p, 300)} does not parse as Python (line {e.lineno}: {safe(e.msg, 200)}); "
                         "give the starter file as the class was handed it, a file that runs.") from None
    return text


def _fingerprint(name: str, text: str, starter: set[int]):
    """copydetect's fingerprint of ``text`` (every k-gram of its tokenized code, k = :data:`NOISE`), less the
    starter's fingerprints. Removed here, not by copydetect's ``boilerplate=``: its removal (``np.intersect1d(...,
    assume_unique=True)``) takes a k-gram repeated in a submission (four ``nn.Linear(d_model, d_model)`` lines) for
    the starter's and drops its other places (41 of 332 in a test module)."""
    from copydetect import CodeFingerprint
    from copydetect.utils import get_token_coverage

    fp = CodeFingerprint(Path(name).with_suffix(".py").name, NOISE, 1, fp=io.StringIO(text))
    if starter:
        fp.hashes = fp.hashes - starter
        fp.hash_idx = {h: i for h, i in fp.hash_idx.items() if h not in starter}
        fp.token_coverage = get_token_coverage(fp.hash_idx, NOISE, len(fp.filtered_code))
    return fp


def _readable(files: list[Path], names: dict[str, str]) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """({name: text} of the submissions that may be read, [(name, why not)]): only what
    :func:`~multihead.grader.classroom.refused` lets through (the class's own rule), at most :data:`MAX_BYTES`."""
    folder = Path(os.path.commonpath([Path(os.path.abspath(p)).parent for p in files]))
    texts, skipped = {}, []
    for path in files:
        name = names[str(path)]
        why = classroom.refused(Path(path), folder)
        if not why and os.stat(path).st_size > MAX_BYTES:
            why = f"larger than {MAX_BYTES >> 20} MiB"
        if not why:
            try:
                texts[name] = _code(Path(path))
            except (OSError, ValueError) as e:
                why = f"not readable as code ({e})"
        if why:
            skipped.append((name, safe(why, 300)))
    return texts, skipped


def compare(files: list[str | os.PathLike], *, starter: str | os.PathLike | None = None,
            threshold: float = THRESHOLD) -> Similarity:
    """Every pair of ``files`` (a class's submissions, each named by its path under their common folder; only
    regular files inside it read, :func:`~multihead.grader.classroom.refused`) compared,
    ``starter``'s code left out (:func:`load_starter`); the pairs sharing at least ``threshold`` of either one's code
    (most similar first), their clusters and matching lines. A ValueError before any comparison for a threshold
    outside (0, 1], fewer than two files or a starter :func:`load_starter` refuses; an ImportError naming the extra
    where copydetect is not installed."""
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 1:
        raise ValueError(f"threshold must be a share in (0, 1], e.g. 0.5; got {threshold!r}.")
    paths = [Path(f) for f in files]
    if len(paths) < 2:
        raise ValueError(f"similarity compares a class: give two or more submissions; got {len(paths)}.")
    start = load_starter(starter) if starter is not None else None
    try:
        from copydetect import compare_files
    except ImportError:
        raise ImportError("similarity needs copydetect: pip install 'multihead[similarity]'") from None
    names, _ = classroom.names_in_class([(p, None) for p in paths])
    texts, skipped = _readable(paths, names)
    common = _fingerprint("starter.py", start, set()).hashes if start else set()
    lines_of_starter = {x.strip() for x in (start or "").split("\n") if x.strip()}
    prints = {n: _fingerprint(n, t, common) for n, t in texts.items()}
    order = list(prints)
    pairs = []
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            _, (sa, sb), _ = compare_files(prints[a], prints[b])
            if max(sa, sb) >= threshold:
                pairs.append(Pair(a, b, float(sa), float(sb), _matches(prints[a], prints[b], texts[a], texts[b],
                                                                       lines_of_starter)))
    pairs.sort(key=lambda p: (-p.share, p.a, p.b))
    return Similarity(float(threshold), None if starter is None else str(starter), pairs, _clusters(pairs), len(texts),
                      skipped, texts)


def _clusters(pairs: list[Pair]) -> list[list[str]]:
    """The connected groups the pairs join (each sorted; the largest first)."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for p in pairs:
        parent[root(p.a)] = root(p.b)
    groups: dict[str, list[str]] = {}
    for x in parent:
        groups.setdefault(root(x), []).append(x)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: (-len(g), g))


def _raw(fp, positions: np.ndarray) -> np.ndarray:
    """Positions in the tokenized code -> positions in the file's text (copydetect's own mapping, compare_files)."""
    if len(fp.offsets) == 0:
        return positions
    at = np.clip(np.searchsorted(fp.offsets[:, 0], positions), 0, fp.offsets.shape[0] - 1)
    return positions + fp.offsets[:, 1][at]


def _runs(fa, fb) -> list[tuple[int, int, int, int]]:
    """Runs of shared fingerprints on one diagonal (the same shift from the first file's tokenized code to the
    second's), as (start, end) in each, longest first, none overlapping a longer one in either file."""
    by_shift: dict[int, list[int]] = {}
    for h in fa.hashes & fb.hashes:
        ia, ib = fa.hash_idx[h], fb.hash_idx[h]
        if len(ia) * len(ib) > 64:  # a fingerprint repeated throughout both: it places nothing
            continue
        for i in ia:
            for j in ib:
                by_shift.setdefault(int(j) - int(i), []).append(int(i))
    runs = []
    for shift, starts in by_shift.items():
        starts.sort()
        first = prev = starts[0]
        for s in [*starts[1:], None]:
            if s is None or s - prev > NOISE:
                runs.append((first, prev + NOISE, first + shift, prev + NOISE + shift))
                first = s
            prev = s if s is not None else prev
    kept: list[tuple[int, int, int, int]] = []
    for r in sorted(runs, key=lambda r: (r[0] - r[1], r[0])):
        if all(r[1] <= k[0] or r[0] >= k[1] for k in kept) and all(r[3] <= k[2] or r[2] >= k[3] for k in kept):
            kept.append(r)
    return sorted(kept)


def _line_of(text: str):
    """A function: a position in ``text`` -> its 1-based line."""
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    return lambda pos: bisect.bisect_right(starts, int(pos))


def _matches(fa, fb, text_a: str, text_b: str, starter: set[str]) -> list[Match]:
    """The pair's matching runs as line ranges in each file, the starter's lines at either end left out."""
    runs = _runs(fa, fb)
    if not runs:
        return []
    arr = np.array(runs, dtype=np.int64)  # (runs, 4): start, end in a; start, end in b (tokenized code)
    a0, a1 = _raw(fa, arr[:, 0]), _raw(fa, arr[:, 1] - 1)
    b0, b1 = _raw(fb, arr[:, 2]), _raw(fb, arr[:, 3] - 1)
    la, lb = _line_of(text_a), _line_of(text_b)
    a, b = text_a.split("\n"), text_b.split("\n")
    return [Match(_trimmed(a, la(a0[i]), la(a1[i]), starter), _trimmed(b, lb(b0[i]), lb(b1[i]), starter))
            for i in range(len(runs))]


def _percent(x: float) -> str:
    return f"{100 * x:.0f}%"


def lines(sim: Similarity) -> list[str]:
    """The console's lines: how many pairs were compared and found, each pair (its shares, its cluster), the
    clusters, the submissions not compared."""
    n = sim.compared * (sim.compared - 1) // 2
    left = f"the starter's code, {safe(Path(sim.starter).name, 200)}, left out" if sim.starter else "no starter given"
    out = [f"similar submissions ({left}): {len(sim.pairs)} of {n} pairs share at least {_percent(sim.threshold)} of "
           "either one's code"]
    out += [f"  {_percent(p.share_a):>4} / {_percent(p.share_b):>4}  {safe(p.a, 300)}  {safe(p.b, 300)}  (cluster "
            f"{sim.cluster_of(p.a)})" for p in sim.pairs]
    out += [f"  cluster {i}: {', '.join(safe(x, 300) for x in c)}" for i, c in enumerate(sim.clusters, 1)]
    out += [f"  not compared: {safe(name, 300)} ({why})" for name, why in sim.skipped]
    return out


def _cell(text: str) -> str:
    """Submission text as one markdown table cell: safe, HTML-escaped (no tag of a submission's renders), ``|``
    escaped, indentation kept."""
    s = html.escape(safe(text, 300)).replace("|", "&#124;").replace("`", "&#96;")
    body = s.lstrip(" ")
    return "&nbsp;" * (len(s) - len(body)) + body


def markdown(sim: Similarity, side_by_side: str | None = "similarity.md") -> str:
    """The class summary's section: the pairs (shares, cluster), the clusters, and a link to the side by side."""
    n = sim.compared * (sim.compared - 1) // 2
    left = (f"the starter's code, {_cell(Path(sim.starter).name)}, left out" if sim.starter else
            "no starter code given: code every submission was handed counts too")
    md = ["## Similar submissions", "",
          f"{len(sim.pairs)} of {n} pairs share at least {_percent(sim.threshold)} of either submission's code "
          f"({left})." + (f" The matching lines side by side: [{side_by_side}]({side_by_side})."
                          if sim.pairs and side_by_side else ""), ""]
    if sim.pairs:
        md += ["| submission | submission | share of the first | share of the second | cluster |",
               "|---|---|---:|---:|---:|"]
        md += [f"| {_cell(p.a)} | {_cell(p.b)} | {_percent(p.share_a)} | {_percent(p.share_b)} | "
               f"{sim.cluster_of(p.a)} |" for p in sim.pairs]
        md += ["", "Clusters (the submissions such pairs join):", ""]
        md += [f"{i}. {', '.join(_cell(x) for x in c)}" for i, c in enumerate(sim.clusters, 1)]
    if sim.skipped:
        md += ["", "Not compared: " + "; ".join(f"{_cell(n)} ({_cell(w)})" for n, w in sim.skipped)]
    return "\n".join(md) + "\n"


def _key(line: str) -> str:
    """A line as the comparison sees it: tokenized, names and strings one letter each, comments and spacing gone."""
    from copydetect.utils import filter_code

    return filter_code(line, "line.py")[0].strip()


def _aligned(a: list[str], b: list[str]) -> list[tuple[int | None, int | None]]:
    """The lines of two matching runs paired (indices; None: a line with no partner), by their tokenized form (a
    renamed variable still pairs, a comment moved to another line does not shift the rest)."""
    import difflib
    from itertools import zip_longest

    rows: list[tuple[int | None, int | None]] = []
    ops = difflib.SequenceMatcher(None, [_key(x) for x in a], [_key(x) for x in b], autojunk=False).get_opcodes()
    for op, i0, i1, j0, j1 in ops:
        if op == "equal":
            rows += list(zip(range(i0, i1), range(j0, j1), strict=True))
        else:
            rows += list(zip_longest(range(i0, i1), range(j0, j1)))
    return rows


def _trimmed(lines_: list[str], first: int, last: int, starter: set[str]) -> tuple[int, int]:
    """(first, last) without the starter's own lines, blank lines and comments at either end (a match may begin
    inside the starter's last line: its k-gram reaches into the submission's code)."""
    def idle(n: int) -> bool:
        key = _key(lines_[n - 1])
        return not key or lines_[n - 1].strip() in starter

    while first < last and idle(first):
        first += 1
    while last > first and idle(last):
        last -= 1
    return first, last


def _pair_rows(sim: Similarity, p: Pair) -> list[str]:
    """One pair's matching lines as table rows: each match's lines of the first file beside the second's."""
    a, b = sim.texts[p.a].split("\n"), sim.texts[p.b].split("\n")
    rows: list[str] = []
    for m in p.matches:
        (a0, a1), (b0, b1) = m.a, m.b
        for i, j in _aligned(a[a0 - 1:a1], b[b0 - 1:b1]):
            left = f"{a0 + i} | {_cell(a[a0 + i - 1])}" if i is not None else " | "
            right = f"{b0 + j} | {_cell(b[b0 + j - 1])}" if j is not None else " | "
            rows.append(f"| {left} | {right} |")
        rows.append("| | ... | | ... |")
    if len(rows) > MAX_ROWS:
        rows = rows[:MAX_ROWS] + [f"| | ({len(rows) - MAX_ROWS} more rows) | | |"]
    return rows


def write_side_by_side(sim: Similarity, path: str | os.PathLike) -> Path:
    """``path`` (markdown): each pair at or above the threshold, its matching lines side by side (line numbers and
    text of each file, one match after another)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = ["# Similar submissions: the matching lines side by side", "",
          markdown(sim, side_by_side=None).split("\n", 2)[2].strip(), ""]
    for p in sim.pairs:
        md += [f"## {_cell(p.a)} and {_cell(p.b)}: {_percent(p.share_a)} and {_percent(p.share_b)}", "",
               f"| line | {_cell(p.a)} | line | {_cell(p.b)} |", "|---:|---|---:|---|", *_pair_rows(sim, p), ""]
    out.write_text("\n".join(md))
    return out

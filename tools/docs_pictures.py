"""The documentation's pictures, drawn by the library's own code when the site is built (``make docs``; never
committed): ``python tools/docs_pictures.py OUT [--quick]``.

Each picture comes from the call a user would make, on the demo's digit reverser (trained, from the demo's
checkpoint in ``out/checkpoints``, trained there first when missing, as ``make demo`` does): its cross-attention
heads and encoder rollout, the decoder's explorer (the page itself, live, and a screenshot by Chromium), the pruning
curve with recovery and the importance heatmap (``multihead prune``'s own run), the activation-patching grid of the
reversal, and the class-summary chart of three submissions graded in their sandboxes. ``--quick`` draws the same
pictures from an untrained reverser with small settings (the tests build the site that way, in seconds): the
pipeline is the same, the pictures mean nothing.

:func:`generate` returns {file name: caption}; each caption names the command that draws the same picture.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

_SUBMISSION = """
import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.h, self.d = num_heads, d_model // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, q, k, v, mask=None):
        B, Lq, E = q.shape
        split = lambda x: x.view(B, -1, self.h, self.d).transpose(1, 2)  # (B, H, L, D)
        Q, K, V = split(self.q(q)), split(self.k(k)), split(self.v(v))
        s = Q @ K.transpose(-2, -1) / SCALE
        if mask is not None:
            s = s.masked_fill(~mask.bool(), float("-inf"))
        w = WEIGHTS
        return self.o((w @ V).transpose(1, 2).reshape(B, Lq, E))  # (B, Lq, E)
"""


def submission(scale: str = "self.d ** 0.5", weights: str = "torch.softmax(s, -1).nan_to_num()") -> str:
    """A learner's file (the class ``MultiHeadAttention(d_model, num_heads)``, called ``m(q, k, v, mask)``): right by
    default; ``scale``: what the scores are divided by, ``weights``: what multiplies the values (``"s"``: the raw
    scores, the ViT notebook's mistake). tests/test_readme.py grades it too."""
    return textwrap.dedent(_SUBMISSION).replace("SCALE", scale).replace("WEIGHTS", weights)


#: three learners' files: right, the ViT notebook's two mistakes one at a time
_CLASS = {"ada.py": {}, "ben.py": {"scale": "self.d"}, "cy.py": {"weights": "s"}}


def generate(out: Path, *, quick: bool = False, checkpoints: Path | None = None) -> dict[str, str]:
    """Draw every picture into ``out``; ``checkpoints``: the demo's checkpoint folder (default ``out/checkpoints``
    of the working directory); ``quick``: an untrained reverser, small settings."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _reverser_checkpoint(Path(tmp), quick, checkpoints)
        captions = _heads(out, ckpt)
        captions |= _explorer_screenshot(out)
        captions |= _cut(out, ckpt, quick, Path(tmp))
        captions |= _class(out, Path(tmp))
    return captions


def _reverser_checkpoint(tmp: Path, quick: bool, checkpoints: Path | None) -> Path:
    from multihead.models import checkpoint
    from multihead.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer, load_or_train

    if quick:
        torch.manual_seed(0)
        checkpoint.save(Seq2SeqTransformer(Seq2SeqConfig()), tmp / "reverser")
        return tmp / "reverser"
    ckpt = (checkpoints or Path("out/checkpoints")) / "transformer"
    load_or_train(ckpt)  # the demo's: trained and saved when missing
    return ckpt


def _heads(out: Path, ckpt: Path) -> dict[str, str]:
    from multihead.apps.viz import course
    from multihead.models.seq2seq import load_or_train

    course.draw_reverser(load_or_train(ckpt), "31415926", out)
    cmd = "`make demo` (`multihead viz --model toy --text 31415926 --out DIR`)"
    return {"transformer_cross_attention.png": "Every cross-attention head of the digit reverser reversing 31415926: "
                                               f"the anti-diagonal of reversal. {cmd}",
            "transformer_encoder_rollout.png": f"The encoder's attention rollout. {cmd}",
            "transformer_decoder_explorer.html": f"The decoder's explorer, live. {cmd}"}


def _explorer_screenshot(out: Path) -> dict[str, str]:
    """The decoder's explorer as Chromium shows it (Debian's chromium, driven by playwright: the `browser` extra)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        exe = None
    if exe is None:  # the site is still built, with the live explorer and without its picture
        print("docs_pictures: no explorer screenshot: it needs Debian's chromium and playwright (the browser extra): "
              "`make chromium` (as root), or apt-get install chromium", file=sys.stderr)
        return {}

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 700})
            page.goto((out / "transformer_decoder_explorer.html").resolve().as_uri())
            page.wait_for_timeout(300)
            page.screenshot(path=str(out / "explorer.png"))
        finally:
            browser.close()
    return {"explorer.png": "The decoder's explorer (a screenshot; the live page is linked below it): every layer and "
                            "head as a thumbnail, one head enlarged with its tokens. `make demo`, "
                            "`multihead.viz.explorer(captured, tokens, path)`"}


def _cut(out: Path, ckpt: Path, quick: bool, tmp: Path) -> dict[str, str]:
    from multihead import heads
    from multihead.apps.prune import pruning

    setup = pruning.toy_setup(ckpt)
    clean, corrupted, metric = setup.patch_pair
    r = heads.patch(setup.model, clean, corrupted, metric)
    r.figure("log-probability of the right reversal").savefig(out / "patching.png", dpi=110, bbox_inches="tight")
    options = (pruning.Options(0.5, step=0.25, max_seconds=0.05, recover=0) if quick else
               pruning.Options(0.5, step=0.125, max_seconds=2.0, recover=150, recover_curve=True))
    pruning.run(setup, tmp / "prune", options)
    for name in ("curve.png", "importance.png"):
        shutil.copy(tmp / "prune" / name, out / name)
    cmd = "`make demo` (`out/prune_toy/`), `multihead prune --model toy --fraction 0.5 --recover 150 --out DIR`"
    return {"curve.png": f"The reverser's pruning curve: the cut alone, and after 150 steps of recovery. {cmd}",
            "importance.png": f"Each head's importance (gradient), layer by head. {cmd}",
            "patching.png": "Activation patching on the reverser: each head's share of the way from the corrupted "
                            "digits' run back to the clean one (`heads.patch(model, clean, corrupted, metric)`; "
                            "`Patching.figure()`)"}


def _class(out: Path, tmp: Path) -> dict[str, str]:
    import multihead
    from multihead.grader import classroom

    folder = tmp / "class"
    folder.mkdir()
    for name, mistake in _CLASS.items():
        (folder / name).write_text(submission(**mistake))
    rows = multihead.grade(str(folder), name="MultiHeadAttention", init="d_model=32, num_heads=4", call="qkv")
    classroom.write_summary(rows, tmp / "summary")
    shutil.copy(tmp / "summary" / "summary.png", out / "class_summary.png")
    return {"class_summary.png": "A class of three graded: the mistakes found, most common first. "
                                 "`multihead check submissions/ --name MultiHeadAttention --init "
                                 "\"d_model=32, num_heads=4\" --call qkv --summary DIR`"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    for name, caption in generate(Path(a.out), quick=a.quick).items():
        print(f"{name}: {caption}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())

"""``multihead viz``: the course's models, a transformers checkpoint (--hf) or a timm/torchvision model
(vision) drawn head by head."""

from __future__ import annotations

import sys
from pathlib import Path

from multihead.apps.common.checkpoints import checkpoints

#: what viz draws a sentence model on when no --text is given
SENTENCE = "Multi-head attention lets the model look in several places."


def _text(args, default: str) -> str:
    """--text as given (an empty one included: it is what the user asked to see), or ``default`` when absent."""
    return default if args.text is None else args.text


def viz(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from multihead.apps.viz import course

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.timm or args.torchvision:
        return _viz_vision(args, out)
    ckpts = checkpoints(args.checkpoints, out)
    if args.hf:
        from multihead.apps.prune import hf_models

        paths = hf_models.draw(args.hf, _text(args, SENTENCE), out, explain=args.explain)
    elif args.model is None:
        print("multihead viz: give --model {toy,vit,minilm} or --hf DIR", file=sys.stderr)
        return 2
    elif args.index is not None and args.model != "vit":
        print(f"multihead viz: --index picks a test image of --model vit; --model {args.model} draws --text",
              file=sys.stderr)
        return 2
    elif args.model == "toy":
        text = _text(args, "31415926")
        course.toy_digits(text)  # checked before any training
        paths = course.draw_reverser(course.reverser(ckpts / "transformer", args.retrain), text, out)
    elif args.model == "vit":
        n_test = len(course.digits()[2])
        if (args.index or 0) >= n_test:  # checked before any training
            print(f"multihead viz: --index must be in [0, {n_test - 1}] (the digits test images); got {args.index}",
                  file=sys.stderr)
            return 2
        paths = course.draw_vit(course.vit(ckpts / "vit", args.retrain), args.index or 0, out)
    else:
        try:
            paths = course.draw_minilm(_text(args, SENTENCE), out)
        except FileNotFoundError as e:
            print(f"multihead viz: {e}", file=sys.stderr)
            return 2
    for p in paths:
        print(p)
    return 0


def _viz_vision(args, out: Path) -> int:
    """``multihead viz --timm NAME`` / ``--torchvision NAME``: every head of the model on ``--image``."""
    import json

    from multihead.apps.viz import vision

    if args.timm and args.torchvision or not args.image or args.model or args.hf:
        print("multihead viz: --timm NAME or --torchvision NAME (one) takes --image FILE, with --checkpoint FILE "
              "and --model-args JSON if needed; not with --model or --hf", file=sys.stderr)
        return 2
    try:
        model_args = json.loads(args.model_args) if args.model_args else None
        if model_args is not None and not isinstance(model_args, dict):
            raise ValueError(f"--model-args must be a JSON object of the model's arguments; got {args.model_args}")
        package, name = ("timm", args.timm) if args.timm else ("torchvision", args.torchvision)
        model = vision.load_model(package, name, args.checkpoint, model_args)
        paths = vision.draw(model, args.image, out)
    except (ValueError, FileNotFoundError) as e:  # json's JSONDecodeError is a ValueError
        print(f"multihead viz: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


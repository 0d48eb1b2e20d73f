"""Every family: each base model in transformers' model mapping that builds from its default config
shrunk to a tiny size (and takes input_ids + attention_mask), attached to multihead and compared with
transformers' own attention (sdpa, else eager) on a padded batch, on the real tokens; then packed
(padding-free) the same way; then one head of the first module with a layout cut and compared with
the same head gated. Families that do not build here (missing timm/detectron2, configs that need
more than shrinking, hybrid state-space caches) are listed with transformers' reason; composite
families (a config with sub-configs, whose parts would keep their full sizes) are not swept.

    .venv/bin/python bench/hf_sweep.py [model_type ...]     # writes bench/results/hf_sweep.md (--out)

Columns: "refused" is a clear ValueError/TypeError from multihead (by design); "ERROR" anything else
raised by multihead's code; "build" a failure before multihead is involved.
"""

from __future__ import annotations

import argparse
import inspect
import signal
import sys
import traceback
import warnings
from pathlib import Path

import torch

import multihead.hf as mhf
from multihead import heads

V = 128
#: config fields set when the family's config has them (sizes shrunk, special tokens inside V)
SHRINK = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, d_model=32, encoder_layers=2,
    decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    n_embd=32, n_layer=2, n_head=4, n_positions=64, max_position_embeddings=64, num_layers=2, num_heads=4, d_ff=64,
    d_kv=8, ffn_dim=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64, num_key_value_heads=2, head_dim=8,
    embedding_size=32, vocab_size=V, num_decoder_layers=2, moe_intermediate_size=32, num_experts=4,
    num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4, kv_lora_rank=8, q_lora_rank=8,
    qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, sliding_window=4, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, decoder_start_token_id=1,
)
SECONDS = 60  # per family


class _Timeout(BaseException):  # not caught by the per-stage `except Exception`
    pass


class _Composite(BaseException):
    pass


def _alarm(*_):
    raise _Timeout


def _ours(e: BaseException) -> bool:
    """Whether an exception was raised inside multihead's code (its innermost frame)."""
    tb = traceback.extract_tb(e.__traceback__)
    return bool(tb) and "/multihead/" in tb[-1].filename


def _build(T, mt: str, cls):
    cfg_cls = T.CONFIG_MAPPING[mt]
    if getattr(cfg_cls, "sub_configs", None):
        raise _Composite  # its parts keep their full default sizes: too big to build here
    base = cfg_cls()
    kw = {k: v for k, v in SHRINK.items() if hasattr(base, k)}
    if getattr(base, "layer_types", None) is not None:
        kw["layer_types"] = None  # derived again from the shrunk layer count
    cfg = cfg_cls(**kw)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params or "attention_mask" not in params:
        return None, None, cfg
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(V, getattr(cfg, "vocab_size", V) or V), (3, 9), generator=g)  # (B, L)
    am = torch.ones(3, 9, dtype=torch.long)
    am[1, 6:] = 0
    am[2, 2:] = 0
    x = {"input_ids": ids, "attention_mask": am}
    if "decoder_input_ids" in params and getattr(cfg, "is_encoder_decoder", False):
        x["decoder_input_ids"] = torch.randint(3, min(V, cfg.vocab_size), (3, 5), generator=g)
    return model, x, cfg


def _out(model, x):
    with torch.no_grad():
        o = model(**x)
    return o.last_hidden_state if getattr(o, "last_hidden_state", None) is not None else o[0]


def _err(a, b, real):
    d = (a - b) if real is None else (a - b)[real]
    return float(d.abs().max())


def _one(T, mt: str, cls) -> list[str]:
    """[family, reference, attached error, modules/layouts, packed, pruned vs gated]"""
    try:
        model, x, cfg = _build(T, mt, cls)
    except Exception as e:  # noqa: BLE001 - a family that does not build from a shrunk config
        return [mt, "build", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:90]}", "", "", ""]
    if model is None:
        return [mt, "-", "no input_ids + attention_mask", "", "", ""]
    try:
        model.set_attn_implementation("sdpa")
        ref = "sdpa"
    except Exception:  # noqa: BLE001 - transformers' sdpa refuses the family
        model.set_attn_implementation("eager")
        ref = "eager"
    try:
        want = _out(model, x)
    except Exception as e:  # noqa: BLE001
        return [mt, ref, f"build: the unpatched model raised {type(e).__name__}: {str(e)[:80]}", "", "", ""]
    real = x["attention_mask"].bool() if "decoder_input_ids" not in x and want.shape[:2] == (3, 9) else None
    row = [mt, ref]
    try:
        mhf.attach(model)
        err = _err(_out(model, x), want, real)
        row.append(f"{err:.1e}" + (" WRONG" if err > 1e-4 else ""))
    except (ValueError, TypeError) as e:
        return row + [f"refused: {str(e)[:120]}", "", "", ""]
    except Exception as e:  # noqa: BLE001
        return row + [f"{'ERROR' if _ours(e) else 'build'} {type(e).__name__}: {str(e)[:100]}", "", "", ""]
    mods = mhf.attention_modules(model)
    laid = [n for n, m in mods.items() if m.attention_hooks.layout is not None]
    row.append(f"{len(mods)}/{len(laid)}")
    try:
        m2, _, _ = _build(T, mt, cls)  # a fresh config too: attach set the first one's implementation
        m2.set_attn_implementation(ref)
        w2 = _out(m2, x)
        mhf.attach(m2, packed=True)
        e2 = _err(_out(m2, x), w2, real)
        row.append(f"{e2:.1e}" + (" WRONG" if e2 > 1e-4 else ""))
    except (ValueError, TypeError) as e:
        row.append(f"refused: {str(e)[:100]}")
    except Exception as e:  # noqa: BLE001
        row.append(f"{'ERROR' if _ours(e) else 'build'} {type(e).__name__}: {str(e)[:100]}")
    if laid:
        first = laid[0]
        H = mods[first].attention_hooks.num_heads
        try:
            with heads.gated(model, {first: torch.ones(H).index_fill(0, torch.tensor([1]), 0.0)}):
                gated = _out(model, x)
            heads.prune(model, {first: [1]})
            e3 = _err(_out(model, x), gated, real)
            row.append(f"{e3:.1e}" + (" WRONG" if e3 > 1e-4 else ""))
        except Exception as e:  # noqa: BLE001
            row.append(f"{'ERROR' if _ours(e) else 'refused'} {type(e).__name__}: {str(e)[:100]}")
    else:
        row.append("")
    return row


def main(only: list[str], out: Path) -> None:
    import transformers as T
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    warnings.filterwarnings("ignore")
    T.logging.set_verbosity_error()
    torch.set_num_threads(2)
    signal.signal(signal.SIGALRM, _alarm)
    lines: list[str] = []

    def say(line: str) -> None:  # each row printed as it comes, the whole table written to ``out`` at the end
        print(line, flush=True)
        lines.append(line)

    say(f"transformers {T.__version__}, torch {torch.__version__}: `.venv/bin/python bench/hf_sweep.py"
        f"{''.join(' ' + a for a in sys.argv[1:])}`\n")
    say("| family | reference | attached: max error on real tokens | attention modules / with a layout "
        "| packed=True: max error | one head cut vs gated |")
    say("|---|---|---|---|---|---|")
    counts: dict[str, int] = {}
    for mt, name in sorted(MODEL_MAPPING_NAMES.items()):
        if only and mt not in only:
            continue
        cls = getattr(T, name[0] if isinstance(name, tuple) else name, None)
        if cls is None:
            continue
        signal.alarm(SECONDS)
        try:
            row = _one(T, mt, cls)
        except _Timeout:
            row = [mt, "-", f"over {SECONDS} s", "", "", ""]
        except _Composite:
            continue  # composite families (vision-language, audio-text): not swept
        finally:
            signal.alarm(0)
        text = " | ".join(c.replace("|", "/").replace("\n", " ") for c in row)
        for key in ("WRONG", "ERROR"):
            counts[key] = counts.get(key, 0) + text.count(key)
        counts["attached"] = counts.get("attached", 0) + (row[2][:1].isdigit())
        say(f"| {text} |")
    say(f"\n{counts.get('attached', 0)} families attached; cells WRONG: {counts.get('WRONG', 0)}, "
        f"ERROR (raised inside multihead, not a clear refusal): {counts.get('ERROR', 0)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help="model types to sweep (default: every one)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "hf_sweep.md")
    a = ap.parse_args()
    main(a.families, a.out)

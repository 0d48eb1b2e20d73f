"""Circuits on the families researchers study (issue 81, point 2): Qwen3 (query/key norms per head), Phi-3 (a fused
qkv_proj), GPT-NeoX/Pythia and GPT-J (attention and MLP in parallel), Gemma 2, Gemma 3 and OLMo 2 (a norm between the
attention's output and the residual add). On a tiny config of each, every edge patched by ``patch_edges`` equals the
same patch written out here with plain forward hooks on the model's own modules (the writer's change computed from the
two runs' captures -- through the norm after the attention where there is one -- and added at the one reader), EAP's
score equals the derivative of that patch along the change (the gradient through the norm), and faithfulness is the
corrupted run with no edge kept and the clean run with all. BERT's post-norm encoder is refused by name, in one line,
before any forward."""

from __future__ import annotations

import contextlib

import pytest
import torch

from multihead import heads

T = pytest.importorskip("transformers")

_C = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2)


def _family(name: str):
    """(model, spec): spec names, per block, its attention, output projection, the module whose input is the MLP's
    stream, the module whose output is the MLP's write, the norm after the attention, GPT-J's shared norm, and the
    stack and the final norm."""
    torch.manual_seed(0)
    llama = dict(attn="self_attn", o="o_proj", mlp_in="post_attention_layernorm", mlp_out="mlp", post=None, via=None,
                 stack="model.layers", final="model.norm")
    gemma = {**llama, "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm",
             "post": "post_attention_layernorm"}
    if name == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**_C, head_dim=8)), llama
    if name == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(**_C, pad_token_id=0)), llama
    if name in ("neox", "neox-sequential"):  # Pythia's parallel block, and GPT-NeoX's flag off
        return (T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     use_parallel_residual=name == "neox")),
                dict(llama, attn="attention", o="dense", stack="gpt_neox.layers", final="gpt_neox.final_layer_norm"))
    if name == "gptj":
        return (T.GPTJForCausalLM(T.GPTJConfig(vocab_size=50, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                               n_positions=16, bos_token_id=0, eos_token_id=0)),
                dict(llama, attn="attn", o="out_proj", mlp_in="mlp", via="ln_1", stack="transformer.h",
                     final="transformer.ln_f"))
    if name == "gemma2":
        return T.Gemma2ForCausalLM(T.Gemma2Config(**_C, head_dim=8)), gemma
    if name == "gemma3":
        return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**_C, head_dim=8)), gemma
    return T.Olmo2ForCausalLM(T.Olmo2Config(**_C, eos_token_id=0)), {**gemma, "mlp_in": "mlp"}


FAMILIES = ["qwen3", "phi3", "neox", "neox-sequential", "gptj", "gemma2", "gemma3", "olmo2"]


def _inputs():
    g = torch.Generator().manual_seed(2)
    clean = {"input_ids": torch.randint(0, 50, (2, 7), generator=g)}
    corrupted = {"input_ids": clean["input_ids"].clone()}
    corrupted["input_ids"][:, 2] = (corrupted["input_ids"][:, 2] + 7) % 50
    return clean, corrupted


def _metric(out):
    return out.logits[:, -1, 3] - out.logits[:, -1, 5]


def _capture(model, spec, inputs) -> dict:
    """One run's block inputs, attention outputs, output projections' inputs (the heads' outputs, (B, L, H D)) and
    MLP writes, by layer, from forward hooks on the model's own modules."""
    got: dict = {}
    named = dict(model.named_modules())
    with contextlib.ExitStack() as stack:
        for i, blk in enumerate(named[spec["stack"]]):
            def keep(key):
                def hook(m, args, out=None):
                    got[key] = (args[0] if out is None else out[0] if isinstance(out, tuple) else out).detach()
                return hook
            blk_attn = getattr(blk, spec["attn"])
            stack.callback(blk.register_forward_pre_hook(lambda m, a, kw, i=i: got.__setitem__(
                ("x", i), (a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True).remove)
            stack.callback(blk_attn.register_forward_hook(keep(("y", i))).remove)
            stack.callback(getattr(blk_attn, spec["o"]).register_forward_pre_hook(keep(("o", i))).remove)
            stack.callback(getattr(blk, spec["mlp_out"]).register_forward_hook(keep(("mlp", i))).remove)
        with torch.no_grad():
            model(**inputs)
    return got


def _change(model, spec, base, src, writer: str, t):
    """The writer's change to the stream, (B, L, E), scaled by t along the line from the base run's write to the
    source run's: linear for the embedding, an MLP and a head added straight; through the norm after the attention
    (at the base run's attention output) for a head whose layer has one."""
    if writer == "embed":
        return t * (src[("x", 0)] - base[("x", 0)])
    if writer.endswith(".mlp"):
        i = int(writer.split(".")[-2])
        return t * (src[("mlp", i)] - base[("mlp", i)])
    layer, h = writer.rsplit(".h", 1)
    i, h = int(layer.split(".")[-2]), int(h)
    blk = dict(model.named_modules())[spec["stack"]][i]
    o = getattr(getattr(blk, spec["attn"]), spec["o"])
    D = base[("o", i)].shape[-1] // 4  # (B, L, H D): head h's D features
    cols = slice(h * D, (h + 1) * D)
    dw = (src[("o", i)][..., cols] - base[("o", i)][..., cols]) @ o.weight[:, cols].t()  # (B, L, E): write change
    if spec["post"] is None:
        return t * dw
    norm = getattr(blk, spec["post"])
    return norm(base[("y", i)] + t * dw) - norm(base[("y", i)])


def _patched(model, spec, inputs, reader: str, change, caps) -> torch.Tensor:
    """The metric (mean over the batch) of the base run with ``change`` added at ``reader``'s input only: the final
    norm's input for the logits; the MLP's input (GPT-J: ln_1 of the changed stream); a head's query or a key/value
    head's key or value recomputed by a second run whose block input carries the change, then set into the first."""
    named = dict(model.named_modules())
    blocks = named[spec["stack"]]
    with contextlib.ExitStack() as stack:
        if reader == "logits":
            stack.callback(named[spec["final"]].register_forward_pre_hook(lambda m, a: (a[0] + change,)).remove)
            return _metric(model(**inputs)).mean()
        i = int(reader.split(".")[-3])  # "....layers.1.mlp.in", "....layers.1.self_attn.q0"
        blk = blocks[i]
        if reader.endswith(".in"):
            if spec["via"]:
                x = caps[("x", i)]
                hook = getattr(blk, spec["mlp_in"]).register_forward_pre_hook(
                    lambda m, a: (getattr(blk, spec["via"])(x + change),))
            else:
                hook = getattr(blk, spec["mlp_in"]).register_forward_pre_hook(lambda m, a: (a[0] + change,))
            stack.callback(hook.remove)
            return _metric(model(**inputs)).mean()
        attn = getattr(blk, spec["attn"])
        kind, h = "qkv".index(reader.rsplit(".", 1)[1][0]), int(reader.rsplit(".", 1)[1][1:])
        seen = {}

        def record(m, q, k, v):
            seen["t"] = (q, k, v)
            return q, k, v

        with contextlib.ExitStack() as first:  # the second run: the block's input with the change, its q/k/v kept
            first.callback(blk.register_forward_pre_hook(lambda m, a, kw: (
                ((a[0] + change, *a[1:]), kw) if a else (a, {**kw, "hidden_states": kw["hidden_states"] + change})),
                with_kwargs=True).remove)
            first.callback(attn.attention_hooks.add_input(record).remove)
            model(**inputs)
        new = seen["t"][kind][:, h]

        def put(m, q, k, v):
            t = [q, k, v]
            t[kind] = t[kind].clone()
            t[kind][:, h] = new  # (B, L, D): the one reader's
            return tuple(t)

        stack.callback(attn.attention_hooks.add_input(put).remove)
        return _metric(model(**inputs)).mean()


def _by_hand(model, spec, base_in, caps, edge, *, grad=False) -> float:
    """Exact edge patching written out (t = 1); with ``grad``, its derivative along the change at t = 0 (EAP).
    ``caps``: the base and the source run's captures."""
    base, src = caps
    t = torch.tensor(0.0 if grad else 1.0, dtype=torch.float32, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        value = _patched(model, spec, base_in, edge[1], _change(model, spec, base, src, edge[0], t), base)
    return float(torch.autograd.grad(value, t)[0]) if grad else float(value)


def _edges(g, parallel: bool):
    a0, a1 = g.units[0].attn, g.units[1].attn
    m0, m1 = g.units[0].mlp, g.units[1].mlp
    chosen = [("embed", f"{a0}.q1"), ("embed", f"{a1}.k0"), (f"{a0}.h2", f"{a1}.q3"), (f"{a0}.h1", f"{a1}.k1"),
              (f"{a0}.h3", f"{a1}.v0"), (f"{a0}.h0", f"{m1}.in"), (m0, f"{a1}.q0"), (f"{a1}.h1", "logits"),
              (m1, "logits"), (f"{a0}.h2", "logits"), ("embed", f"{m0}.in"), (m0, f"{m1}.in")]
    if not parallel:
        chosen.append((f"{a1}.h2", f"{m1}.in"))
    return chosen


@pytest.mark.parametrize("family", FAMILIES)
def test_each_edge_patched_equals_the_patch_written_out_and_eap_its_derivative(family):
    """Per family: patch_edges' metric on a dozen edges (every kind of writer into every kind of reader) equals the
    patch written out with hooks on the model's own modules, within float rounding; EAP's score of each equals that
    patch's derivative along the writer's change (through the norm after the attention, where there is one); parallel
    blocks have no edge from a head into its own layer's MLP; no edge kept gives the corrupted run, every edge the
    clean one."""
    import multihead.hf as mhf

    model, spec = _family(family)
    model = mhf.attach(model.eval())
    clean, corrupted = _inputs()
    g = heads.circuit_graph(model, clean)
    parallel = family in ("neox", "gptj")
    a0, m0 = g.units[0].attn, g.units[0].mlp
    assert ((f"{a0}.h0", f"{m0}.in") in g.edges) is not parallel
    assert (g.units[0].attn_post is not None) is (spec["post"] is not None)
    chosen = _edges(g, parallel)
    exact = heads.patch_edges(model, clean, corrupted, _metric, chosen, chunk=5)
    s = heads.edge_attribution(model, clean, corrupted, _metric)
    est = s.scores[g.index(chosen)]
    caps = _capture(model, spec, corrupted), _capture(model, spec, clean)
    for e, v, eap in zip(chosen, exact.scores.tolist(), est.tolist(), strict=True):
        assert v + exact.base == pytest.approx(_by_hand(model, spec, corrupted, caps, e), abs=1e-6), e
        assert eap == pytest.approx(_by_hand(model, spec, corrupted, caps, e, grad=True), abs=1e-7, rel=1e-5), e
    assert exact.scores.abs().max() > 1e-3 and est.abs().max() > 1e-3  # the edges move the metric
    none = heads.faithfulness(model, clean, corrupted, _metric, [])
    every = heads.faithfulness(model, clean, corrupted, _metric, s.edges)
    assert abs(none.circuit - none.empty) < 1e-5 and abs(every.circuit - every.full) < 1e-5
    assert abs(none.full - none.empty) > 1e-3


def test_a_post_norm_encoder_is_refused_by_name_before_any_forward():
    """BERT's layers renormalise the whole stream after each add (LayerNorm(x + attention(x))): no reader's input is
    a sum of writes, so the graph is refused, naming the block class and why, in one line, before any forward."""
    import multihead.hf as mhf

    model = mhf.attach(T.BertForMaskedLM(T.BertConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=2, num_attention_heads=4)).eval())
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    ids = {"input_ids": torch.randint(0, 50, (1, 6))}
    for fn, a in ((heads.circuit_graph, (model, ids)),
                  (heads.edge_attribution, (model, ids, ids, lambda out: out.logits[:, -1, 0]))):
        with pytest.raises(ValueError, match=r"^bert.encoder.layer.0.attention.self sits in a BertAttention, a post-"
                                             r"norm encoder: LayerNorm\(x \+ attention\(x\)\) renormalises") as e:
            fn(*a)
        assert "\n" not in str(e.value) and not calls


def test_a_block_without_its_parallel_flag_is_refused_by_name():
    """A GPT-NeoX layer whose use_parallel_residual is not a boolean: the graph cannot tell how its MLP reads the
    stream, and says so before any forward."""
    import multihead.hf as mhf

    model, _ = _family("neox")
    model = mhf.attach(model.eval())
    model.gpt_neox.layers[1].use_parallel_residual = None
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    ids = {"input_ids": torch.randint(0, 50, (1, 6))}
    with pytest.raises(ValueError, match=r"^gpt_neox.layers.1 is a GPTNeoXLayer without a boolean "
                                         r"'use_parallel_residual'"):
        heads.circuit_graph(model, ids)
    assert not calls

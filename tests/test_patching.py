"""Activation patching per head (heads.patch): batched patches equal one patched forward per head, written here
independently through each module's hook list; per position, both directions, any chunk size; bad input refused
before any patched forward."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import multihead
from multihead import MultiHeadAttention, heads
from multihead.models.induction import AttentionOnly, train_induction
from multihead.models.induction import repeat_loss as _repeat_loss
from multihead.models.induction import repeated as _repeated


class TwoLayers(nn.Module):
    """Tokens -> embedding + positions -> two attention layers (residual) -> logits."""

    def __init__(self, V=11, E=16, H=4, L=6):
        super().__init__()
        self.embed, self.pos = nn.Embedding(V, E), nn.Parameter(torch.randn(L, E) * 0.5)
        self.layers = nn.ModuleList(MultiHeadAttention(E, H) for _ in range(2))
        self.out = nn.Linear(E, V)

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]  # (B, L, E)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)  # (B, L, V)


def _model():
    torch.manual_seed(0)
    m = TwoLayers().eval()
    m(torch.zeros(1, 6, dtype=torch.long))  # builds the lazy layers
    return m


def _logit_diff(out):  # (B,): the last position's logit of token 3 minus token 5
    return out[:, -1, 3] - out[:, -1, 5]


def _one_at_a_time(model, base, source, name, h, pos=None):
    """One forward: the base run with head h of module ``name`` (at ``pos``, or everywhere) from the source run."""
    mod = dict(model.named_modules())[name]
    kept = {}

    def keep(m, out, live):
        kept["out"] = out.detach().clone()
        return out

    handle = mod.attention_hooks.add_transform(keep)
    with torch.no_grad():
        model(source)
    handle.remove()

    def put(m, out, live):
        out = out.clone()
        if pos is None:
            out[:, :, h] = kept["out"][:, :, h]
        else:
            out[:, pos, h] = kept["out"][:, pos, h]
        return out

    handle = mod.attention_hooks.add_transform(put)
    with torch.no_grad():
        v = _logit_diff(model(base)).mean()
    handle.remove()
    return float(v)


def test_batched_patches_equal_one_forward_per_head_in_both_directions_and_per_position():
    model = _model()
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 11, (2, 6), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 4) % 11
    for direction, base, source in (("denoise", corrupted, clean), ("noise", clean, corrupted)):
        r = heads.patch(model, clean, corrupted, _logit_diff, direction=direction, chunk=3)
        assert list(r.values) == ["layers.0", "layers.1"] and r.values["layers.0"].shape == (4,)
        with torch.no_grad():
            assert r.base == pytest.approx(float(_logit_diff(model(base)).mean()), abs=1e-6)
            assert r.source == pytest.approx(float(_logit_diff(model(source)).mean()), abs=1e-6)
        for name, v in r.values.items():
            want = torch.tensor([_one_at_a_time(model, base, source, name, h) for h in range(4)], dtype=torch.float64)
            assert torch.allclose(v, want, atol=1e-5), (direction, name, v, want)
        assert not torch.allclose(r.values["layers.0"], torch.full((4,), r.base, dtype=torch.float64))
    per = heads.patch(model, clean, corrupted, _logit_diff, positions=True, modules=["layers.1"], chunk=5)
    assert per.values["layers.1"].shape == (4, 6) and list(per.values) == ["layers.1"]
    for h, pos in ((0, 5), (3, 2), (2, 0)):
        assert per.values["layers.1"][h, pos] == pytest.approx(
            _one_at_a_time(model, corrupted, clean, "layers.1", h, pos), abs=1e-5)
    whole = heads.patch(model, clean, corrupted, _logit_diff, chunk=100)  # every patch in one forward
    assert torch.allclose(heads.patch(model, clean, corrupted, _logit_diff, chunk=1).values["layers.1"],
                          whole.values["layers.1"], atol=1e-6)
    same = heads.patch(model, clean, clean, _logit_diff)  # nothing differs: every patch gives the base
    assert all(torch.allclose(v, torch.full_like(v, same.base), atol=1e-6) for v in same.values.values())
    assert "| layers.0 |" in whole.to_markdown() and whole.grid().shape == (2, 4)


def _by_hand(model, ids, *, outs=None, inputs=None):
    """TwoLayers written out (no hooks, no multihead): per layer the per-head q, k, v (B, H, L, D) and outputs
    (B, L, H, D). ``outs[i]``: a function replacing layer i's per-head outputs; ``inputs[i]``: replacing its (q, k, v).
    Returns (logits, [(q, k, v) per layer], [outputs per layer])."""
    x = model.embed(ids) + model.pos[: ids.shape[1]]  # (B, L, E)
    B, L, E = x.shape
    qkvs, heads_out = [], []
    for i, layer in enumerate(model.layers):
        H = layer.num_heads
        q, k, v = (p(x).view(B, L, H, E // H).transpose(1, 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        if inputs is not None and i in inputs:
            q, k, v = inputs[i](q, k, v)
        qkvs.append((q, k, v))
        w = ((q @ k.transpose(-1, -2)) / (E // H) ** 0.5).softmax(-1)  # (B, H, L, L): no mask
        o = (w @ v).transpose(1, 2)  # (B, H, L, D) -> (B, L, H, D)
        if outs is not None and i in outs:
            o = outs[i](o)
        heads_out.append(o)
        x = x + layer.o_proj(o.reshape(B, L, E))
    return model.out(x), qkvs, heads_out


def _path_by_hand(model, base, source, sender: int, through: str, receivers: list[int]) -> float:
    """Path patching from layer 0's head ``sender`` to layer 1's ``receivers`` through ``through``, by hand."""
    with torch.no_grad():
        _, _, base_o = _by_hand(model, base)
        _, _, src_o = _by_hand(model, source)

        def freeze(i):
            def f(o):
                o = base_o[i].clone()
                if i == 0:
                    o[:, :, sender] = src_o[0][:, :, sender]
                return o
            return f

        _, run1, _ = _by_hand(model, base, outs={0: freeze(0), 1: freeze(1)})

        def put(q, k, v):
            new = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
            for h in receivers:
                for x, old in zip("qkv", run1[1]):
                    if x in through:
                        new[x][:, h] = old[:, h]
            return new["q"], new["k"], new["v"]

        logits, _, _ = _by_hand(model, base, inputs={1: put})
    return float(_logit_diff(logits).mean())


def test_path_patching_equals_the_two_runs_written_out_by_hand():
    """heads.path_patch: each layer-0 head's effect through the queries, keys or values of chosen layer-1 heads,
    every other head frozen at the base run, batched, equals the same two runs written out by hand without hooks;
    a sender after its receivers (or in the same layer) moves nothing; bad receivers are refused."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 11, (2, 6), generator=g)
    corrupted = clean.clone()
    corrupted[:, 1:3] = (corrupted[:, 1:3] + 4) % 11
    with torch.no_grad():
        assert (_by_hand(model, clean)[0] - model(clean)).abs().max() < 1e-5  # the written-out model is the model
    for direction, base, source in (("denoise", corrupted, clean), ("noise", clean, corrupted)):
        for through, recv in (("k", [1]), (("q", "v"), [0, 3]), (("q", "k", "v"), [0, 1, 2, 3])):
            r = heads.path_patch(model, clean, corrupted, _logit_diff, {"layers.1": recv}, through=through,
                                 direction=direction, chunk=3)
            want = torch.tensor([_path_by_hand(model, base, source, h, through, recv) for h in range(4)],
                                dtype=torch.float64)
            assert torch.allclose(r.values["layers.0"], want, atol=1e-5), (direction, through, r.values, want)
            assert torch.allclose(r.values["layers.1"], torch.full((4,), r.base, dtype=torch.float64), atol=1e-6)
        assert not torch.allclose(want, torch.full((4,), r.base, dtype=torch.float64), atol=1e-4)  # a path mattered
    with pytest.raises(ValueError, match=r"receivers\['layers.1'\] must name heads in \[0, 3\]; got \[4\]"):
        heads.path_patch(model, clean, corrupted, _logit_diff, {"layers.1": [4]})
    with pytest.raises(ValueError, match=r"receiver 'layers.9' is not an attention module multihead sees"):
        heads.path_patch(model, clean, corrupted, _logit_diff, {"layers.9": [0]})
    with pytest.raises(ValueError, match=r"through must name the receivers' inputs among 'q', 'k', 'v'; got \('o',\)"):
        heads.path_patch(model, clean, corrupted, _logit_diff, {"layers.1": [0]}, through="o")


def test_bad_input_is_refused_before_any_patched_forward():
    model = _model()
    a, b = torch.randint(0, 11, (1, 6)), torch.randint(0, 11, (1, 5))
    with pytest.raises(ValueError, match=r"layers.0: the clean and corrupted runs give its heads' outputs of shapes "
                                         r"\(1, 6, 4, 4\) and \(1, 5, 4, 4\).*same length; pad the shorter"):
        heads.patch(model, a, b, _logit_diff)
    with pytest.raises(ValueError, match=r"metric must return a scalar or a \(1,\) tensor .*got Tensor of shape "
                                         r"\(1, 6, 11\)"):
        heads.patch(model, a, a, lambda out: out)
    with pytest.raises(ValueError, match=r"no multihead attention module named 'layers.7'; modules: \['layers.0', "):
        heads.patch(model, a, a, _logit_diff, modules=["layers.7"])
    with pytest.raises(ValueError, match=r"chunk must be a whole number >= 1"):
        heads.patch(model, a, a, _logit_diff, chunk=0)
    with pytest.raises(ValueError, match=r"direction must be 'denoise'"):
        heads.patch(model, a, a, _logit_diff, direction="both")


@functools.lru_cache(maxsize=1)
def _trained_induction() -> AttentionOnly:
    """Olsson et al.'s 2-layer attention-only model trained on random tokens repeated once
    (:func:`multihead.models.induction.train_induction`), once per process (the circuits tests read the same model):
    a fresh copy is returned to each caller."""
    model = train_induction()
    ids = _repeated(torch.Generator().manual_seed(1), 64)
    with torch.no_grad():
        assert _repeat_loss(model(ids), ids).mean().item() < 0.15, "the induction circuit did not form"
    return model


def trained_induction() -> AttentionOnly:
    """A copy of :func:`_trained_induction`'s model, in eval mode."""
    return copy.deepcopy(_trained_induction())


def test_patching_finds_the_induction_head_of_a_model_trained_here():
    """A known circuit (Olsson et al. 2022): trained on random tokens repeated once, the second layer forms an induction
    head (it attends from a repeated token to the token after that token's first occurrence). Noising each head
    (the clean run, that head's output from a run whose first half is other tokens) ranks that head first, far
    ahead of every other, and it is the head with the highest induction score (measured on the captured weights)."""
    model = trained_induction()
    clean = _repeated(torch.Generator().manual_seed(9), 8)
    with torch.no_grad(), multihead.capture(model) as cap:
        model(clean)
    t = torch.arange(17, 32)
    induction = cap["layers.1"][:, :, t, t - 15].mean((0, 2))  # (H,): weight on the token after the first occurrence
    corrupted = clean.clone()
    corrupted[:, :16] = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(5))
    r = heads.patch(model, clean, corrupted, lambda out: _repeat_loss(out, clean), direction="noise")
    rise = r.grid() - r.base  # (2, H): how much each head, corrupted alone, raises the loss
    top = int(rise.flatten().argmax())
    assert top // 4 == 1 and top % 4 == int(induction.argmax()), (rise, induction)
    assert rise.flatten().sort().values[-1] > 2 * rise.flatten().sort().values[-2], rise
    assert induction.max() > 0.5, induction
    # the circuit's other half: the induction head finds its key through a previous-token head of layer 0
    # (K-composition). Path patching layer 0's heads into the induction head's keys only ranks that head first.
    previous = cap["layers.0"][:, :, torch.arange(1, 32), torch.arange(0, 31)].mean((0, 2))  # (H,): weight on t - 1
    ind = int(induction.argmax())
    path = heads.path_patch(model, clean, corrupted, lambda out: _repeat_loss(out, clean), {"layers.1": [ind]},
                            through="k", senders=["layers.0"], direction="noise")
    via_k = path.values["layers.0"] - path.base  # (H,): the loss each layer-0 head raises through those keys alone
    uniform = (1.0 / torch.arange(2, 33, dtype=torch.float64)).mean()  # a causal row's even share, over t = 1..31
    assert int(previous.argmax()) in via_k.argsort(descending=True)[:2].tolist(), (via_k, previous)  # among the top
    assert previous[int(via_k.argmax())] > 1.5 * uniform, (via_k, previous)  # the top path's head looks back
    via_q = heads.path_patch(model, clean, corrupted, lambda out: _repeat_loss(out, clean), {"layers.1": [ind]},
                             through="q", senders=["layers.0"], direction="noise").values["layers.0"] - path.base
    assert via_k.sum() > 2 * via_q.sum(), (via_k, via_q)  # keys, not queries, carry the previous token


class Continuous(nn.Module):
    """Two attention layers (residual) on continuous inputs (B, L, E): a small change of the input is a small patch."""

    def __init__(self, E=16, H=4):
        super().__init__()
        self.layers = nn.ModuleList(MultiHeadAttention(E, H) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_attribution_patching_is_the_first_order_of_real_patching():
    """For a small corruption, attribution patching (one forward, one backward) agrees with real patching to first
    order, in both directions and per position; it reaches no parameter's .grad. A metric not computed from the
    output is refused."""
    torch.manual_seed(0)
    model = Continuous().eval()
    clean = torch.randn(2, 5, 16)
    model(clean)
    corrupted = clean + 1e-3 * torch.randn(2, 5, 16)

    def metric(out):
        return out[:, -1, 0]

    for direction in ("denoise", "noise"):
        for positions in (False, True):
            real = heads.patch(model, clean, corrupted, metric, direction=direction, positions=positions)
            est = heads.attribution(model, clean, corrupted, metric, direction=direction, positions=positions)
            assert est.base == pytest.approx(real.base, abs=1e-6) and est.source == pytest.approx(real.source, abs=1e-6)
            effect = max(float((v - real.base).abs().max()) for v in real.values.values())
            agree = est.agreement(real)
            assert effect > 1e-5 and agree["max_abs_diff"] < 0.02 * effect and agree["pearson"] > 0.999, agree
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="metric must return a tensor computed from the model's output"):
        heads.attribution(model, clean, corrupted, lambda out: 1.0)


def tiny_gpt2(tmp_path):
    """A tiny GPT-2 (2 layers x 4 heads, E 32) with a word-level tokenizer, saved in tmp_path/ckpt as a --hf folder:
    (folder, model, vocabulary)."""
    T = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "when mary and john went out gave a drink to".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                           bos_token_id=0, eos_token_id=0)).eval()
    d = tmp_path / "ckpt"
    model.save_pretrained(d)
    T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(d)
    return d, model, vocab


def test_the_patch_command_writes_what_heads_patch_computes(tmp_path, capsys, monkeypatch):
    """multihead patch --hf DIR on a tiny GPT-2 saved here (word-level tokenizer): its patching.json loads back equal
    to heads.patch on the same model in memory, and the picture is written; texts of different token counts and a
    malformed metric are refused in one line, exit 2."""
    import json

    import multihead.hf as mhf
    from multihead_cli import main

    d, model, vocab = tiny_gpt2(tmp_path)
    clean, corrupted = "when mary and john went out john gave a drink to", "when mary and john went out mary gave a " \
        "drink to"
    out = tmp_path / "patch"
    runs = []
    real_patch = heads.patch
    monkeypatch.setattr(heads, "patch", lambda *a, **kw: runs.append(kw.get("run")) or real_patch(*a, **kw))
    assert main(["patch", "--hf", str(d), "--clean", clean, "--corrupted", corrupted, "--metric", "logit-diff:mary,john",
                 "--out", str(out), "--chunk", "3"]) == 0
    assert runs[0](lambda **kw: kw, {"input_ids": 1}) == {"input_ids": 1, "logits_to_keep": 1}  # the last logits only
    got = json.loads((out / "patching.json").read_text())
    assert (out / "patching.png").stat().st_size > 1000 and "| transformer.h.1.attn |" in (out / "patching.md").read_text()
    page = (out / "patching.html").read_text()  # the explorer of the clean run, each head with its effect
    assert '"patching":{"label":"denoise' in page and '"transformer.h.1.attn":[' in page
    mhf.attach(model)
    ids = {t: {"input_ids": torch.tensor([[vocab[w] for w in t.split()]]),
               "attention_mask": torch.ones(1, len(t.split()), dtype=torch.long)} for t in (clean, corrupted)}
    r = heads.patch(model, ids[clean], ids[corrupted], lambda o: o.logits[:, -1, vocab["mary"]] - o.logits[:, -1,
                                                                                                        vocab["john"]])
    assert got["base"] == pytest.approx(r.base, abs=1e-6) and got["source"] == pytest.approx(r.source, abs=1e-6)
    for n, v in r.values.items():
        assert torch.allclose(torch.tensor(got["values"][n], dtype=torch.float64), v, atol=1e-6), n
    capsys.readouterr()
    for argv, said in (([clean, "when mary went out"], "is 11 tokens and --corrupted 4"),
                       ([clean, corrupted, "logit-diff:mary"], "--metric takes logit-diff:TOKEN_A,TOKEN_B or loss")):
        metric = argv[2] if len(argv) > 2 else "loss"
        assert main(["patch", "--hf", str(d), "--clean", argv[0], "--corrupted", argv[1], "--metric", metric,
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_a_module_called_twice_in_one_forward_is_refused():
    """A layer shared across the stack (ALBERT's, or a loop) has one output per call: patching it is refused by
    name, before any patched forward."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = MultiHeadAttention(16, 4)

        def forward(self, x):
            return self.attn(x + self.attn(x))

    torch.manual_seed(0)
    model = Twice().eval()
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"attn is called more than once in one forward"):
        heads.patch(model, x, x + 1, lambda out: out[:, -1, 0])
    with pytest.raises(ValueError, match=r"attn is called more than once in one forward"):
        heads.path_patch(model, x, x + 1, lambda out: out[:, -1, 0], {"attn": [0]})

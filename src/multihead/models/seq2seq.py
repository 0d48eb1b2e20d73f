"""An encoder-decoder Transformer built from multihead modules, and a generated
task with a known alignment: reversing digit strings (target token t copies
source token len-1-t, so cross-attention should look there)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import masks
from multihead.heads.capture import capture
from multihead.models import checkpoint
from multihead.models.layers import DecoderBlock, EncoderBlock, sinusoidal_positions

PAD, BOS, EOS, DIGIT0 = 0, 1, 2, 3


@dataclass
class Seq2SeqConfig:
    vocab_size: int = 13  # PAD, BOS, EOS and the ten digits
    d_model: int = 64
    heads: int = 4
    ffn: int = 128
    encoder_layers: int = 2
    decoder_layers: int = 2
    max_len: int = 32
    dropout: float = 0.1


class Seq2SeqTransformer(nn.Module):
    """forward(src (B, S), src_lens (B,), tgt_in (B, T)) -> logits (B, T, vocab).
    Source padding is masked with the course's valid_lens; the decoder's
    self-attention is causal."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.config = cfg
        E = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, E, padding_idx=PAD)
        self.register_buffer("pos", sinusoidal_positions(cfg.max_len, E), persistent=False)
        self.encoder = nn.ModuleList(EncoderBlock(E, cfg.heads, cfg.ffn, cfg.dropout) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderBlock(E, cfg.heads, cfg.ffn, cfg.dropout) for _ in range(cfg.decoder_layers))
        self.norm_enc, self.norm_dec = nn.LayerNorm(E), nn.LayerNorm(E)
        self.out = nn.Linear(E, cfg.vocab_size)

    def _embed(self, ids: Tensor, start: int = 0) -> Tensor:
        return self.embed(ids) * self.config.d_model**0.5 + self.pos[start: start + ids.shape[1]]  # (B, L, E)

    def encode(self, src: Tensor, src_lens: Tensor) -> Tensor:
        x = self._embed(src)
        for block in self.encoder:
            x = block(x, src_lens)
        return self.norm_enc(x)  # (B, S, E)

    def decode(self, tgt_in: Tensor, memory: Tensor, src_lens: Tensor, cache=None, start: int = 0) -> Tensor:
        """tgt_in (B, T) -> logits (B, T, vocab). With a :class:`multihead.KVCache`, tgt_in holds
        the positions from ``start`` on; the earlier ones are in the cache."""
        y = self._embed(tgt_in, start)
        causal = masks.Causal()
        for block in self.decoder:
            y = block(y, memory, src_lens, causal, cache)
        return self.out(self.norm_dec(y))  # (B, T, vocab)

    def forward(self, src: Tensor, src_lens: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode(tgt_in, self.encode(src, src_lens), src_lens)

    @torch.no_grad()
    def greedy(self, src: Tensor, src_lens: Tensor, steps: int, *, use_cache: bool = True) -> Tensor:
        """Greedy decoding -> (B, steps) token ids. With ``use_cache`` each step feeds only the
        newest token through a :class:`multihead.KVCache`; without it every step recomputes
        the whole prefix."""
        from multihead.layer.cache import KVCache

        memory = self.encode(src, src_lens)
        ys = torch.full((src.shape[0], 1), BOS, dtype=torch.long)
        cache = KVCache(self, src.shape[0], steps + 1) if use_cache else None
        for t in range(steps):
            if cache is not None:
                logits = self.decode(ys[:, -1:], memory, src_lens, cache, start=t)  # (B, 1, vocab)
            else:
                logits = self.decode(ys, memory, src_lens)  # (B, t+1, vocab)
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            ys = torch.cat([ys, nxt], 1)
        return ys[:, 1:]


#: the digit strings' lengths the reverser is trained on (and the only ones it is asked to reverse)
MIN_DIGITS, MAX_DIGITS = 3, 10


def reverse_batch(n: int, *, min_len: int = MIN_DIGITS, max_len: int = MAX_DIGITS,
                  generator: torch.Generator | None = None):
    """Digit strings and their reversals -> src (n, S), src_lens (n,), tgt_in (n, T), tgt_out (n, T).
    tgt_out[t] = src[len-1-t] for t < len, then EOS; padding is PAD."""
    lens = torch.randint(min_len, max_len + 1, (n,), generator=generator)
    digits = torch.randint(0, 10, (n, max_len), generator=generator) + DIGIT0
    pos = torch.arange(max_len)
    src = torch.where(pos < lens[:, None], digits, PAD)  # (n, S)
    rev_idx = (lens[:, None] - 1 - pos).clamp_min(0)  # (n, S)
    rev = torch.where(pos < lens[:, None], src.gather(1, rev_idx), PAD)
    tgt_out = torch.cat([rev, torch.full((n, 1), PAD)], 1)  # (n, S+1)
    tgt_out[torch.arange(n), lens] = EOS
    tgt_in = torch.cat([torch.full((n, 1), BOS), tgt_out[:, :-1]], 1)
    tgt_in = torch.where(tgt_in == EOS, PAD, tgt_in)
    return src, lens, tgt_in, tgt_out


def train_reverser(*, steps: int = 1000, batch: int = 64, seed: int = 0, progress: bool = True,
                   cfg: Seq2SeqConfig | None = None, lr: float = 8e-3) -> Seq2SeqTransformer:
    """Train the Transformer to reverse digit strings (~35-50 s on 2 cores; AdamW's fused CPU step, 1.27x
    faster a step than its per-tensor loop here, same losses). With the defaults 97-99% of held-out strings are
    reversed right (99.4% of digits) and the last decoder layer's cross-attention (mean over heads) lands on the
    aligned source position for ~95% of target tokens (1500 steps of 128 at 5e-3: ~99%, in 3x the time)."""
    from multihead.extras import progress as progress_bar

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = Seq2SeqTransformer(cfg or Seq2SeqConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    bar = progress_bar(range(steps), desc="transformer (reverse digits)", enabled=progress)
    for _ in bar:
        src, lens, tgt_in, tgt_out = reverse_batch(batch, generator=g)
        logits = model(src, lens, tgt_in)
        loss = F.cross_entropy(logits.transpose(1, 2), tgt_out, ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval()


def alignment(model: Seq2SeqTransformer, n: int = 500, seed: int = 123) -> tuple[float, float]:
    """(sequence accuracy of greedy decoding, share of target tokens whose last-layer
    cross-attention (mean over heads) peaks on the aligned source position)."""
    src, lens, tgt_in, tgt_out = reverse_batch(n, generator=torch.Generator().manual_seed(seed))
    pred = model.greedy(src, lens, tgt_in.shape[1])
    pos = torch.arange(tgt_in.shape[1])
    valid = pos[None] < lens[:, None]  # (n, T): target tokens that copy a source digit
    seq_ok = ((pred == tgt_out) | ~valid).all(1).float().mean().item()
    last = f"decoder.{len(model.decoder) - 1}.cross_attn"
    with torch.no_grad(), capture(model, include=[last]) as cap:
        model(src, lens, tgt_in)
    peak = cap[last].mean(1).argmax(-1)  # (n, T)
    aligned = ((peak == lens[:, None] - 1 - pos[None]) & valid).sum().item() / valid.sum().item()
    return seq_ok, aligned


def digit_accuracy(model: Seq2SeqTransformer, n: int = 500, seed: int = 123) -> float:
    """Share of target digits right under greedy decoding (gentler than whole sequences)."""
    src, lens, tgt_in, tgt_out = reverse_batch(n, generator=torch.Generator().manual_seed(seed))
    pred = model.greedy(src, lens, tgt_in.shape[1])
    valid = torch.arange(tgt_in.shape[1])[None] < lens[:, None]  # (n, T)
    return ((pred == tgt_out) & valid).sum().item() / valid.sum().item()


def load_or_train(ckpt: Path, retrain: bool = False) -> Seq2SeqTransformer:
    """The digit-reversing Transformer: loaded from the checkpoint ``ckpt`` or trained (and saved there)."""
    if (ckpt / "model.safetensors").exists() and not retrain:
        print(f"transformer: loaded {ckpt}")
        return checkpoint.load(Seq2SeqTransformer, Seq2SeqConfig, ckpt)
    import time

    print(f"transformer: no checkpoint in {ckpt}; training it first (under a minute on 2 cores), then saving it "
          "there for the next command", flush=True)
    t0 = time.perf_counter()
    model = train_reverser()
    checkpoint.save(model, ckpt)
    print(f"transformer: trained in {time.perf_counter() - t0:.0f} s, saved to {ckpt}")
    return model

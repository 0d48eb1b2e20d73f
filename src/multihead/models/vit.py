"""A Vision Transformer built from multihead modules, trained on scikit-learn's
bundled 8x8 digits (no download)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.models import checkpoint
from multihead.models.layers import EncoderBlock


@dataclass
class ViTConfig:
    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    num_classes: int = 10
    d_model: int = 64
    heads: int = 4
    ffn: int = 128
    layers: int = 3
    dropout: float = 0.1


class ViT(nn.Module):
    """images (B, C, h, w) -> logits (B, classes). Tokens: [CLS] then the
    (h/p) x (w/p) patches in row-major order."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image_size={cfg.image_size} must be a multiple of patch_size={cfg.patch_size}.")
        self.config = cfg
        self.grid = cfg.image_size // cfg.patch_size
        E = cfg.d_model
        self.patch = nn.Linear(cfg.channels * cfg.patch_size**2, E)
        self.cls = nn.Parameter(torch.zeros(1, 1, E))
        self.pos = nn.Parameter(torch.randn(1, 1 + self.grid**2, E) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(E, cfg.heads, cfg.ffn, cfg.dropout) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(E)
        self.head = nn.Linear(E, cfg.num_classes)

    def patches(self, images: Tensor) -> Tensor:
        """(B, C, h, w) -> (B, N, C*p*p), N = (h/p)*(w/p), row-major."""
        B, C, _, _ = images.shape
        p, g = self.config.patch_size, self.grid
        x = images.reshape(B, C, g, p, g, p)  # (B, C, h, w) -> (B, C, g, p, g, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(B, g * g, C * p * p)  # -> (B, N, C*p*p)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch(self.patches(images))  # (B, N, E)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos  # (B, 1+N, E)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))  # (B, classes)


def digits(seed: int = 0):
    """scikit-learn's 8x8 digits -> (train_x, train_y, test_x, test_y); x (n, 1, 8, 8) in [0, 1]."""
    from multihead.extras import require

    load_digits = require("sklearn.datasets", "the digits data set").load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0  # (n, 1, 8, 8)
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


def train_vit(*, epochs: int = 25, batch: int = 64, seed: int = 0, progress: bool = True,
              cfg: ViTConfig | None = None) -> tuple[ViT, float]:
    """Train on the digits; returns (model, test accuracy)."""
    from multihead.extras import progress as progress_bar

    torch.manual_seed(seed)
    xtr, ytr, xte, yte = digits(seed)
    model = ViT(cfg or ViTConfig())
    steps = epochs * ((len(ytr) + batch - 1) // batch)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, fused=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    bar = progress_bar(range(epochs), desc="ViT (8x8 digits)", enabled=progress)
    for _ in bar:
        model.train()
        perm = torch.randperm(len(ytr), generator=g)
        for i in range(0, len(ytr), batch):
            idx = perm[i:i + batch]
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx], label_smoothing=0.05)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval(), accuracy(model, xte, yte)


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    model.eval()
    return (model(x).argmax(-1) == y).float().mean().item()


def load_or_train(ckpt: Path, retrain: bool = False) -> ViT:
    """The digits ViT: loaded from the checkpoint ``ckpt`` or trained (and saved there)."""
    if (ckpt / "model.safetensors").exists() and not retrain:
        print(f"ViT: loaded {ckpt}")
        return checkpoint.load(ViT, ViTConfig, ckpt)
    import time

    print(f"ViT: no checkpoint in {ckpt}; training it first (about 20 s on 2 cores), then saving it there for the "
          "next command", flush=True)
    t0 = time.perf_counter()
    model, _ = train_vit()
    checkpoint.save(model, ckpt)
    print(f"ViT: trained in {time.perf_counter() - t0:.0f} s, saved to {ckpt}")
    return model

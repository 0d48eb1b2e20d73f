"""Multi-head self-attention as the from-scratch ViT notebook builds it, in our own words,
with the notebook's two bugs kept on purpose: the scores are divided by d_k (not
sqrt(d_k)), and the values are multiplied by the raw scores (the softmax'ed weights are
computed but not used). It still trains, which is why nobody notices.

    .venv/bin/multihead check examples/vit_notebook_attention.py:NotebookMHSA \\
        --init "d_model=32, num_head=4, d_k=8" --call x
"""

import torch
from torch import nn


class NotebookMHSA(nn.Module):
    def __init__(self, d_model, num_head, d_k):
        super().__init__()
        self.num_head, self.d_k = num_head, d_k
        self.query = nn.Linear(d_model, num_head * d_k)
        self.key = nn.Linear(d_model, num_head * d_k)
        self.value = nn.Linear(d_model, num_head * d_k)
        self.proj = nn.Linear(num_head * d_k, d_model)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.query(x).view(b, n, self.num_head, self.d_k).transpose(1, 2)
        k = self.key(x).view(b, n, self.num_head, self.d_k).transpose(1, 2)
        v = self.value(x).view(b, n, self.num_head, self.d_k).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / self.d_k  # bug 1: d_k, not sqrt(d_k)
        weights = torch.softmax(scores, dim=-1)  # computed ...
        out = scores @ v  # bug 2: ... but the values meet the raw scores
        del weights
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))

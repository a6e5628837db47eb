"""The lm workload's model: a decoder-only transformer in the GPT-2 layout.

Pre-norm blocks (LayerNorm, causal self-attention, LayerNorm, a GELU MLP 4x as wide), a
learned position embedding, and an output head whose weight is the token embedding's (tied,
as in GPT-2). No dropout: every data-parallel method then computes the same function of the
same batch, so their losses are comparable step for step. Attention goes through
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, which picks the fused
kernel of the device (flash or memory-efficient attention on a GPU). The sizes and their
counts: labkit.workloads.lm.sizes.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .sizes import Size


class Attention(nn.Module):
    """Multi-head causal self-attention: one qkv projection, the fused causal kernel, an
    output projection."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    """A pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    """A decoder-only transformer: forward(x: LongTensor[B, T]) -> logits [B, T, vocab].

    The output head's weight IS the token embedding's (tied, as in GPT-2): one parameter, one
    gradient, though the state_dict lists it twice (``tok.weight`` and ``head.weight``).
    Initialised as GPT-2 is: normal(0, 0.02) matrices, zero biases, and the residual
    projections (each block's ``attn.proj`` and ``proj``) at 0.02/sqrt(2·layers), so the
    residual stream's variance does not grow with depth.
    """

    def __init__(self, size: Size, vocab: int, seq_len: int):
        super().__init__()
        d = size.d_model
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, size.heads) for _ in range(size.layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                residual = name.endswith("proj.weight")
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * size.layers) if residual else 0.02)
            # LayerNorm weights keep their ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        if T > self.seq_len:
            raise ValueError(f"a sequence of {T} tokens is longer than the model's {self.seq_len} "
                             f"positions (--seq-len)")
        h = self.tok(x) + self.pos(torch.arange(T, device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def generate(model: Transformer, prompts: list[torch.Tensor], new_tokens: int, temperature: float,
             seed: int) -> list[list[int]]:
    """``new_tokens`` tokens sampled after each of the (equally long) ``prompts``, at
    ``temperature``, from a generator seeded with ``seed`` on the model's device: the same
    model and seed write the same text. In eval mode without gradients, the model's mode
    restored after; the context is the last ``model.seq_len`` tokens (no KV cache: a few
    hundred tokens of a small model take well under a second)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.stack(prompts).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(new_tokens):
                logits = model(x[:, -model.seq_len:])[:, -1].float() / temperature
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
                x = torch.cat([x, nxt], dim=1)
    finally:
        model.train(was_training)
    return x[:, len(prompts[0]):].tolist()

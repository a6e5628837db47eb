"""The lm workload's model: a decoder-only transformer in the GPT-2 layout.

Pre-norm blocks (LayerNorm, causal self-attention, LayerNorm, a GELU MLP 4x as wide), a
learned position embedding, and an output head whose weight is the token embedding's (tied,
as in GPT-2). No dropout: every data-parallel method then computes the same function of the
same batch, so their losses are comparable step for step. Attention goes through
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, which picks the fused
kernel of the device (flash or memory-efficient attention on a GPU). The sizes and their
counts: labkit.workloads.lm.sizes. With --weights a model starts from a state_dict a labkit lm
run saved (:func:`warm_start`), a file of another shape refused in one line.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.core.config import ConfigError

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


def read_state(path: str) -> dict[str, torch.Tensor]:
    """The state_dict in ``path`` (torch.load with weights_only: tensors only, no code run), as
    a labkit run saves its final model; one under "state_dict" or with DistributedDataParallel's
    ``module.`` or torch.compile's ``_orig_mod.`` prefixes reads the same. One line for a file
    that does not load or holds no state_dict of tensors."""
    if not os.path.isfile(path):
        raise ConfigError(f"--weights {path!r} not found")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line message
        raise ConfigError(f"--weights {path!r} is not a loadable state_dict ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]})") from None
    if isinstance(sd, Mapping) and isinstance(sd.get("state_dict"), Mapping):
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping) or not sd or not all(isinstance(v, torch.Tensor)
                                                         for v in sd.values()):
        raise ConfigError(f"--weights {path!r} does not hold a state_dict of tensors")
    return {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in sd.items()}


def warm_start(model: Transformer, path: str, what: str) -> None:
    """Load the state_dict in ``path`` into ``model`` (in place, its dtypes and device kept).
    One line (ConfigError) where the file does not fit the model ``what`` describes: the first
    tensor, in the model's order, the file lacks or holds in another shape (both shapes), or
    the first it holds that the model has not."""
    sd, own = read_state(path), model.state_dict()
    for name, t in own.items():
        if name not in sd:
            raise ConfigError(f"--weights {path!r} does not fit {what}: it has no {name} "
                              f"(saved from another --model?)")
        if tuple(sd[name].shape) != tuple(t.shape):
            raise ConfigError(f"--weights {path!r} does not fit {what}: {name} is "
                              f"{list(sd[name].shape)} in the file, {list(t.shape)} in the model")
    extra = [k for k in sd if k not in own]
    if extra:
        raise ConfigError(f"--weights {path!r} does not fit {what}: the file holds {len(extra)} "
                          f"tensor(s) the model has not, the first {extra[0]} (saved from another "
                          f"--model?)")
    model.load_state_dict(sd)


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

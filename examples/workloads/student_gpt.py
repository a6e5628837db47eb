"""A tiny decoder-only Transformer, written by hand: a complete labkit workload in one file.

Run it like a built-in workload, from the project folder (docs/workloads.md):

    labkit run ddp --workload examples/workloads/student_gpt.py:StudentGPT --nproc 2 --epochs 1
    labkit experiment --methods ddp,allreduce --workload examples/workloads/student_gpt.py:StudentGPT

Everything a language model needs is below, nothing borrowed from labkit's own ``lm``:

- the data: the Python source of a few standard-library modules, read as bytes (nothing to
  download, the same bytes on every machine with the same Python), one character a token,
  cut into windows of seq_len + 1 characters: x is a window's first seq_len, y the same
  shifted by one (the character to predict at every position);
- the model: token + position embeddings, pre-norm blocks (LayerNorm, multi-head causal
  self-attention, LayerNorm, MLP), a final LayerNorm and a linear head to the vocabulary.
  Attention is spelled out (q, k, v projections, scores, a causal mask, softmax) rather than
  calling torch's fused scaled_dot_product_attention, to see what it computes;
- the loss: mean cross-entropy over every token of the batch; AdamW to optimise it.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from labkit.workloads import Datasets, Figure, Workload

MODULES = ("functools", "heapq", "string", "textwrap")  # ~93 KB of Python source
VAL_SHARE = 0.1                          # the last 10% of the text is held out
D_MODEL, HEADS, LAYERS = 64, 4, 2        # tiny: a training step takes milliseconds on a CPU
SEQ_LEN, LR, WEIGHT_DECAY = 64, 3e-3, 0.1


@functools.lru_cache(maxsize=None)
def corpus() -> bytes:
    """The text: the standard-library modules' source files, in sorted order, as bytes."""
    files = (inspect.getsourcefile(importlib.import_module(m)) for m in sorted(MODULES))
    return b"".join(open(f, "rb").read() for f in files)


class CharWindows(Dataset):
    """Window i of a token stream: x = tokens[i*T : i*T+T], y = tokens[i*T+1 : i*T+T+1]."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.T = tokens, seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.T

    def __getitem__(self, i):
        start = i * self.T
        chunk = self.tokens[start:start + self.T + 1]
        return chunk[:-1], chunk[1:]  # the target is the input shifted by one character


class CausalSelfAttention(nn.Module):
    """Every position attends to itself and the positions before it, in ``heads`` heads."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        assert d % heads == 0, "d_model must split evenly into heads"
        self.heads, self.head_dim = heads, d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape
        # (B, T, d) -> (B, heads, T, head_dim): each head attends on its own slice of d
        split = lambda t: t.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, heads, T, T)
        # the causal mask: position t may not look at t+1, t+2, ... (the answers it predicts)
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = F.softmax(scores, dim=-1)  # each row sums to 1 over the visible positions
        y = weights @ v                      # (B, heads, T, head_dim)
        return self.out(y.transpose(1, 2).reshape(B, T, d))  # heads side by side again


class Block(nn.Module):
    """Pre-norm: x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """forward(x: LongTensor [B, T]) -> logits [B, T, vocab]."""

    def __init__(self, vocab: int, seq_len: int, d: int = D_MODEL, heads: int = HEADS,
                 layers: int = LAYERS):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)    # what the character is
        self.pos = nn.Embedding(seq_len, d)  # where it stands in the window
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.tok(x) + self.pos(positions)
        return self.head(self.ln_f(self.blocks(h)))


class StudentGPT(Workload):
    title = "character-level GPT (hand-written)"
    unit = "tokens"
    rate = "tokens/s"
    optimizer_name = "AdamW (constant learning rate)"
    figures = (Figure("val_loss", "validation loss", "nats/token", higher_is_better=False, short="loss"),)

    @classmethod
    def resolve(cls, cfg, cuda, trainers):
        # our own defaults, where the command line left them automatic (None)
        if cfg.seq_len is None:
            cfg.seq_len = SEQ_LEN
        if cfg.lr is None:
            cfg.lr = LR
        if cfg.weight_decay is None:
            cfg.weight_decay = WEIGHT_DECAY

    # ---- the data: every rank builds the same, the lab shards it over the trainers
    def vocabulary(self) -> list[int]:
        """The byte values the text uses, sorted: token id i is byte vocabulary()[i]."""
        return sorted(set(corpus()))

    def datasets(self) -> Datasets:
        text = corpus()
        ids = {b: i for i, b in enumerate(self.vocabulary())}
        tokens = torch.tensor([ids[b] for b in text], dtype=torch.long)
        cut = int(len(tokens) * (1 - VAL_SHARE))
        T = self.cfg.seq_len
        return Datasets(CharWindows(tokens[:cut], T), CharWindows(tokens[cut:], T), in_memory=True)

    # ---- the model and its loss
    def build_model(self):
        return GPT(len(self.vocabulary()), self.cfg.seq_len)

    def loss(self, output, target):
        # (B, T, vocab) and (B, T) -> one row per token: the mean over all B*T predictions
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    @property
    def units_per_sample(self) -> int:
        return self.cfg.seq_len  # a window holds seq_len tokens to predict

    # ---- validation: sums over batches and trainers first, then one average per token
    def val_sums(self, output, target):
        loss = F.cross_entropy(output.float().flatten(0, 1), target.flatten(), reduction="sum")
        return {"loss": loss, "count": torch.tensor(float(target.numel()), device=target.device)}

    def val_figures(self, sums):
        return {"val_loss": sums["loss"] / max(1.0, sums["count"])}

    # ---- optimisation
    def optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    @property
    def optimizer_state_per_value(self) -> int:
        return 2  # AdamW keeps two moments per weight (for the checkpoint's size)

    # ---- at the end: let the model write a little (greedy, from the validation text)
    def finish(self, model) -> dict:
        model = getattr(model, "module", model)  # DDP wraps it
        vocab = self.vocabulary()
        x = self.datasets().val[0][0][:16].unsqueeze(0).to(next(model.parameters()).device)
        prompt = x[0].tolist()
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for _ in range(80):
                nxt = model(x[:, -self.cfg.seq_len:])[:, -1].argmax(-1, keepdim=True)
                x = torch.cat([x, nxt], dim=1)
        model.train(was_training)
        text = lambda ids: bytes(vocab[i] for i in ids).decode("utf-8", errors="replace")  # noqa: E731
        return {"samples": [{"prompt": text(prompt), "text": text(x[0, len(prompt):].tolist())}]}

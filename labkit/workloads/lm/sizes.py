"""The lm workload's model sizes, and their parameter and FLOP counts as plain arithmetic, so
that the resource preflight and MFU need neither torch nor a built model.

``--model`` is a named size (:data:`SIZES`) or a shape ``LxDxH``: layers x width (d_model) x
attention heads, e.g. ``6x384x6``, three positive integers, the width a multiple of the heads
(each head is d/H wide). :func:`parse` turns either into a :class:`Size`; anything else is one
line (ConfigError) naming the problem and the syntax.

``gpt2`` is GPT-2 small: 124.4M parameters with its 50257-token vocabulary (124.5M padded to
50304), 86.0M with the byte-level vocabulary of 256 (the embedding's 38.4M fewer).
``shakespeare`` is nanoGPT's character-level Shakespeare model (config/train_shakespeare_char.py)
and the ``cs336-*`` sizes are the table of Stanford CS336's first assignment (GPT-2 small,
medium, large and XL's shapes, and a 2.7B one).
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

from labkit.core.config import ConfigError


#: the vocabulary of text read as bytes (the embedded and text datasets)
BYTE_VOCAB = 256
#: how a shape is written, for the one-line errors
SHAPE_SYNTAX = "LxDxH (layers x width x heads, the width a multiple of the heads, e.g. 6x384x6)"


class Size(NamedTuple):
    layers: int
    d_model: int
    heads: int

    @property
    def shape(self) -> str:
        """The size as --model writes a shape: "6x384x6"."""
        return f"{self.layers}x{self.d_model}x{self.heads}"


#: the model sizes --model names: layers, width, attention heads
SIZES = {
    "tiny": Size(2, 64, 2),
    "small": Size(4, 128, 4),
    "gpt2": Size(12, 768, 12),  # GPT-2 small (Radford et al., 2019)
    "shakespeare": Size(6, 384, 6),  # nanoGPT's character-level Shakespeare (Karpathy)
    "cs336-small": Size(12, 768, 12),  # Stanford CS336 (2025), assignment 1's table
    "cs336-medium": Size(24, 1024, 16),
    "cs336-large": Size(36, 1280, 20),
    "cs336-xl": Size(48, 1600, 25),
    "cs336-2.7b": Size(32, 2560, 32),
}

#: what --model may be, for the one-line errors
CHOICES = f"a size ({', '.join(SIZES)}) or a shape {SHAPE_SYNTAX}"
#: what looks like an attempt at a shape (digits and x's), rather than a misspelt name
_SHAPE_LIKE = re.compile(r"[\dx.+\-\s]*x[\dx.+\-\s]*")


def parse(model: str) -> Size:
    """The size ``model`` names: a key of :data:`SIZES`, or a shape ``LxDxH`` (case and
    surrounding spaces aside). ConfigError, one line, for anything else."""
    if model in SIZES:
        return SIZES[model]
    text = str(model).strip().lower()
    if not _SHAPE_LIKE.fullmatch(text):
        raise ConfigError(f"unknown model {model!r} for the lm workload; choose {CHOICES}")
    parts = text.split("x")
    if len(parts) != 3:
        raise ConfigError(f"--model {model!r} has {len(parts)} parts, not 3: a shape is "
                          f"{SHAPE_SYNTAX}")
    for what, part in zip(("layers", "width", "heads"), parts):
        if not part.strip().isdigit() or int(part) < 1:
            raise ConfigError(f"--model {model!r}: {what} {part.strip()!r} is not a positive "
                              f"integer; a shape is {SHAPE_SYNTAX}")
    size = Size(*(int(p) for p in parts))
    if size.d_model % size.heads:
        raise ConfigError(f"--model {model!r}: width {size.d_model} is not a multiple of "
                          f"{size.heads} heads (each head is width/heads wide); a shape is "
                          f"{SHAPE_SYNTAX}")
    return size


def canonical(model: str) -> str:
    """``model`` as a run records it: a size's name as it is, a shape as "6x384x6"."""
    return model if model in SIZES else parse(model).shape


def name_of(size: Size) -> Optional[str]:
    """The first named size of this shape (None for a shape no size names)."""
    return next((n for n, s in SIZES.items() if s == size), None)


def block_params(d: int) -> int:
    """One block's parameters: two LayerNorms (2d each), the attention's qkv (3d x d + 3d)
    and output (d x d + d) projections, the MLP's two layers (4d x d + 4d, d x 4d + d)."""
    return 12 * d * d + 13 * d


def parameters(size: Size, vocab: int, seq_len: int) -> int:
    """The model's parameters, each counted once (the tied head shares the embedding's):
    token and position embeddings, the blocks, the final LayerNorm."""
    L, d = size.layers, size.d_model
    return vocab * d + seq_len * d + L * block_params(d) + 2 * d


def state_values(size: Size, vocab: int, seq_len: int) -> int:
    """Floats in the model's state_dict, which lists the tied weight under both its names
    (``tok.weight`` and ``head.weight``): the embedding counts twice here."""
    return parameters(size, vocab, seq_len) + vocab * size.d_model


def flop_parameters(size: Size, vocab: int, seq_len: int) -> int:
    """N of the FLOP rule: the parameters less the position embedding (an addition, no
    product); the tied embedding counts once, for the head's matrix product (the lookup
    itself is free)."""
    return parameters(size, vocab, seq_len) - seq_len * size.d_model


def forward_flops(size: Size, vocab: int, seq_len: int) -> int:
    """Forward FLOPs of one sample of ``seq_len`` tokens: per token 2N (a multiply-add per
    weight) plus attention's 4·L·T·d (QK^T and AV, each 2·T·d per token and layer, the full
    square rather than the causal half, as kernels and the Chinchilla/PaLM rule count it)."""
    L, d, T = size.layers, size.d_model, seq_len
    return T * (2 * flop_parameters(size, vocab, seq_len) + 4 * L * T * d)


def train_flops_per_token(size: Size, vocab: int, seq_len: int) -> int:
    """FLOPs of a training step per token: 3x the forward's (the backward is twice the
    forward), 6N + 12·L·T·d."""
    return 3 * forward_flops(size, vocab, seq_len) // seq_len

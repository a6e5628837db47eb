"""The lm workload's model sizes, and their parameter and FLOP counts as plain arithmetic, so
that the resource preflight and MFU need neither torch nor a built model.

``gpt2`` is GPT-2 small: 124.4M parameters with its 50257-token vocabulary (124.5M padded to
50304), 86.0M with the byte-level vocabulary of 256 (the embedding's 38.4M fewer).
"""
from __future__ import annotations

from typing import NamedTuple


#: the vocabulary of text read as bytes (the embedded and text datasets)
BYTE_VOCAB = 256


class Size(NamedTuple):
    layers: int
    d_model: int
    heads: int


#: the model sizes --model names: layers, width, attention heads
SIZES = {
    "tiny": Size(2, 64, 2),
    "small": Size(4, 128, 4),
    "gpt2": Size(12, 768, 12),  # GPT-2 small (Radford et al., 2019)
}


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

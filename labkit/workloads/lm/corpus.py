"""The lm workload's data: token streams, split once into training and validation text, and cut
into windows.

- ``embedded``: the Python source of the installed torch, as bytes: nothing to download, and
  the same torch version gives the same bytes on every machine (labkit.workloads.lm.sources).
- ``text``: a text file, or a folder of them read recursively in sorted order, as bytes.
- ``tokens``: uint16 token ids as nanoGPT's prepare scripts write them (``np.uint16`` arrays,
  ``tofile``): one ``.bin`` file, or a folder holding ``train.bin`` and ``val.bin``. Where that
  folder also holds nanoGPT's ``meta.pkl`` (its character-level sets write one: ``vocab_size``,
  ``itos``, ``stoi``), its vocab_size is the vocabulary and its ``itos`` decodes the samples;
  without one the vocabulary is the largest token + 1, rounded up to a multiple of 64.

Bytes are tokens (a vocabulary of 256): no tokenizer to install, and any text reads. A sample is
(x, y) = (window[:-1], window[1:]) of a window of seq_len + 1 tokens; window i starts at token
i·seq_len (stride seq_len, so consecutive windows share one token): every token of the stream
but the first is a target exactly once, and x and y are two views of one tensor.

Every problem with the data is one line (ConfigError) naming the path.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from torch.utils.data import TensorDataset

from labkit.core.config import ConfigError

from .sizes import BYTE_VOCAB
from .sources import (TOKEN_BYTES, embedded_corpus, meta_file, read_meta, read_text, token_files,
                      torch_version)

#: the share of a single stream (the embedded corpus, a text, one .bin file) kept for validation:
#: its end, whatever the seed, so every run validates on the same text
VAL_SHARE = 0.1


@dataclass
class Streams:
    """A dataset's token streams (int64 tensors), what they are, and the vocabulary."""
    train: torch.Tensor
    val: torch.Tensor
    vocab: int
    text: bool  # the tokens are bytes: text can be decoded from them
    source: str  # for people: "torch 2.14.1 source, 1.0 MB", a path
    itos: Optional[Union[dict, list]] = None  # a tokens dataset's meta.pkl's id -> str


# ------------------------------------------------------------------ a user's tokens
def read_token_file(path: str) -> np.ndarray:
    """A file of little-endian uint16 tokens, as nanoGPT writes them."""
    n = os.path.getsize(path)
    if n == 0:
        raise ConfigError(f"token file {path!r} is empty")
    if n % TOKEN_BYTES:
        raise ConfigError(f"token file {path!r} has an odd length ({n:,} bytes): not uint16 tokens "
                          f"(nanoGPT's .bin, 2 bytes a token)")
    return np.fromfile(path, dtype="<u2")


def token_vocab(largest: int) -> int:
    """The vocabulary of a tokens dataset: its largest token + 1, rounded up to a multiple of 64
    (GPT-2's 50257 tokens give nanoGPT's 50304, which GPUs multiply faster)."""
    return -(-(largest + 1) // 64) * 64


# ------------------------------------------------------------------ streams and windows
def split(stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A single stream's training part and its last :data:`VAL_SHARE` for validation."""
    n_val = int(len(stream) * VAL_SHARE)
    return stream[:len(stream) - n_val], stream[len(stream) - n_val:]


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def load(dataset: str, data_dir: str) -> Streams:
    """The token streams of ``dataset`` (embedded | text | tokens) read from ``data_dir``."""
    if dataset == "embedded":
        corpus = embedded_corpus()
        train, val = split(_bytes_tensor(corpus))
        return Streams(train, val, BYTE_VOCAB, True,
                       f"torch {torch_version()} source, {len(corpus) / 1e6:.1f} MB, "
                       f"sha256 {hashlib.sha256(corpus).hexdigest()[:12]}")
    if dataset == "text":
        data = read_text(data_dir)
        train, val = split(_bytes_tensor(data))
        return Streams(train, val, BYTE_VOCAB, True, f"{data_dir}, {len(data) / 1e6:.1f} MB")
    return load_tokens(data_dir)


def load_tokens(data_dir: str) -> Streams:
    """A tokens dataset's streams; the vocabulary its meta.pkl's vocab_size (every token must
    be below it: one line naming the file that holds one that is not), else :func:`token_vocab`
    of its largest token."""
    files = token_files(data_dir)
    arrays = [read_token_file(f) for f in files]
    largest = [int(a.max()) for a in arrays]
    meta_path = meta_file(data_dir)
    meta = read_meta(meta_path) if meta_path else None
    vocab = meta["vocab_size"] if meta else token_vocab(max(largest))
    for f, top in zip(files, largest):
        if top >= vocab:
            raise ConfigError(f"token file {f!r} holds token {top}, not below the vocab_size "
                              f"{vocab} of {meta_path!r}")
    streams = [torch.from_numpy(a.astype(np.int64)) for a in arrays]
    train, val = split(streams[0]) if len(streams) == 1 else streams
    source = f"{data_dir}, {sum(len(s) for s in streams):,} tokens"
    if meta:
        source += f", meta.pkl: vocab_size {vocab}"
    return Streams(train, val, vocab, False, source, itos=meta.get("itos") if meta else None)


def windows(stream: torch.Tensor, seq_len: int, what: str, split_name: str) -> TensorDataset:
    """The (x, y) samples of ``stream``: window i is tokens [i·T, i·T + T], x its first T
    tokens and y its last T (two views of the stream, no copy). Too short a stream for one
    window is an error naming ``what`` was read."""
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ConfigError(f"{what} is too short: its {split_name} split has {len(stream):,} tokens, "
                          f"fewer than one window of --seq-len + 1 = {seq_len + 1}; give more text "
                          f"or a smaller --seq-len")
    end = n * seq_len
    return TensorDataset(stream[:end].view(n, seq_len), stream[1:end + 1].view(n, seq_len))

"""The ``lm`` workload: a decoder-only transformer (GPT-2's layout, labkit.workloads.lm.model)
learning the next token of a text, judged by its validation loss (nats/token) and perplexity,
lower being better; AdamW with a linear warm-up and a cosine decay.

The data (labkit.workloads.lm.sources, .corpus): by default the Python source of the installed
torch, embedded (nothing to download; :func:`corpus_sha256` names the bytes), else a user's text
(bytes are tokens, a vocabulary of 256) or nanoGPT's uint16 token files, with their meta.pkl's
vocabulary and characters where the folder holds one. Importing this module does not import
torch: the sizes and counts the launcher needs are arithmetic or file sizes
(labkit.workloads.lm.sizes, .sources).

``--model`` is a named size or a shape LxDxH (labkit.workloads.lm.sizes.parse); the context
window and learning rate default by the model's width (:func:`defaults`). ``--weights`` starts
from a state_dict a labkit lm run saved (its folder's final_model.pt): a warm start, every rank
loading the same file (labkit.workloads.lm.model.warm_start).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from labkit.core.config import ConfigError, TrainConfig
from labkit.core.params import option
from labkit.workloads import Datasets, Figure, Workload

from . import sizes
from .sizes import BYTE_VOCAB
from .sources import corpus_sha256, token_count

__all__ = ["LanguageModel", "corpus_sha256", "unigram_entropy"]

DATASETS = ("embedded", "text", "tokens")
#: context window per size: tiny and small are for CPUs, gpt2 is GPT-2's own
SEQ_LEN = {"tiny": 64, "small": 256, "gpt2": 1024}
#: peak learning rate per size. Small transformers train stably at a larger lr; measured for
#: the tiny model on the embedded text (one process, one thread): 660 steps of batch 64 (the
#: default run, 3 epochs on 2 trainers) reach a validation loss of 2.29 at 1e-3, 1.91 at 3e-3,
#: 1.89 at 6e-3, and 200 steps of batch 32 reach 2.68, 2.56 and 2.80: 3e-3 is close to the best
#: of both. 1e-3 is nanoGPT's for its small character-level model, 6e-4 GPT-2 small's (as
#: GPT-3's paper and nanoGPT train it).
LR = {"tiny": 3e-3, "small": 1e-3, "gpt2": 6e-4}
#: the defaults of every size and shape, by its width d: (widest d, seq_len, lr), the first row
#: whose width is at least the model's. The first three rows are the named sizes' own (tiny,
#: small, gpt2: unchanged); up to d 384 holds nanoGPT's Shakespeare-char model (6x384x6, block
#: 256, lr 1e-3, as small's); wider than GPT-2 small, GPT-3's peak lr of its model of that width
#: (Brown et al., 2020, table 2.1: medium d 1024 3e-4, large d 1536 2.5e-4, XL d 2048 2e-4,
#: 2.7B d 2560 1.6e-4, held for anything wider) and GPT-2's context of 1024
BY_WIDTH = ((64, SEQ_LEN["tiny"], LR["tiny"]),
            (384, SEQ_LEN["small"], LR["small"]),
            (768, SEQ_LEN["gpt2"], LR["gpt2"]),
            (1024, 1024, 3e-4),
            (1536, 1024, 2.5e-4),
            (2048, 1024, 2e-4),
            (None, 1024, 1.6e-4))
WEIGHT_DECAY = 0.1  # AdamW's, on the matrices only (GPT-2, GPT-3, nanoGPT)
BETAS = (0.9, 0.95)
WARMUP_SHARE = 0.05  # of all steps
FINAL_LR_SHARE = 0.1  # the cosine decays to this share of the peak
INT64 = 8
#: what :meth:`LanguageModel.finish` generates
SAMPLES, PROMPT_TOKENS, NEW_TOKENS, TEMPERATURE = 3, 32, 160, 0.8
NEWLINE = 10
REFERENCE = "unigram entropy of the validation text (nats/token)"


def defaults(size: sizes.Size) -> tuple[int, float]:
    """(seq_len, lr) of a model of ``size`` unless --seq-len and --lr say otherwise: the row of
    :data:`BY_WIDTH` its width falls in. tiny, small and gpt2 get their own (64, 3e-3),
    (256, 1e-3) and (1024, 6e-4); shakespeare (d 384) nanoGPT's (256, 1e-3); a shape the row
    of its width (6x64x2 tiny's, 6x512x8 gpt2's)."""
    for widest, seq_len, lr in BY_WIDTH:
        if widest is None or size.d_model <= widest:
            return seq_len, lr
    raise AssertionError("BY_WIDTH ends with an open row")


def unigram_entropy(tokens) -> float:
    """The entropy, in nats, of the tokens' empirical unigram distribution: the validation
    loss of the best model that ignores context, the bar a language model must get under."""
    import torch

    counts = torch.bincount(torch.as_tensor(tokens).flatten().long()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def dataset_of(data_dir: str) -> str:
    """The dataset a --data-dir holds: tokens for a .bin file or a folder holding train.bin
    and val.bin, else text."""
    if os.path.isfile(data_dir) and data_dir.endswith(".bin"):
        return "tokens"
    if all(os.path.isfile(os.path.join(data_dir, f"{s}.bin")) for s in ("train", "val")):
        return "tokens"
    return "text"


@dataclass
class LanguageModelOptions:
    seq_len: Optional[int] = option(None, "lm: tokens in a sample's context window (default: by the "
                                    "model's width: 64 up to d 64 (tiny), 256 up to d 384 "
                                    "(small, shakespeare), else 1024 (gpt2))", "data", at_least=1)


class LanguageModel(Workload):
    name = "lm"
    Options = LanguageModelOptions
    preload = ("labkit.workloads.lm.model", "labkit.workloads.lm.corpus")
    title = "language modelling"
    unit = "tokens"
    rate = "tokens/s"
    optimizer_name = "AdamW (linear warm-up, cosine decay)"
    grad_clip = 1.0  # the global norm nanoGPT and torchtitan clip at by default
    val_sum_keys = ("loss", "count")
    check_config = {"model": "tiny", "seq_len": 32}
    figures = (Figure("val_loss", "validation loss", "nats/token", higher_is_better=False,
                      short="loss"),
               Figure("val_perplexity", "validation perplexity", "", higher_is_better=False,
                      short="ppl"))

    def shard_units(self, model) -> list[str]:
        """Each transformer block (torchtitan's and nanoGPT's FSDP wrap them one by one)."""
        return [f"blocks.{i}" for i in range(len(model.blocks))]

    @classmethod
    def resolve(cls, cfg: TrainConfig, cuda: bool, trainers: int) -> None:
        c = cfg
        if c.dataset is None:
            c.dataset = dataset_of(c.data_dir) if c.data_dir else "embedded"
        if c.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {c.dataset!r} for the lm workload; choose one of: "
                              f"{', '.join(DATASETS)}")
        if c.dataset == "embedded" and c.data_dir:
            raise ConfigError(f"--dataset embedded reads no --data-dir (it is torch's own source): "
                              f"drop --data-dir {c.data_dir}, or choose --dataset text or tokens")
        if c.dataset != "embedded" and not c.data_dir:
            raise ConfigError(f"--dataset {c.dataset} needs --data-dir: a text file or folder of "
                              f"text files (text), a uint16 .bin file or a folder holding "
                              f"train.bin and val.bin (tokens)")
        if c.model is None:
            c.model = "tiny"
        c.model = sizes.canonical(c.model)  # a name as it is, a shape as 6x384x6
        seq_len, lr = defaults(sizes.parse(c.model))
        if c.weights:
            c.weights = weights_file(c.weights)
        if c.seq_len is None:
            c.seq_len = seq_len
        if c.lr is None:
            c.lr = lr
        if c.weight_decay is None:
            c.weight_decay = WEIGHT_DECAY

    # ------------------------------------------------------------------ data
    def streams(self):
        """The token streams (labkit.workloads.lm.corpus.Streams), read once."""
        if getattr(self, "_streams", None) is None:
            from . import corpus

            self._streams = corpus.load(self.cfg.dataset, self.cfg.data_dir)
        return self._streams

    def datasets(self) -> Datasets:
        from .corpus import windows

        if getattr(self, "_data", None) is None:
            c, s = self.cfg, self.streams()
            what = f"--data-dir {c.data_dir!r}" if c.data_dir else "the embedded corpus"
            self._data = Datasets(windows(s.train, c.seq_len, what, "training"),
                                  windows(s.val, c.seq_len, what, "validation"), in_memory=True)
        return self._data

    def vocab(self) -> int:
        """The vocabulary: 256 bytes for text; for tokens, the folder's meta.pkl's vocab_size,
        else read from the token files (labkit.workloads.lm.corpus.load)."""
        return self.streams().vocab if self.cfg.dataset == "tokens" else BYTE_VOCAB

    def size(self) -> sizes.Size:
        """The model's layers, width and heads: --model's size or shape, resolved."""
        return sizes.parse(self.cfg.model)

    def references(self) -> dict[str, float]:
        """Losses to read the figures against: a context-free model's, the validation text's
        unigram entropy."""
        return {REFERENCE: unigram_entropy(self.streams().val)}

    # ------------------------------------------------------------------ model and loss
    def build_model(self):
        """The transformer, GPT-2's initialisation; with --weights, then loaded from that file
        (every rank reads the same one, so every method starts from the same model). On the
        meta device (sizes only) nothing is read."""
        from .model import Transformer, warm_start

        c = self.cfg
        model = Transformer(self.size(), self.vocab(), c.seq_len)
        if c.weights and not model.tok.weight.is_meta:
            warm_start(model, c.weights, f"--model {c.model} (vocabulary {self.vocab()}, "
                                         f"--seq-len {c.seq_len})")
            self.note = f"warm start: weights loaded from {c.weights}"
        return model

    def loss(self, output, target):
        import torch.nn.functional as F

        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    @property
    def units_per_sample(self) -> int:
        return self.cfg.seq_len

    def val_sums(self, output, target) -> dict:
        import torch
        import torch.nn.functional as F

        loss = F.cross_entropy(output.float().flatten(0, 1), target.flatten(), reduction="sum")
        return {"loss": loss, "count": torch.tensor(float(target.numel()), device=target.device)}

    def val_figures(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss"] / max(1.0, sums["count"])
        # exp(710) overflows a float: a diverged run's perplexity is capped, not an error
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0))}

    # ------------------------------------------------------------------ optimisation
    def optimizer(self, params):
        """AdamW, weight decay on the matrices (embeddings and linear weights) only: decaying
        biases and LayerNorm gains only pulls them from their useful values (as GPT-2 and
        nanoGPT do). ``params`` come without names, so a matrix is a tensor of 2+ dims."""
        import torch

        params = [p for p in params if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": self.cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.cfg.lr, betas=BETAS,
                                 eps=1e-8)

    @property
    def optimizer_state_per_value(self) -> int:
        return 2  # AdamW's two moments

    def lr_at(self, step: int, total: int) -> Optional[float]:
        """A linear warm-up over the first 5% of the steps (from lr/warmup at step 0 to lr at
        step warmup - 1), then a cosine decay to 0.1·lr at step ``total`` (held after it)."""
        lr, total = self.cfg.lr, max(1, total)
        warmup = max(1, round(WARMUP_SHARE * total))
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup + 1) / max(1, total - warmup + 1))
        low = FINAL_LR_SHARE * lr
        return low + 0.5 * (lr - low) * (1.0 + math.cos(math.pi * progress))

    # ------------------------------------------------------------------ what instruments ask
    def state_values(self) -> int:
        return sizes.state_values(self.size(), self.vocab(), self.cfg.seq_len)

    def sample_bytes(self) -> int:
        return 2 * self.cfg.seq_len * INT64

    def data_bytes(self) -> int:
        """The token streams as int64 (x and y are views of them), from the files' sizes."""
        return token_count(self.cfg.dataset, self.cfg.data_dir) * INT64

    def forward_flops(self, data: Datasets) -> Optional[int]:
        return sizes.forward_flops(self.size(), self.vocab(), self.cfg.seq_len)

    def flops_rule(self) -> str:
        s, T = self.size(), self.cfg.seq_len
        n = sizes.flop_parameters(s, self.vocab(), T)
        return (f"6N + 12·L·T·d per token for a training step (N = {n / 1e6:.2f}M parameters "
                f"without the position embedding, L = {s.layers}, T = {T}, d = {s.d_model}; "
                f"forward 2N + 4·L·T·d), as in Chinchilla/PaLM")

    def fingerprint(self) -> dict:
        """The dataset, the window length, and a sha256 of every token of both splits."""
        import hashlib
        import json

        c, s = self.cfg, self.streams()
        fp = {"workload": c.workload, "dataset": c.dataset, "data_dir": c.data_dir,
              "seq_len": c.seq_len, "tokens": [len(s.train), len(s.val)]}
        h = hashlib.sha256(json.dumps(fp, sort_keys=True).encode())
        for t in (s.train, s.val):
            h.update(t.numpy().tobytes())
        fp["sha256"] = h.hexdigest()
        return fp

    def shape(self) -> dict:
        """The model as a run records it (``describe``): --model as given, its layers, width
        and heads, the vocabulary, the parameters (the tied embedding once), the FLOPs of a
        training step per token (6N + 12·L·T·d), and the --weights it started from."""
        c, size, vocab = self.cfg, self.size(), self.vocab()
        return {"model": c.model, "layers": size.layers, "d_model": size.d_model,
                "heads": size.heads, "vocab": vocab,
                "parameters": sizes.parameters(size, vocab, c.seq_len),
                "flops_per_token": sizes.train_flops_per_token(size, vocab, c.seq_len),
                "weights": c.weights}

    def describe(self) -> dict:
        """The contract's description, and the model's shape (:meth:`shape`)."""
        return {**super().describe(), **self.shape()}

    def summary_line(self, data: Datasets) -> str:
        c, s, m = self.cfg, self.streams(), self.shape()
        what = {"embedded": "embedded text", "text": "text", "tokens": "tokens"}[c.dataset]
        warm = f", warm start from {c.weights}" if c.weights else ""
        return (f"transformer {c.model} ({m['layers']} layers, d {m['d_model']}, {m['heads']} "
                f"heads, {m['parameters'] / 1e6:.2f}M params, tied, "
                f"{m['flops_per_token'] / 1e6:.2f} MFLOP/token a training step{warm}) on {what} "
                f"({s.source}, {s.vocab} tokens) ({len(data.train):,} train / {len(data.val):,} "
                f"val windows of {c.seq_len})")

    def finish(self, model) -> dict:
        """Three samples the final model writes, each continuing a prompt of the validation
        text: {"samples": [{"prompt", "text"}, ...]} decoded from bytes, or with a meta.pkl's
        characters (``itos``) for a tokens dataset that has one; else the ids,
        {"prompt_tokens", "tokens"}. Seeded by --seed: the same model writes the same."""
        from .model import generate

        s, n = self.streams(), min(PROMPT_TOKENS, self.cfg.seq_len)
        text = decode if s.text else (characters(s.itos) if s.itos is not None else None)
        newline = NEWLINE if s.text else newline_of(s.itos)
        starts = prompt_starts(s.val, SAMPLES, n, newline if text else None)
        prompts = [s.val[i:i + n] for i in starts]
        net = getattr(model, "module", model)  # DistributedDataParallel's, or the model itself
        out = generate(net, prompts, NEW_TOKENS, TEMPERATURE, self.cfg.seed)
        if text is None:
            return {"samples": [{"prompt_tokens": p.tolist(), "tokens": o}
                                for p, o in zip(prompts, out)]}
        return {"samples": [{"prompt": text(p.tolist()), "text": text(o)}
                            for p, o in zip(prompts, out)]}


def weights_file(path: str) -> str:
    """--weights as the file it names, absolute: the file itself, or a run's method folder's
    final model (labkit.core.layout.FINAL_MODEL). A missing one is one line."""
    from labkit.core.layout import FINAL_MODEL

    path = os.path.abspath(path)
    if os.path.isdir(path):
        inside = os.path.join(path, FINAL_MODEL)
        if os.path.isfile(inside):
            return inside
        held = sorted(os.path.join(path, d, FINAL_MODEL) for d in os.listdir(path)
                      if os.path.isfile(os.path.join(path, d, FINAL_MODEL)))
        raise ConfigError(f"--weights {path!r} is a folder without {FINAL_MODEL}" + (
            f"; name one method's: {', '.join(held)}" if held else
            " (give a state_dict file, or the folder of a finished lm run's method)"))
    if not os.path.isfile(path):
        raise ConfigError(f"--weights {path!r} not found (the lm workload warm-starts from a "
                          f"state_dict file, e.g. a finished run's {FINAL_MODEL}, or its folder)")
    return path


def decode(ids: list[int]) -> str:
    """Byte tokens as text: UTF-8, any bytes that are not (the model may write any) shown as
    U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def characters(itos):
    """A decoder of token ids through a meta.pkl's ``itos`` (id -> str, a dict or a list): each
    id's string, U+FFFD for an id it has none for."""
    def text(ids: list[int]) -> str:
        out = []
        for i in ids:
            try:
                out.append(str(itos[i]))
            except (KeyError, IndexError):
                out.append("\ufffd")
        return "".join(out)
    return text


def newline_of(itos) -> Optional[int]:
    """The id ``itos`` spells "\\n" with (None where it has none)."""
    pairs = itos.items() if isinstance(itos, dict) else enumerate(itos or ())
    return next((i for i, ch in pairs if ch == "\n"), None)


def prompt_starts(val, count: int, length: int, newline: Optional[int]) -> list[int]:
    """Where ``count`` prompts of ``length`` tokens start, spread evenly over the validation
    stream ``val``; for text (``newline``: the newline's token), moved to the start of the next
    line, so a prompt reads as one."""
    last = len(val) - length
    starts = [last * i // count for i in range(count)]
    if newline is None:
        return starts
    moved = []
    for s in starts:
        newlines = (val[s:last] == newline).nonzero()
        moved.append(s + int(newlines[0]) + 1 if len(newlines) else s)
    return moved

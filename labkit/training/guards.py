"""Training that goes wrong without crashing, caught at the end of every epoch.

- A loss that diverged: the loop keeps every step's loss on the device already
  (labkit.training.instruments.meter) and reads them once, reduced over the trainers, when the
  epoch ends; the first one that is not finite (or, after a last step that left the weights not
  finite, the validation loss) is where the run diverged. Nothing is added to a step: no host
  synchronisation per step on a GPU. The price is that the rest of that epoch still runs.
- Replicas that drifted apart: after ``finish_epoch`` every rank (a parameter server's
  servers too: each holds the whole model then) must hold the same parameters and buffers.
  Each rank takes a fingerprint of every tensor (a checksum of its bytes: the sum of its 32-bit
  words modulo 2^32, exact and independent of summation order, so any changed bit shows), the
  ranks all-gather them (one collective of one int64 per tensor) and every rank compares them
  the same way, so every rank stops at the same point; only a tensor that differs is summed
  in float64 too, for the message.

Either stops the run with :class:`labkit.core.errors.RunFailed` (one line, exit 1). What the
result file records is labkit.core.health's.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from itertools import chain
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from labkit.core.config import TrainConfig
from labkit.core.results import Epoch

from .dist import is_distributed

# the words a tensor's bytes are summed as, by element size (8-byte elements as two words)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


# ------------------------------------------------------------------ a loss that diverged
def divergence(cfg: TrainConfig, epoch: int, steps: int, before: int, e: Epoch) -> Optional[dict]:
    """Where this epoch's loss stopped being a number, from its figures ``e`` (the same on
    every rank: reduced over the ranks), or None. ``before``: steps of the earlier epochs.
    The record is the result file's "diverged" entry (labkit.core.health reads it)."""
    losses = e.all_losses
    bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    if bad is not None:
        step, of, value = bad + 1, "train_loss", losses[bad]
    elif not math.isfinite(e.val_loss):  # the last step left weights that are not finite
        step, of, value = steps, "val_loss", e.val_loss
    else:
        return None
    return {"epoch": epoch, "step": step, "steps": steps,
            "global_step": before + step, "of": of, "value": str(value),
            "lr": cfg.lr, "train_losses": losses, "val_loss": e.val_loss}


def divergence_text(d: dict, cfg: TrainConfig, trainers: int) -> str:
    """The one line that says where and what to try."""
    where = f"the loss diverged at epoch {d['epoch']}, step {d['step']} of {d['steps']}"
    if d["of"] == "train_loss":
        what = f"training loss {d['value']}"
    else:
        what = f"training loss {d['train_losses'][-1]:.3g}, then validation loss {d['value']}"
    default = 0.1 * cfg.batch_size * trainers / 256
    if cfg.lr > default:
        hint = (f"try a smaller --lr (the default here, 0.1 x global batch / 256, is {default:g})")
    else:
        hint = "try a smaller --lr, or look for inputs that are not finite"
    if cfg.amp == "fp16":
        hint += ", or --amp bf16"
    return f"{where} ({what}; lr {cfg.lr:g}): {hint}"


# ------------------------------------------------------------------ replicas that drifted apart
def tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors a replica is made of: parameters, then buffers, in the model's order."""
    return list(chain(model.named_parameters(), model.named_buffers()))


def fingerprint(ts: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the sum of its 32-bit words modulo 2^32 (int32's two's complement
    wrap-around; bytes of other sizes as words of their size, summed in int64): one int64
    tensor of len(ts), on the tensors' device, with no host synchronisation. Exact and
    independent of the order of summation (integers modulo 2^32), so equal tensors give equal
    sums on every rank and device, and a change of any one bit changes it (by +-2^k, k < 32,
    never a multiple of 2^32). (Float sums, for the message, are taken only of a tensor that
    differs.)

    Summed in int32, not widened to int64 first: widening converted every word before adding,
    8x the time (6.9 ms against 0.8 ms for resnet10_small's 4.9 M parameters on one CPU core),
    which made the replica check most of a percent of a step on the embedded default
    (docs/where-the-time-goes.md, "What the instruments cost").

    On a GPU the same sums come from :func:`_word_sums_at_once`: a few kernels for all the
    tensors instead of two for each, which made the check over a percent of a few-ms step."""
    words = [_words(t.detach().contiguous().view(-1)) for t in ts]
    if words and words[0].is_cuda:
        return _word_sums_at_once(words)
    return torch.stack([_word_sum(w) for w in words])


def _words(raw: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor's bytes as words of its element size (``_WORDS``)."""
    if raw.dtype == torch.bool:
        raw = raw.to(torch.uint8)
    return raw.view(_WORDS[raw.element_size()])


def _word_sum(words: torch.Tensor) -> torch.Tensor:
    """The sum of ``_words``, as an int64 scalar tensor (int32 words modulo 2^32)."""
    if words.dtype == torch.int32:
        return words.sum(dtype=torch.int32).to(torch.int64)
    return words.sum(dtype=torch.int64)


def _word_sums_at_once(words: list[torch.Tensor]) -> torch.Tensor:
    """:func:`_word_sum` of each of ``words``, equal to it: the 32-bit words of all the tensors
    in one buffer, its prefix sums modulo 2^32 (int32), and each tensor's sum as the
    difference of the prefix sums at its two ends, itself modulo 2^32 (exact: the integers
    modulo 2^32 are a ring). Tensors of other word sizes (few and small: counters, masks) are
    summed one by one. Faster on a GPU, where each kernel costs a launch; slower on a CPU,
    where the buffer is a copy of the whole model (both timed: docs/performance-log.md, "On one
    GPU, night")."""
    dev = words[0].device
    out = torch.zeros(len(words), dtype=torch.int64, device=dev)
    at = [i for i, w in enumerate(words) if w.dtype == torch.int32 and w.numel()]
    if at:
        prefix = torch.cat([words[i] for i in at]).cumsum(0, dtype=torch.int32)
        ends = torch.tensor([words[i].numel() for i in at]).cumsum(0).sub_(1).to(dev)
        last = prefix[ends]
        out[torch.tensor(at, device=dev)] = (last - torch.cat([last.new_zeros(1), last[:-1]])).to(torch.int64)
    for i, w in enumerate(words):
        if w.dtype != torch.int32 and w.numel():
            out[i] = _word_sum(w)
    return out


def gather(mine: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``mine`` (of ``group``: None, every rank), one row per rank (one
    collective; none for one process)."""
    if not is_distributed():
        return mine.unsqueeze(0)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return torch.stack(rows)


def compare(names: list[str], table: torch.Tensor, epoch: int) -> Optional[dict]:
    """The first tensor some rank holds another copy of, and the first such rank (the copy
    most ranks hold counts as the right one; on a tie, rank 0's), or None if all agree.
    ``table``: the ranks' fingerprints, one row per rank."""
    checks = table.cpu()
    differ = (checks != checks[0]).any(dim=0).nonzero()
    if not len(differ):
        return None
    j = int(differ[0])
    column = checks[:, j].tolist()
    counts = Counter(column)
    right = max(counts, key=lambda v: (counts[v], v == column[0]))
    ref = column.index(right)
    rank = next(r for r, v in enumerate(column) if v != right)
    return {"epoch": epoch, "rank": rank, "tensor": names[j], "index": j, "reference_rank": ref,
            "tensors_differing": int((checks[rank] != checks[ref]).sum()),
            "ranks_differing": int((checks != checks[ref]).any(dim=1).sum()), "ranks": len(column)}


def mismatch_text(d: dict) -> str:
    more = d["tensors_differing"] - 1
    also = f" and {more} more tensor{'s' if more > 1 else ''}" if more else ""
    ranks = d["ranks_differing"]
    of = f"; {ranks} of {d['ranks']} ranks differ from rank {d['reference_rank']}" if ranks > 1 else ""
    return (f"replicas diverged at the end of epoch {d['epoch']}: rank {d['rank']} holds another "
            f"{d['tensor']}{also} than rank {d['reference_rank']} (float64 sums "
            f"{d['sum']:.17g} and {d['reference_sum']:.17g}{of}): a bug in the synchronisation "
            f"(--no-check-replicas turns the check off)")


def check_replicas(named: list[tuple[str, torch.Tensor]], group, epoch: int
                   ) -> tuple[dict, Optional[dict]]:
    """Fingerprint, gather, compare the ``named`` tensors the ranks of ``group`` (None: every
    rank) must hold alike (the method's ``replicas``): (this epoch's "replicas" entry, the
    mismatch or None), its ranks global ones. A mismatch is seen by every rank of the group
    alike, so all take part in gathering the float64 sums of the tensor that differs."""
    t0 = time.perf_counter()
    table = gather(fingerprint([t for _, t in named]) if named else torch.zeros(0, dtype=torch.int64),
                   group)
    bad = compare([n for n, _ in named], table, epoch) if named else None
    if bad is not None:
        t = named[bad.pop("index")][1].detach()
        sums = gather(t.sum(dtype=torch.float64).reshape(1), group).view(-1).tolist()
        bad["sum"], bad["reference_sum"] = sums[bad["rank"]], sums[bad["reference_rank"]]
        if group is not None:  # the group's ranks as the world numbers them
            bad["rank"], bad["reference_rank"] = (dist.get_global_rank(group, bad[k])
                                                  for k in ("rank", "reference_rank"))
    entry = {"identical": bad is None, "tensors": len(named), "ranks": table.shape[0],
             "seconds": time.perf_counter() - t0}
    return entry, bad


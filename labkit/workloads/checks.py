"""A workload's checks before anything is spawned: data that exists, and a model and a loss that
work on a first batch. Each failure is one line (ConfigError) naming the workload and what is
wrong: the batch's shape and the model's first layer for a forward that fails, the loss's shape
for one that is not a scalar."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from labkit.core import plugins
from labkit.core.config import ConfigError

from .datasets import Datasets


def _name(w) -> str:
    return f"workload {w.cfg.workload}"


def samples(w) -> Datasets:
    """The workload's datasets as every part of the lab reads them: checked to hold samples,
    each an (input, target) pair (dict samples taken apart by the workload's keys)."""
    return nonempty(w, w.datasets())


def nonempty(w, data: Datasets) -> Datasets:
    """``data``, once its training and validation sets are known to hold samples, each an
    (input, target) pair: a set of dict samples is read through :class:`Pairs`."""
    if data is None or not isinstance(data, Datasets):
        raise ConfigError(f"{_name(w)}: datasets() returned {type(data).__name__}, not "
                          f"labkit.workloads.Datasets(train, val, in_memory)")
    for split, ds in (("training", data.train), ("validation", data.val)):
        if ds is None:
            raise ConfigError(f"{_name(w)} has no {split} data (datasets() gave "
                              f"{'train' if split == 'training' else 'val'}=None): "
                              f"labkit judges every run by its validation figures")
        try:
            n = len(ds)
        except TypeError:
            raise ConfigError(f"{_name(w)}: its {split} dataset has no len(); give a map-style "
                              f"dataset (__len__ and __getitem__), which the lab's sampler shards") from None
        if n == 0:
            raise ConfigError(f"{_name(w)}: its {split} dataset is empty")
    return pairs(w, data)


class Pairs:
    """A map-style dataset of dict samples (Hugging Face's style) read as (input, target)
    pairs: ``sample[input_key], sample[target_key]``. It holds only the dataset and two keys,
    so it pickles to loader workers as the dataset does."""

    def __init__(self, ds, input_key: str, target_key: str):
        self.ds, self.input_key, self.target_key = ds, input_key, target_key

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):
        s = self.ds[i]
        return s[self.input_key], s[self.target_key]


def pairs(w, data: Datasets) -> Datasets:
    """``data`` with its sets read as (input, target) pairs: as they are where the first
    training sample is a pair, through :class:`Pairs` where it is a dict holding the workload's
    ``input_key`` and ``target_key``; one line for any other sample."""
    first = data.train[0]
    if isinstance(first, (tuple, list)) and len(first) == 2:
        return data
    keys = (w.input_key, w.target_key)
    if isinstance(first, Mapping):
        if all(k in first for k in keys):
            return dataclasses.replace(data, train=Pairs(data.train, *keys), val=Pairs(data.val, *keys))
        got = f"a dict of keys {', '.join(map(repr, first))}"
    else:
        got = (f"a {type(first).__name__} of {len(first)}" if isinstance(first, (tuple, list))
               else f"a {type(first).__name__}")
    raise ConfigError(f"{_name(w)}: its first training sample is {got}: a sample is a pair "
                      f"(input, target) or a dict holding the model's input under "
                      f"{keys[0]!r} and the loss's target under {keys[1]!r} (the class "
                      f"attributes input_key and target_key; docs/workloads.md#samples)")


def _first_layer(model) -> str:
    for name, m in model.named_modules():
        if name and not list(m.children()):
            return f"{name}: {m}"
    return type(model).__name__


def _shape(x) -> str:
    return f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}" if hasattr(x, "shape") else type(x).__name__


def _raised(e: Exception) -> str:
    """"RuntimeError: its first line (at FILE:LINE)", the innermost frame of the user's code
    where one raised (none for a model made of torch's modules alone)."""
    where = plugins.own_frame(e)
    return (f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            + (f" (at {where})" if where else ""))


def first_batch(w, data: Datasets) -> None:
    """The model's forward, the loss and its backward on a batch of the first two training
    samples, on the CPU: a forward that raises, a loss that raises or is not a scalar, or
    parameters that get no gradient (DDP fails on them at its first step) are one line each."""
    import torch
    from torch.utils.data import default_collate

    x, y = default_collate([data.train[i] for i in range(min(2, len(data.train)))])
    torch.manual_seed(w.cfg.seed)
    model = w.build_model()
    try:
        out = model(x)
    except Exception as e:  # noqa: BLE001 - the user's model failed: one line
        raise ConfigError(f"{_name(w)}: the model's forward fails on a first batch of inputs "
                          f"{_shape(x)} (its first layer: {_first_layer(model)}): {_raised(e)}") from None
    try:
        loss = w.loss(out, y)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{_name(w)}: its loss fails on the model's output {_shape(out)} and "
                          f"targets {_shape(y)}: {_raised(e)}") from None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigError(f"{_name(w)}: its loss must be a scalar tensor (the batch's mean); it "
                          f"gave {_shape(loss)} on outputs {_shape(out)}")
    if loss.requires_grad:  # a loss without a graph trains nothing: the methods say so later
        loss.backward()
        no_grad(w, model)


def no_grad(w, model) -> None:
    """One line for parameters that take part in training (requires_grad) but got no gradient
    from the first batch's backward: DDP's reducer waits for every one of them and fails at the
    end of the first step (naming them by index), unless --find-unused-parameters."""
    names = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if not names or w.cfg.find_unused_parameters:
        return
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    raise ConfigError(
        f"{_name(w)}: {len(names)} of the model's {sum(1 for _ in model.parameters())} parameters "
        f"get no gradient from a first batch (its forward or loss never uses them): {shown}. "
        f"DDP, the baseline every method is compared with, fails on them at its first step: "
        f"remove them, freeze them (.requires_grad_(False)), or pass --find-unused-parameters "
        f"if the forward uses them on some batches only (docs/workloads.md#errors-your-workload-can-meet)")

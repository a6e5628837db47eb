"""A workload's checks before anything is spawned: data that exists, and a model and a loss that
work on a first batch. Each failure is one line (ConfigError) naming the workload and what is
wrong: the batch's shape and the model's first layer for a forward that fails, the loss's shape
for one that is not a scalar."""
from __future__ import annotations

from labkit.core.config import ConfigError

from .datasets import Datasets


def _name(w) -> str:
    return f"workload {w.cfg.workload}"


def nonempty(w, data: Datasets) -> Datasets:
    """``data``, once its training and validation sets are known to hold samples."""
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
    return data


def _first_layer(model) -> str:
    for name, m in model.named_modules():
        if name and not list(m.children()):
            return f"{name}: {m}"
    return type(model).__name__


def _shape(x) -> str:
    return f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}" if hasattr(x, "shape") else type(x).__name__


def first_batch(w, data: Datasets) -> None:
    """The model's forward and the loss on a batch of the first two training samples, on the
    CPU: a forward that raises, or a loss that raises or is not a scalar, is one line."""
    import torch
    from torch.utils.data import default_collate

    x, y = default_collate([data.train[i] for i in range(min(2, len(data.train)))])
    torch.manual_seed(w.cfg.seed)
    model = w.build_model()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as e:  # noqa: BLE001 - the user's model failed: one line
        raise ConfigError(f"{_name(w)}: the model's forward fails on a first batch of inputs "
                          f"{_shape(x)} (its first layer: {_first_layer(model)}): "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    try:
        loss = w.loss(out, y)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{_name(w)}: its loss fails on the model's output {_shape(out)} and "
                          f"targets {_shape(y)}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigError(f"{_name(w)}: its loss must be a scalar tensor (the batch's mean); it "
                          f"gave {_shape(loss)} on outputs {_shape(out)}")

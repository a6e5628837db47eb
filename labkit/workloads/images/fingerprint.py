"""The images workload's data fingerprint (labkit reproduce compares it): what a run trained
and validated on, without reading an image."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable

from labkit.core.config import TrainConfig

# the config fields that decide what data a run trains on, per dataset
DATA_FIELDS = {"digits": (), "synthetic": ("synthetic_samples", "image_size", "num_classes"),
               "imagefolder": ("data_dir", "skip_bad_images")}


def sha256_of(chunks: Iterable[bytes]) -> str:
    """sha256 over ``chunks`` in order, as hex."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def data_fingerprint(cfg: TrainConfig) -> dict:
    """A fingerprint of what ``cfg`` (resolved) trains and validates on:
    digits: sha256 of the tensors' bytes, as the ranks build them; imagefolder: sha256 over the
    sorted relative paths, sizes and modification times of the images and the class list (no
    image is read), plus "layout_sha256" without the times (a copy of the same files); synthetic:
    its parameters (the images are drawn from fixed seeds)."""
    fp: dict[str, Any] = {"dataset": cfg.dataset,
                          **{k: getattr(cfg, k) for k in DATA_FIELDS[cfg.dataset]}}
    if cfg.dataset == "digits":
        from .image_sets import build_datasets

        data = build_datasets(cfg)
        tensors = [t for ds in (data.train, data.val) for t in ds.tensors]
        fp["samples"] = [len(data.train), len(data.val)]
        fp["sha256"] = sha256_of(t.contiguous().numpy().tobytes() for t in tensors)
    elif cfg.dataset == "imagefolder":
        from .image_sets import IMG_EXTENSIONS

        root = cfg.data_dir
        entries, classes = [], sorted(e.name for e in os.scandir(os.path.join(root, "train"))
                                      if e.is_dir())
        for split in ("train", "val"):
            for d, _, names in os.walk(os.path.join(root, split), followlinks=True):
                for n in names:
                    if n.lower().endswith(IMG_EXTENSIONS):
                        p = os.path.join(d, n)
                        st = os.stat(p)
                        entries.append((os.path.relpath(p, root), st.st_size, st.st_mtime_ns))
        entries.sort()
        head = json.dumps(classes).encode()
        fp["classes"] = len(classes)
        fp["images"] = len(entries)
        fp["sha256"] = sha256_of([head] + [f"{p}\0{s}\0{t}\n".encode() for p, s, t in entries])
        fp["layout_sha256"] = sha256_of([head] + [f"{p}\0{s}\n".encode() for p, s, _ in entries])
    else:
        fp["sha256"] = sha256_of([json.dumps(fp, sort_keys=True).encode()])
    return fp

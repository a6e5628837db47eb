"""Make an ImageNet-like JPEG ImageFolder for measuring the data path (docs/performance.md):

    python tools/make_jpeg_folder.py /data/jpegs --train 20000 --val 1000 --classes 100

root/{train,val}/<class>/<n>.jpg, baseline JPEGs (PIL, quality 90, 4:2:0 chroma, like most
of ImageNet) of ImageNet-like sizes: the sides drawn around 500 x 375 (landscape, portrait or
square, as ImageNet's are; 375 x 500 on average), the content a smooth random field with
class-dependent colours plus fine noise, so a file costs about what a photograph costs to
decode (ImageNet's average file is about 110 KB). Written by one process per core
(multiprocessing); the same arguments make the same files.
"""
from __future__ import annotations

import argparse
import os
import sys
from multiprocessing import Pool

# (width, height) of the ImageNet-like shapes and how often each is drawn
SHAPES = [((500, 375), 0.55), ((375, 500), 0.15), ((500, 333), 0.15), ((500, 500), 0.10),
          ((333, 500), 0.05)]


def image_size(rng) -> tuple[int, int]:
    r, acc = rng.random(), 0.0
    for (w, h), p in SHAPES:
        acc += p
        if r < acc:
            break
    jitter = rng.uniform(0.85, 1.15)
    return max(64, int(w * jitter)), max(64, int(h * jitter))


def make_one(job: tuple[str, int, int, int]) -> int:
    """Write one JPEG; returns its size in bytes."""
    import numpy as np
    from PIL import Image

    path, cls, index, seed = job
    rng = np.random.default_rng([seed, cls, index])
    import random
    w, h = image_size(random.Random(seed * 1_000_003 + cls * 10_007 + index))
    base = rng.random((6, 8, 3)) * 160 + (cls * 37 % 96)  # a smooth field, class-tinted
    img = Image.fromarray(base.astype(np.uint8)).resize((w, h), Image.BICUBIC)
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-24, 25, (h, w, 3), dtype=np.int16)
    im = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    im.save(path, "JPEG", quality=90, subsampling=2)  # subsampling 2: 4:2:0
    return os.path.getsize(path)


def jobs(root: str, n_train: int, n_val: int, classes: int, seed: int):
    for split, n, offset in (("train", n_train, 0), ("val", n_val, 10_000_000)):
        for c in range(classes):
            os.makedirs(os.path.join(root, split, f"c{c:04d}"), exist_ok=True)
        for i in range(n):
            c = i % classes
            yield os.path.join(root, split, f"c{c:04d}", f"{i:07d}.jpg"), c, offset + i, seed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="folder to create (train/ and val/ inside)")
    p.add_argument("--train", type=int, default=20000, help="training images")
    p.add_argument("--val", type=int, default=1000, help="validation images")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    if min(a.train, a.val) < a.classes or a.classes < 1:
        p.error("--train and --val must each be at least --classes (one image per class)")
    todo = list(jobs(a.root, a.train, a.val, a.classes, a.seed))
    with Pool(a.procs) as pool:
        sizes = pool.map(make_one, todo, chunksize=64)
    print(f"{len(sizes)} JPEGs in {a.root}: {sum(sizes) / len(sizes) / 1024:.0f} KB on average, "
          f"{sum(sizes) / 2**30:.2f} GiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

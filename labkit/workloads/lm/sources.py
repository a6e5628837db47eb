"""Where the lm workload's text is and how large it is, read as bytes: the embedded corpus (the
Python source of the installed torch), a user's text files, nanoGPT's token files. No torch
imported: the launcher's preflight sizes the data from here (labkit.workloads.lm.corpus turns
the bytes into token tensors).

The embedded corpus is :data:`CORPUS_GLOBS` under torch's folder, sorted, concatenated and cut
at :data:`CORPUS_BYTES`: nothing to download, and the same torch version gives the same bytes on
every machine (:func:`corpus_sha256` says which). Every problem is one line (ConfigError) naming
the path.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import numbers
import os
import pickle
from typing import Optional

from labkit.core.config import ConfigError

#: the torch source files of the embedded corpus, relative to torch's folder, in sorted order
CORPUS_GLOBS = ("nn/modules/*.py", "optim/*.py")
#: the embedded corpus is cut here: 900,000 training bytes are 14,062 windows of 64, 219 steps
#: an epoch of batch 32 on 2 trainers: about 22 s an epoch for the tiny model on 2 CPU cores
#: (45 ms a step of one process alone, 75-100 ms with two sharing the cores), 90 s for the
#: default 3 epochs of `labkit run ddp --workload lm --nproc 2`
CORPUS_BYTES = 1_000_000
TOKEN_BYTES = 2  # uint16
#: nanoGPT's vocabulary file beside train.bin and val.bin (labkit.workloads.lm.corpus)
META = "meta.pkl"


# ------------------------------------------------------------------ the embedded corpus
def torch_dir() -> str:
    """The installed torch package's folder, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the embedded dataset reads the installed torch's source, and torch is "
                          "not installed")
    return spec.submodule_search_locations[0]


def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def corpus_files() -> list[str]:
    """The embedded corpus's files, relative to torch's folder ("nn/modules/activation.py"),
    sorted as strings so the order is the same on every machine."""
    root = torch_dir()
    found = {os.path.relpath(p, root).replace(os.sep, "/")
             for pattern in CORPUS_GLOBS for p in glob.glob(os.path.join(root, pattern))}
    return sorted(found)


def corpus_size() -> int:
    """The embedded corpus's bytes, from the files' sizes (nothing read)."""
    root = torch_dir()
    return min(CORPUS_BYTES, sum(os.path.getsize(os.path.join(root, f)) for f in corpus_files()))


def embedded_corpus() -> bytes:
    """The embedded corpus: the files of :func:`corpus_files` concatenated, cut at
    :data:`CORPUS_BYTES`."""
    root, parts, n = torch_dir(), [], 0
    for f in corpus_files():
        if n >= CORPUS_BYTES:
            break
        with open(os.path.join(root, f), "rb") as fh:
            parts.append(fh.read())
        n += len(parts[-1])
    corpus = b"".join(parts)[:CORPUS_BYTES]
    if not corpus:
        raise ConfigError(f"the embedded dataset found no source files in {root!r} "
                          f"({', '.join(CORPUS_GLOBS)})")
    return corpus


def corpus_sha256() -> str:
    """The sha256 of the embedded corpus: equal on two machines means equal bytes."""
    return hashlib.sha256(embedded_corpus()).hexdigest()


# ------------------------------------------------------------------ a user's text or tokens
def _exists(path: str) -> None:
    if not os.path.exists(path):
        raise ConfigError(f"--data-dir {path!r} does not exist (the lm workload reads a text file, "
                          f"a folder of text files, or nanoGPT's uint16 .bin tokens)")


def text_files(path: str) -> list[str]:
    """``path`` itself (a file), or the files under it (a folder), recursively, sorted by their
    path under it; hidden files and folders (.git, .DS_Store) are left out."""
    _exists(path)
    if os.path.isfile(path):
        return [path]
    found = []
    for d, dirs, files in os.walk(path):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        found += [os.path.join(d, f) for f in files if not f.startswith(".")]
    return sorted(found, key=lambda p: os.path.relpath(p, path).split(os.sep))


def read_text(path: str) -> bytes:
    """The bytes of :func:`text_files` concatenated; an empty file or folder is an error."""
    files = text_files(path)
    if not files:
        raise ConfigError(f"--data-dir {path!r} is an empty folder: no text files in it")
    parts = []
    for f in files:
        with open(f, "rb") as fh:
            parts.append(fh.read())
    data = b"".join(parts)
    if not data:
        raise ConfigError(f"--data-dir {path!r} is empty: no text in "
                          f"{'it' if os.path.isfile(path) else f'its {len(files)} file(s)'}")
    return data


def token_files(path: str) -> list[str]:
    """A tokens dataset's files: the one .bin file, or a folder's train.bin and val.bin."""
    _exists(path)
    if os.path.isfile(path):
        return [path]
    files = [os.path.join(path, f"{s}.bin") for s in ("train", "val")]
    if not all(os.path.isfile(f) for f in files):
        raise ConfigError(f"--data-dir {path!r} holds no train.bin and val.bin: the tokens dataset "
                          f"reads one .bin file of uint16 tokens, or a folder holding both")
    return files


def meta_file(path: str) -> Optional[str]:
    """nanoGPT's meta.pkl beside a folder's train.bin and val.bin, where it holds one (a single
    .bin file has none)."""
    meta = os.path.join(path, META)
    return meta if os.path.isdir(path) and os.path.isfile(meta) else None


def read_meta(path: str) -> dict:
    """A meta.pkl as nanoGPT's prepare scripts write it: a pickled dict of ``vocab_size`` (an
    int), ``itos`` (id -> str) and ``stoi`` (str -> id). Unpickled as nanoGPT does: pickle runs
    what the file says, and this is the user's own file, in the --data-dir they name. One line
    for a file that does not unpickle, is no dict, or has no positive int vocab_size, or an
    ``itos`` that is neither a dict nor a list."""
    try:
        with open(path, "rb") as fh:
            meta = pickle.load(fh)
    except Exception as e:  # noqa: BLE001 - whatever the file holds, the same one line
        raise ConfigError(f"{path!r} is unreadable: not a pickled dict of vocab_size, itos and "
                          f"stoi as nanoGPT writes ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path!r} holds a {type(meta).__name__}, not nanoGPT's dict of "
                          f"vocab_size, itos and stoi")
    n = meta.get("vocab_size")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:  # numpy's ints too
        raise ConfigError(f"{path!r} has no vocab_size (a positive int; it holds "
                          f"{', '.join(map(repr, list(meta)[:6])) or 'no keys'})")
    if meta.get("itos") is not None and not isinstance(meta["itos"], (dict, list)):
        raise ConfigError(f"{path!r}: its itos is a {type(meta['itos']).__name__}, not a dict "
                          f"(id -> str) or a list")
    return {**meta, "vocab_size": int(n)}


def token_count(dataset: str, data_dir: str) -> int:
    """The tokens ``dataset`` holds (training and validation), from the files' sizes, nothing
    read: for the host memory preflight, before the data is loaded."""
    if dataset == "embedded":
        return corpus_size()
    if dataset == "text":
        return sum(os.path.getsize(f) for f in text_files(data_dir))
    return sum(os.path.getsize(f) for f in token_files(data_dir)) // TOKEN_BYTES

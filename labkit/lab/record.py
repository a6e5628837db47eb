"""The environment record of a run folder: what is needed to run it again and to tell why a
rerun differs.

    requirements.lock   every installed distribution as name==version (pip install -r accepts it)
    code.diff           `git diff HEAD --binary` when the working tree was dirty
    environment.json    + "packages", "debian", "git" (diff file, untracked files),
                          "determinism", "data" (a fingerprint per method)

Paths that point inside a run folder are stored relative to it (:func:`portable`), so a copied
or moved run folder still works; readers resolve them with :func:`resolve_in_run`. Paths outside
it (a --data-dir, the Python executable) stay absolute.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Iterable, Optional

from labkit.core.config import TrainConfig
from labkit.core.files import atomic_path

LOCK_FILE = "requirements.lock"
DIFF_FILE = "code.diff"
PROJECT = "labkit"
# Debian packages the lab depends on outside Python (the PDF report, the PDF checks)
DEBIAN_PACKAGES = ("chromium", "poppler-utils")


# ------------------------------------------------------------------ packages
def normalize(name: str) -> str:
    """PEP 503 name normalisation: ``Jinja2``, ``jinja2`` and ``jinja_2`` differ only in form,
    ``typing_extensions`` and ``typing-extensions`` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions() -> dict[str, dict]:
    """Every distribution the running interpreter can import, by normalised name:
    {"name": as published, "version", "direct_url": PEP 610 URL or None (editable, local
    path or VCS install: not on an index under that version)}.

    A name found twice on sys.path keeps its first, the one ``import`` would load."""
    from importlib import metadata

    found: dict[str, dict] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue  # a broken .dist-info without metadata
        key = normalize(name)
        if key in found:
            continue
        url = None
        raw = dist.read_text("direct_url.json")
        if raw:
            try:
                info = json.loads(raw)
                url = info.get("url")
                if info.get("dir_info", {}).get("editable"):
                    url = f"editable: {url}"
            except ValueError:
                pass
        found[key] = {"name": name, "version": dist.version, "direct_url": url}
    return dict(sorted(found.items()))


def requirements_lock(dists: Optional[dict[str, dict]] = None) -> str:
    """requirements.lock text: ``name==version`` per distribution, sorted by normalised name.

    This project, and anything installed from a local path, a VCS or in editable mode, cannot
    be fetched from an index by version: such lines are comments naming where they came from
    (the project itself is installed with ``pip install -e .`` from the recorded commit)."""
    dists = distributions() if dists is None else dists
    lines = ["# every distribution installed where this run ran (labkit.lab.record); "
             "pip install -r requirements.lock"]
    for key, d in dists.items():
        if key == PROJECT:
            lines.append(f"# {d['name']}=={d['version']}  (this project: install the recorded "
                         f"commit with pip install -e .)")
        elif d["direct_url"]:
            lines.append(f"# {d['name']}=={d['version']}  (not from an index: {d['direct_url']})")
        else:
            lines.append(f"{d['name']}=={d['version']}")
    return "\n".join(lines) + "\n"


def parse_lock(text: str) -> dict[str, str]:
    """requirements.lock text -> {normalised name: version}; comments, this project included,
    are not packages to install."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        out[normalize(name)] = version.strip()
    return out


def debian_packages(names: Iterable[str] = DEBIAN_PACKAGES) -> dict[str, Optional[str]]:
    """{package: installed version or None}: dpkg-query, where there is one."""
    out: dict[str, Optional[str]] = {}
    for name in names:
        text = _run(["dpkg-query", "-W", "-f=${Status}\t${Version}", name])
        status, _, version = (text or b"").decode(errors="replace").partition("\t")
        out[name] = version.strip() if status.endswith(" installed") and version.strip() else None
    return out


# ------------------------------------------------------------------ code
def _run(args: list[str], cwd: Optional[str | os.PathLike] = None) -> Optional[bytes]:
    """A command's stdout as bytes (a diff may hold any encoding), or None when it fails."""
    try:
        return subprocess.run(args, cwd=cwd, capture_output=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def code_state(repo: str | os.PathLike) -> dict:
    """{"commit", "dirty", "diff": bytes of `git diff HEAD --binary` (None when clean or not a
    repository), "untracked": files git does not track nor ignore}."""
    commit = _run(["git", "rev-parse", "HEAD"], repo)
    if commit is None:
        return {"commit": None, "dirty": False, "diff": None, "untracked": []}
    # staged and unstaged changes against the commit, binary files included, so that
    # `git apply code.diff` on the recorded commit gives back the code that ran
    diff = _run(["git", "diff", "HEAD", "--binary"], repo) or b""
    untracked = (_run(["git", "ls-files", "--others", "--exclude-standard"], repo) or b"")
    files = [f for f in untracked.decode(errors="replace").splitlines() if f]
    return {"commit": commit.decode().strip(), "dirty": bool(diff or files), "diff": diff or None,
            "untracked": files}


# ------------------------------------------------------------------ determinism
def determinism(seed: Optional[int], backend: Optional[str]) -> dict:
    """What decides whether two runs from one seed agree bit for bit, in this process."""
    import torch

    cudnn = torch.backends.cudnn
    return {
        "seed": seed, "backend": backend,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        # the cores this process may run on (labkit.training.dist.bind_cpus); None: no affinity call here
        "cpu_affinity": (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else None),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
    }


# ------------------------------------------------------------------ data
# the config fields that decide what data a run trains on, per dataset
DATA_FIELDS = {"digits": (), "synthetic": ("synthetic_samples", "image_size", "num_classes"),
               "imagefolder": ("data_dir", "skip_bad_images")}


def _sha(chunks: Iterable[bytes]) -> str:
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
        from labkit.training.data import build_datasets

        data = build_datasets(cfg)
        tensors = [t for ds in (data.train, data.val) for t in ds.tensors]
        fp["samples"] = [len(data.train), len(data.val)]
        fp["sha256"] = _sha(t.contiguous().numpy().tobytes() for t in tensors)
    elif cfg.dataset == "imagefolder":
        from labkit.training.data import IMG_EXTENSIONS

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
        fp["sha256"] = _sha([head] + [f"{p}\0{s}\0{t}\n".encode() for p, s, t in entries])
        fp["layout_sha256"] = _sha([head] + [f"{p}\0{s}\n".encode() for p, s, _ in entries])
    else:
        fp["sha256"] = _sha([json.dumps(fp, sort_keys=True).encode()])
    return fp


def data_fingerprints(configs: dict[str, TrainConfig]) -> dict[str, dict]:
    """{method: fingerprint}; methods reading the same data are fingerprinted once."""
    cache: dict[str, dict] = {}
    out = {}
    for m, cfg in configs.items():
        key = json.dumps([cfg.dataset] + [getattr(cfg, k) for k in DATA_FIELDS[cfg.dataset]])
        if key not in cache:
            cache[key] = data_fingerprint(cfg)
        out[m] = cache[key]
    return out


# ------------------------------------------------------------------ the record
def _write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(str(path)) as tmp:
        Path(tmp).write_bytes(data)


def snapshot(configs: dict[str, TrainConfig], repo: str | os.PathLike) -> dict:
    """The record of this machine for the methods' resolved ``configs`` ({method: config}):
    the entries environment.json adds (packages, debian, git, determinism, data) plus the
    bytes that go to files ("_dists", "_diff"), without writing anything."""
    import torch

    dists = distributions()
    code = code_state(repo)
    backends = sorted({c.backend for c in configs.values() if c.backend})
    seeds = sorted({c.seed for c in configs.values()})
    return {
        "packages": {"file": LOCK_FILE, "count": len(dists),
                     **({PROJECT: dists[PROJECT]["version"]} if PROJECT in dists else {})},
        "debian": debian_packages(),
        "git": {"commit": code["commit"], "dirty": code["dirty"],
                "diff_file": DIFF_FILE if code["diff"] else None,
                "diff_sha256": hashlib.sha256(code["diff"]).hexdigest() if code["diff"] else None,
                "untracked": code["untracked"]},
        # the launcher's view; each result file records its rank 0's own ("determinism")
        "determinism": {**determinism(seeds[0] if len(seeds) == 1 else None, ",".join(backends)),
                        "device": "cuda" if torch.cuda.is_available() else "cpu"},
        "data": data_fingerprints(configs),
        "_dists": dists, "_diff": code["diff"],
    }


def write_record(run_dir: str | os.PathLike, snap: dict) -> dict:
    """Write requirements.lock (and code.diff when the tree was dirty) of a :func:`snapshot`
    into ``run_dir``; return the entries for environment.json."""
    run = Path(run_dir)
    _write_bytes(run / LOCK_FILE, requirements_lock(snap["_dists"]).encode())
    if snap["_diff"]:
        _write_bytes(run / DIFF_FILE, snap["_diff"])
    return {k: v for k, v in snap.items() if not k.startswith("_")}


# ------------------------------------------------------------------ portable paths
def portable(doc: Any, run_dir: str | os.PathLike) -> Any:
    """``doc`` with every path inside ``run_dir`` made relative to it (also inside command
    lines); paths elsewhere are kept as they are. For writing run-folder JSON files."""
    root = os.path.abspath(run_dir).rstrip(os.sep)
    real = os.path.realpath(root)

    def fix(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        if not isinstance(v, str):
            return v
        for r in {root, real}:
            if v == r:
                return "."
            if v.startswith(r + os.sep):
                return v[len(r) + 1:]
            v = v.replace(r + os.sep, "")  # inside a command line
        return v

    return fix(doc)


def resolve_in_run(run_dir: str | os.PathLike, path: Optional[str]) -> Optional[Path]:
    """A path read from a run folder's JSON: relative ones are relative to that folder, wherever
    it lies now."""
    if path is None:
        return None
    p = Path(path)
    return p if p.is_absolute() else Path(run_dir) / p

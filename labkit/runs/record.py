"""The environment record of a run folder: what ran where, what is needed to run it again, and
what tells why a rerun differs. Read once per run, before any folder exists (:func:`snapshot`),
and written into the run folder by :func:`write_record`:

    environment.json    the machine (host, CPU, GPUs, versions), "git" (commit, dirty, diff
                        file, untracked files), "packages", "debian", "determinism", "data"
                        (a fingerprint per method)
    requirements.lock   every installed distribution as name==version (labkit.core.lockfile)
    code.diff           `git diff HEAD --binary` when the working tree was dirty

Paths inside the run folder are stored relative to it (labkit.core.layout.portable).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from labkit.core import layout
from labkit.core.config import TrainConfig
from labkit.core.files import atomic_path
from labkit.core.lockfile import PROJECT, distributions, requirements_lock

# a source checkout (its git state goes into environment.json)
REPO_DIR = Path(__file__).resolve().parents[2]
# Debian packages the lab depends on outside Python (the PDF report, the PDF checks)
DEBIAN_PACKAGES = ("chromium", "poppler-utils")


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


# ------------------------------------------------------------------ data
def data_fingerprint(cfg: TrainConfig) -> dict:
    """A fingerprint of what ``cfg`` (resolved) trains and validates on: the workload's
    (labkit.workloads.Workload.fingerprint)."""
    from labkit.workloads import make_workload

    return make_workload(cfg).fingerprint()


# the config fields that can change what data a run reads: equal ones share a fingerprint
DATA_KEY = ("workload", "dataset", "data_dir", "skip_bad_images", "synthetic_samples", "image_size",
            "num_classes", "seq_len")


def data_fingerprints(configs: dict[str, TrainConfig]) -> dict[str, dict]:
    """{method: fingerprint}; methods reading the same data are fingerprinted once."""
    cache: dict[str, dict] = {}
    out = {}
    for m, cfg in configs.items():
        key = json.dumps([getattr(cfg, k) for k in DATA_KEY])
        if key not in cache:
            cache[key] = data_fingerprint(cfg)
        out[m] = cache[key]
    return out


# ------------------------------------------------------------------ the machine
def machine() -> dict:
    """What ran where: host, CPU, GPUs, Python and the versions that decide the numbers."""
    import torch

    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0], "executable": sys.executable,
        "torch": torch.__version__, "torchvision": _torchvision_version(),
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": None, "gpus": [], "driver": None,
    }
    if torch.cuda.is_available():
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["gpus"] = [{"name": torch.cuda.get_device_name(i),
                        "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                       for i in range(torch.cuda.device_count())]
        out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = out.decode().strip() if out else None
    for pkg in ("papermill", "nbconvert", "matplotlib", "numpy"):
        if _version(pkg):
            env[pkg] = _version(pkg)
    return env


def _version(pkg: str) -> Optional[str]:
    """The installed version, without importing the package (matplotlib: 0.5 s)."""
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torchvision_version() -> Optional[str]:
    """torchvision.__version__, which names the build (+cu130) as torch's does and the installed
    metadata does not, read from its version.py: importing torchvision takes a CPU second (its
    ops import torch._dynamo), and this process trains nothing."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / "version.py").read_text())
        for node in tree.body:
            if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                return node.value.value
    except (OSError, SyntaxError, ValueError):
        pass
    return _version("torchvision")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------ the record
def _write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(str(path)) as tmp:
        Path(tmp).write_bytes(data)


def snapshot(configs: dict[str, TrainConfig], seed: Optional[int] = None,
             repo: str | os.PathLike = REPO_DIR) -> dict:
    """The record of this machine for the methods' resolved ``configs`` ({method: config}):
    every entry of environment.json plus the bytes that go to files ("_dists", "_diff"),
    without writing anything. The git state is read here and nowhere else."""
    from labkit.training.dist import determinism

    dists = distributions()
    code = code_state(repo)
    backends = sorted({c.backend for c in configs.values() if c.backend})
    seeds = sorted({c.seed for c in configs.values()})
    env = machine()
    return {
        **env, "seed": seed,
        "git": {"commit": code["commit"], "dirty": code["dirty"],
                "diff_file": layout.DIFF if code["diff"] else None,
                "diff_sha256": hashlib.sha256(code["diff"]).hexdigest() if code["diff"] else None,
                "untracked": code["untracked"]},
        "packages": {"file": layout.LOCK, "count": len(dists),
                     **({PROJECT: dists[PROJECT]["version"]} if PROJECT in dists else {})},
        "debian": debian_packages(),
        # the launcher's view; each result file records its rank 0's own ("determinism")
        "determinism": {**determinism(seeds[0] if len(seeds) == 1 else None, ",".join(backends)),
                        "device": "cuda" if env["cuda_available"] else "cpu"},
        "data": data_fingerprints(configs),
        "_dists": dists, "_diff": code["diff"],
    }


def public(snap: dict) -> dict:
    """A snapshot's entries for environment.json (the file contents left out)."""
    return {k: v for k, v in snap.items() if not k.startswith("_")}


def write_record(run_dir: str | os.PathLike, snap: dict) -> dict:
    """Write requirements.lock (and code.diff when the tree was dirty) of a :func:`snapshot`
    into ``run_dir``; return the entries for environment.json."""
    run = Path(run_dir)
    _write_bytes(run / layout.LOCK, requirements_lock(snap["_dists"]).encode())
    if snap["_diff"]:
        _write_bytes(run / layout.DIFF, snap["_diff"])
    return public(snap)


def environment_now(configs: dict[str, TrainConfig], seed: Optional[int] = None) -> dict:
    """This machine described like a recorded environment (as
    labkit.runs.environments.load_environment reads one): for labkit reproduce and
    labkit experiment --continue, which compare it with the record."""
    from labkit.core.lockfile import parse_lock

    snap = snapshot(configs, seed)
    return {**public(snap), "package_versions": parse_lock(requirements_lock(snap["_dists"]))}

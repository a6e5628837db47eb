"""When the machine runs out (issue 26): the preflight refuses a run folder without room and a
/dev/shm too small for the workers, in one line, creating nothing; during training a full disk,
a killed DataLoader worker, a SIGKILLed rank and CUDA out of memory each end the run with one
line naming the cause, the finished epochs kept, no process left; `labkit report` and the
explorer open what is left. The faults are made for real, from outside the package: tmpfs
mounts (we run as root; skipped where mounting is not permitted) and tests/hooks/sitecustomize.py.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import TINY, labkit, leftovers, strict_json
from labkit.core.resources import Need, oom_kills

pytestmark = pytest.mark.xdist_group("resources")

RUN = ["--nproc", "2", *TINY]


def lines(text: str) -> list[str]:
    return [l for l in text.splitlines() if l.strip()]


strict = strict_json


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs folder of that size, unmounted afterwards."""
    mounted = []

    def mount(size: str) -> Path:
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip() or p.returncode}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


# ------------------------------------------------------------------ the estimates
def test_the_parameter_count_is_the_built_models():
    from labkit.workloads.images.architectures import state_values
    from labkit.workloads.images.models import build_model

    for name in ("resnet10_small", "resnet50"):
        with torch.device("meta"):
            m, _ = build_model(name, 7, None)
        real = sum(t.numel() for t in m.state_dict().values() if t.is_floating_point())
        assert state_values(name, 7) == real, name


def test_a_shortfall_refuses_a_tight_margin_warns():
    from labkit.core.config import ConfigError
    from labkit.training.budget import check

    short = Need("disk space", "/x", 300, 100, "2 checkpoints", "another --out")
    tight = Need("shared memory", "/dev/shm", 100, 120, "workers", "--workers 0")
    ample = Need("host memory", "this node", 100, 1000, "ranks", "lower --nproc")
    assert check([tight, ample]) == [tight.line()]
    assert tight.line().startswith("little headroom: shared memory in /dev/shm")
    with pytest.raises(ConfigError, match=r"not enough disk space in /x: the run needs about "
                                          r"300 B \(2 checkpoints\), 100 B free; another --out"):
        check([tight, short])


def test_each_way_of_running_out_is_named_in_one_line():
    import errno

    from labkit.core.errors import RUN_FAILED_LINE
    from labkit.training.exhaustion import translate

    at = "at epoch 1, step 3 of 5"
    full = OSError(errno.ENOSPC, "No space left on device", "/x/checkpoint.pt")
    cases = {
        "the disk is full: no space left on device writing /x/checkpoint.pt at epoch 1": full,
        "shared memory ran out: /dev/shm is full": RuntimeError(
            "Caught RuntimeError in DataLoader worker process 0.\nunable to write to file "
            "</torch_12_34_0>: No space left on device (28)"),
        "a DataLoader worker (pid 12) was killed by SIGBUS at epoch 1, step 3 of 5: its shared "
        "memory ran out": RuntimeError("DataLoader worker (pid 12) is killed by signal: Bus error. "),
        "a DataLoader worker (pid 12, 13) exited unexpectedly": RuntimeError(
            "DataLoader worker (pid(s) 12, 13) exited unexpectedly"),
        "host memory ran out at epoch 1": MemoryError(),
    }
    for said, e in cases.items():
        try:
            raise RuntimeError("while handling it") from e  # found down the chain, too
        except RuntimeError as outer:
            got = translate(outer, "ddp", 1, at, "/x")
        text = f"labkit.train: error: {got}"
        assert str(got).startswith(f"ddp failed: rank 1: {said}"), got
        assert "\n" not in text and RUN_FAILED_LINE.search(text)  # the launcher's one line
    assert translate(RuntimeError("Connection closed by peer"), "ddp", 1, at, "/x") is None


def test_shared_memory_counts_the_data_the_workers_are_sent(tmp_path):
    """The workers' forkserver pickles an in-memory dataset's tensors into /dev/shm, once per
    rank: two ranks with workers need two copies of the digits besides their batches (an
    estimate of the batches alone let an 8x8 run through a 1 MiB /dev/shm that the digits
    alone overfill); an image folder's dataset is paths, so only its batches count."""
    from labkit.core.config import TrainConfig
    from labkit.training.budget import needs
    from labkit.workloads import make_workload
    from labkit.workloads.images import SYNTHETIC_POOL
    from labkit.workloads.images.image_sets import SyntheticImages

    def shm(**cfg):
        c = TrainConfig(model="resnet10_small", batch_size=64, image_size=8, **cfg)
        return next(n for n in needs(c, make_workload(c), 2, 2, str(tmp_path)) if n.what == "shared memory")

    image = 3 * 8 * 8 * 4
    batches = 2 * 2 * 2 * 64 * image  # 2 loaders x 2 workers x 2 batches each, of 64 images
    digits = shm(dataset="digits")
    assert digits.needed >= 2 * (1797 * image + batches) > 1 << 20
    assert "of in-memory data" in digits.detail and "2 workers" in digits.detail
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
    folder = shm(dataset="imagefolder", data_dir=str(tmp_path))
    assert 2 * batches <= folder.needed < digits.needed
    assert "in-memory data" not in folder.detail
    assert SyntheticImages.POOL == SYNTHETIC_POOL
    synthetic = shm(dataset="synthetic", synthetic_samples=64)
    assert synthetic.needed >= 2 * (2 * SYNTHETIC_POOL * image + batches)


# ------------------------------------------------------------------ the preflight
@pytest.mark.slow
def test_preflight_refuses_a_folder_without_room_and_creates_nothing(tmp_path, tmpfs):
    small = tmpfs("16m")
    p = labkit(["run", "ddp", *RUN, "--out", str(small / "ddp")], tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    said = lines(p.stderr)
    assert len(said) == 1 and said[0].startswith(f"labkit run: error: not enough disk space in "
                                                 f"{small / 'ddp'}: the run needs about "), said
    assert "free; " in said[0] and "--no-checkpoint" in said[0] and "--out" in said[0]
    p = labkit(["experiment", "--methods", "ddp,allreduce", "--runs-dir", str(small),
                *RUN], tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    said = lines(p.stderr)
    assert len(said) == 1 and "not enough disk space" in said[0] and "2 x (" in said[0], said
    assert "--runs-dir" in said[0] and "Traceback" not in p.stdout + p.stderr
    assert list(small.iterdir()) == []  # nothing created


@pytest.mark.slow
def test_preflight_refuses_a_dev_shm_too_small_for_the_workers(tmp_path):
    out = tmp_path / "ddp"
    shell = ('mount -t tmpfs -o size=1m tmpfs /dev/shm || exit 77; exec "$@"')
    # each rank's workers are sent the digits (1.3 MiB at 8x8) besides their batches of 64
    p = labkit(["run", "ddp", *RUN, "--workers", "2", "--batch-size", "64", "--out", str(out)],
               tmp_path, wrap=("unshare", "--mount", "--propagation", "private", "sh", "-c", shell, "sh"))
    if p.returncode == 77 or "unshare:" in p.stderr:
        pytest.skip(f"no private mount namespace here: {p.stderr.strip()}")
    assert p.returncode == 2, p.stdout + p.stderr
    said = lines(p.stderr)
    assert len(said) == 1 and said[0].startswith(
        "labkit run: error: not enough shared memory in /dev/shm: the run needs about "), said
    assert "2 workers" in said[0] and "--workers 0" in said[0] and "1.0 MiB free" in said[0]
    assert not out.exists()


# ------------------------------------------------------------------ during training
@pytest.mark.slow
def test_a_disk_that_fills_at_the_first_checkpoint_is_one_line(tmp_path, tmpfs):
    disk = tmpfs("200m")
    out = disk / "ddp"
    t0 = time.monotonic()
    p = labkit(["run", "ddp", *RUN, "--epochs", "2", "--out", str(out)], tmp_path,
               env={"LABKIT_TEST_FILL": f"{disk / 'filler'}:3000000"})
    assert time.monotonic() - t0 < 60
    assert p.returncode == 1, p.stdout + p.stderr
    said = lines(p.stderr)
    assert len(said) == 1, p.stderr
    assert said[0].startswith(f"labkit: ddp failed: rank 0: the disk is full: no space left on "
                              f"device writing {out / 'checkpoint.pt'} after epoch 1"), said
    assert "Traceback" not in p.stdout + p.stderr and 'File "' not in p.stdout + p.stderr
    r = strict(out / "results_baseline_ddp.json")
    assert r["status"] == "failed" and "the disk is full" in r["error"]
    assert [e["epoch"] for e in r["epochs"]] == [1]
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]  # nothing half-written
    assert not (out / "checkpoint.pt").exists()
    logs = "".join(f.read_text() for f in (out / "logs").rglob("stderr.log"))
    assert "Traceback" in logs and "No space left on device" in logs  # kept in the rank's log
    assert not leftovers(str(out))
    shown_by_readers(out, "the disk is full", tmp_path)


def shown_by_readers(out: Path, why: str, tmp_path: Path) -> None:
    """`labkit report` and the explorer open the folder and say the method failed, and why."""
    copy = tmp_path / "copy" / out.name  # the report writes beside it; the disk is full
    shutil.copytree(out, copy)
    p = labkit(["report", str(copy), "--out", str(tmp_path / "report")], tmp_path)
    # the report is written, and its exit says a result had a problem (report_command: 1)
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert (tmp_path / "report" / "performance_report.txt").exists()
    assert "failed" in p.stdout + p.stderr and why in p.stdout + p.stderr
    from labkit.runs import explore

    rows = explore.comparison_rows(explore.load_runs([copy]))
    assert rows and "status failed" in rows[0]["status"] and why in rows[0]["status"], rows


def kill_cause(before: int | None, after: int | None) -> str:
    """What a SIGKILL the fault sent is put on (a regex), as the kernel's count of OOM kills
    before and after the run calls for (issue 71, item 3): the fault's kill is none of them."""
    if before is None or after is None:
        return (r"killed from outside: by a person or a program, or by the kernel's out-of-memory "
                r"killer if host memory ran out")
    if after > before:  # another program's, on a kernel that counts for the whole machine
        return r"the kernel's out-of-memory killer killed it"
    return (r"killed from outside \(a person or a program sent it SIGKILL\): no out-of-memory "
            r"kill counted by the kernel")


@pytest.mark.slow
@pytest.mark.parametrize("how, said", [
    ("bus", r"was killed by SIGBUS at epoch 1, step [3-5] of 5: its shared memory ran out"),
    ("kill", r"was killed by SIGKILL at epoch 1, step [3-5] of 5: {}")])
def test_a_killed_loader_worker_is_one_line(tmp_path, how, said):
    # killed before step 3; the rank notices when it next waits for its loader, after the
    # batches already made (workers are the fork server's children, not the rank's, so no
    # SIGCHLD tells it sooner: labkit.training.workers)
    out = tmp_path / "ddp"
    kills = oom_kills()
    p = labkit(["run", "ddp", *RUN, "--workers", "1", "--out", str(out)], tmp_path,
               env={"LABKIT_TEST_WORKER": f"ddp:1:2:{how}"})
    said = said.format(kill_cause(kills, oom_kills()))
    assert p.returncode == 1, p.stdout + p.stderr
    errs = lines(p.stderr)
    assert len(errs) == 1 and errs[0].startswith("labkit: ddp failed: rank 1: a DataLoader worker (pid "), errs
    assert re.search(said, errs[0]), errs
    assert "Traceback" not in p.stdout + p.stderr
    r = strict(out / "results_baseline_ddp.json")
    assert r["status"] == "failed" and re.search(said, r["error"])  # the cause, not rank 0's lost peer
    assert not leftovers(str(out))


@pytest.mark.slow
def test_a_rank_killed_as_by_the_oom_killer_is_one_line(tmp_path):
    out = tmp_path / "ddp"
    t0, kills = time.monotonic(), oom_kills()
    p = labkit(["run", "ddp", *RUN, "--epochs", "2", "--max-steps-per-epoch", "3", "--out", str(out)],
               tmp_path, env={"LABKIT_TEST_FAULT": "ddp:1:4:kill"})
    after = oom_kills()
    assert p.returncode == 1, p.stdout + p.stderr
    assert time.monotonic() - t0 < 60  # the run stops: rank 0 does not wait out its timeout
    assert strict(out / "launch.json")["failed_rank"] == 1  # the launcher names the killed rank
    errs = lines(p.stderr)
    assert len(errs) == 1, errs
    assert errs[0].startswith("labkit: ddp failed: rank 1 exited with code -9 (SIGKILL): "), errs
    cause = kill_cause(kills, after)  # the hint follows the kernel's count of OOM kills
    assert re.search(f"\\(SIGKILL\\): {cause}", errs[0]), errs
    assert ("--nproc" in errs[0]) == ("no out-of-memory" not in cause), errs
    r = strict(out / "results_baseline_ddp.json")
    assert r["status"] == "failed" and [e["epoch"] for e in r["epochs"]] == [1]
    assert "rank 1 exited with code -9 (SIGKILL)" in r["error"]
    assert not leftovers(str(out))
    shown_by_readers(out, "SIGKILL", tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA out of memory needs a GPU")
def test_cuda_out_of_memory_is_one_line(tmp_path):
    out = tmp_path / "ddp"
    p = labkit(["run", "ddp", "--nproc", "1", *TINY, "--out", str(out)], tmp_path,
               env={"LABKIT_TEST_CUDA_OOM": "ddp:0:1"})
    assert p.returncode == 1, p.stdout + p.stderr
    errs = lines(p.stderr)
    assert len(errs) == 1 and errs[0].startswith(
        "labkit: ddp failed: rank 0: the GPU ran out of memory at epoch 1, step 2 of 5"), errs
    assert "--batch-size" in errs[0] and "Traceback" not in p.stdout + p.stderr
    assert strict(out / "results_baseline_ddp.json")["status"] == "failed"

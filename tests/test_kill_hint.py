"""A rank killed from outside is blamed on memory only where the kernel counted an out-of-memory
kill (issue 71, item 3). The launcher reads the kernel's count of OOM kills before and after a
run (labkit.core.resources.oom_kills): this cgroup's (v2 memory.events), else the kernel's
(/proc/vmstat, which a cgroup v1 machine and a host without a cgroup namespace have: there
memory.events is missing, the count read None, and every kill -9 was said to be the OOM
killer's). The hint follows what the count says: counted, none counted, or unreadable; and so
does a rank's line for one of its DataLoader workers killed with SIGKILL, from the count as its
workers started (labkit.training.workers)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.core import resources
from labkit.launch.failures import explain_failure

pytestmark = pytest.mark.unit


def signalled(n: int, rank: int, code: int, sig: str, at: str) -> str:
    """One rank's entry in torchrun's failure summary, for a rank a signal ended."""
    return (f"[{n}]:\n  time      : 2026-11-29_02:31:{at}\n  host      : localhost\n"
            f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {31702 + rank})  "
            f"({sig})\n  error_file: <N/A>\n  traceback : Signal {-code} ({sig}) received by PID "
            f"{31702 + rank}\n")


# torchrun's summary when rank 1 was killed with SIGKILL and torchrun then stopped rank 0
# (tests/test_logging.py holds such a block as torchrun printed it)
RULE = "=" * 60 + "\n"
KILLED = ("[rank0]: epoch 1:  40%|####      | 2/5 [00:01<00:02,  1.31batch/s]\n" + RULE
          + "labkit.train FAILED\n" + "-" * 60 + "\nFailures:\n" + signalled(1, 0, -15, "SIGTERM", "07")
          + "-" * 60 + "\nRoot Cause (first observed failure):\n" + signalled(0, 1, -9, "SIGKILL", "06")
          + RULE)

CGROUP, KERNEL = "/sys/fs/cgroup/memory.events", "/proc/vmstat"  # where the kernel counts them


def counters(tmp_path: Path, monkeypatch, cgroup: int | None, kernel: int | None) -> None:
    """The kernel's two OOM counters as labkit.core.resources reads them, from files under
    tmp_path (None: that file is missing, as memory.events is on cgroup v1)."""
    files = {CGROUP: tmp_path / "memory.events", KERNEL: tmp_path / "vmstat"}
    for f in files.values():
        f.unlink(missing_ok=True)
    if cgroup is not None:
        files[CGROUP].write_text(f"low 0\nhigh 0\nmax 0\noom 0\noom_kill {cgroup}\noom_group_kill 0\n")
    if kernel is not None:
        files[KERNEL].write_text(f"nr_free_pages 2731262\npgfault 91234\noom_kill {kernel}\n"
                                 f"unevictable_pgs_culled 0\n")

    def fake_open(path, *a, **kw):
        return open(files.get(str(path), path), *a, **kw)
    monkeypatch.setattr(resources, "open", fake_open, raising=False)


def test_the_kernels_count_is_read_where_the_cgroup_keeps_none(tmp_path, monkeypatch):
    counters(tmp_path, monkeypatch, cgroup=None, kernel=7)  # cgroup v1, as on the lab's VMs
    assert resources.oom_kills() == 7
    counters(tmp_path, monkeypatch, cgroup=2, kernel=7)  # a cgroup v2 container: its own count
    assert resources.oom_kills() == 2
    counters(tmp_path, monkeypatch, cgroup=None, kernel=None)
    assert resources.oom_kills() is None


def killed_rank(tmp_path: Path, monkeypatch, before: tuple, after: tuple) -> str:
    """The one line the launcher says for KILLED, the OOM counters being ``before`` (cgroup,
    kernel) as it starts and ``after`` as it explains, oom worked out as launch.py does."""
    logs = tmp_path / "logs"
    for rank in (0, 1):
        d = logs / "labkit_ab12cd34" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text("epoch 1:  40%|####      | 2/5 [00:01<00:02,  1.31batch/s]\n")
        (d / "stdout.log").write_text(json.dumps({"rank": rank}) + "\n")
    (tmp_path / "before").mkdir()
    (tmp_path / "after").mkdir()
    counters(tmp_path / "before", monkeypatch, *before)
    kills = resources.oom_kills()
    counters(tmp_path / "after", monkeypatch, *after)
    now = resources.oom_kills()
    oom = None if kills is None or now is None else now > kills
    why = explain_failure("ddp", 1, KILLED, str(logs), False, oom)
    assert why.rank == 1 and "\n" not in why.message, why.message
    assert why.message.startswith("ddp failed: rank 1 exited with code -9 (SIGKILL): "), why.message
    return why.message


def test_a_kill_with_no_oom_kill_counted_is_not_blamed_on_memory(tmp_path, monkeypatch):
    line = killed_rank(tmp_path, monkeypatch, (None, 40), (None, 40))  # kill -9 on cgroup v1
    assert "killed from outside (a person or a program sent it SIGKILL): no out-of-memory kill " \
           "counted by the kernel (logs: " in line, line
    assert "memory ran out" not in line and "--nproc" not in line and "available now" not in line


def test_a_kill_the_kernel_counted_as_out_of_memory_is_blamed_on_memory(tmp_path, monkeypatch):
    line = killed_rank(tmp_path, monkeypatch, (3, 40), (4, 41))
    assert "the kernel's out-of-memory killer killed it" in line and "host memory ran out" in line
    assert line.endswith("lower --nproc, --batch-size or --workers (logs: "
                         f"{tmp_path / 'logs' / 'labkit_ab12cd34' / 'attempt_0' / '1'})"), line


def test_a_kill_where_no_count_can_be_read_names_both_causes(tmp_path, monkeypatch):
    line = killed_rank(tmp_path, monkeypatch, (None, None), (None, None))
    assert "killed from outside: by a person or a program, or by the kernel's out-of-memory " \
           "killer if host memory ran out" in line, line
    assert "if memory: lower --nproc, --batch-size or --workers" in line


def killed_worker(tmp_path: Path, monkeypatch, before: tuple, after: tuple) -> str:
    """The one line a rank says for a loader worker that SIGKILL ended, the OOM counters being
    ``before`` (cgroup, kernel) as the rank's workers start and ``after`` as it explains."""
    from labkit.training import workers
    from labkit.training.exhaustion import translate

    monkeypatch.setattr(workers, "_OOM_KILLS", None)  # this rank's count: put back afterwards
    (tmp_path / "before").mkdir()
    (tmp_path / "after").mkdir()
    counters(tmp_path / "before", monkeypatch, *before)
    workers.count_oom_kills()  # as the rank's fork server starts
    counters(tmp_path / "after", monkeypatch, *after)
    # labkit.training.workers.batches' words for a worker the signal ended
    e = RuntimeError("DataLoader worker (pid 12) is killed by signal: Killed. ")
    line = str(translate(e, "ddp", 1, "at epoch 1, step 3 of 5", str(tmp_path)))
    assert line.startswith("ddp failed: rank 1: a DataLoader worker (pid 12) was killed by SIGKILL "
                           "at epoch 1, step 3 of 5: ") and "\n" not in line, line
    return line.split("step 3 of 5: ", 1)[1]


def test_a_worker_killed_with_no_oom_kill_counted_is_not_blamed_on_memory(tmp_path, monkeypatch):
    why = killed_worker(tmp_path, monkeypatch, (None, 40), (None, 40))  # kill -9 on cgroup v1
    assert why == ("killed from outside (a person or a program sent it SIGKILL): no out-of-memory "
                   "kill counted by the kernel"), why


def test_a_worker_killed_as_the_kernel_counted_an_oom_kill_is_blamed_on_memory(tmp_path, monkeypatch):
    why = killed_worker(tmp_path, monkeypatch, (3, 40), (4, 41))
    assert why.startswith("the kernel's out-of-memory killer killed it (the kernel counted an "
                          "out-of-memory kill meanwhile): host memory ran out ("), why
    assert why.endswith(" available now): --workers 0, a smaller --batch-size or a lower --nproc")


def test_a_worker_killed_where_no_count_can_be_read_names_both_causes(tmp_path, monkeypatch):
    why = killed_worker(tmp_path, monkeypatch, (None, None), (None, None))
    assert why.startswith("killed from outside: by a person or a program, or by the kernel's "
                          "out-of-memory killer if host memory ran out (its count cannot be read "
                          "here; dmesg names its victims; "), why
    assert why.endswith(" available now): if memory: --workers 0, a smaller --batch-size or a "
                        "lower --nproc"), why

"""Several nodes: two torchrun agents on 127.0.0.1 joined by torchrun's c10d rendezvous, each
started as users start one per node (``labkit run --nnodes 2 --node-rank K --rdzv-endpoint``),
must train exactly like one node with the same number of processes. And the Slurm script that
starts one agent per node must keep calling ``labkit run`` that way.

Real hosts, NICs and NCCL are not exercised here: both "nodes" are processes of this machine,
talking gloo over loopback.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, TINY, load_json, with_free_port

# its module-scoped fixture is built once: the whole module on one xdist worker
pytestmark = pytest.mark.xdist_group("multinode")

RESULT = "results_baseline_ddp.json"  # ddp's result file
TIMEOUT = 150  # seconds for a whole two-node run; a tiny one takes ~15 s on 2 cores


def run_nodes(method: str, outs: list[Path], cwd: Path, extra=(), env=None) -> list[tuple[int, str]]:
    """``labkit run METHOD`` once per node (1 process each), concurrently, on one rendezvous
    endpoint; returns (exit code, stdout + stderr) per node. Never hangs: after TIMEOUT, or on
    any error, every process group still running is killed. The endpoint's port is one the
    OS handed out; both agents must be told it, so it cannot be bound at use: when another
    process took it meanwhile, the nodes run again on another."""
    def in_use(results) -> bool:
        return any("EADDRINUSE" in text or "Address already in use" in text for _, text in results)

    def attempt(port: int):
        for out in outs:
            shutil.rmtree(out, ignore_errors=True)  # what a refused attempt left
        return _run_nodes(port, method, outs, cwd, extra, env)
    return with_free_port(attempt, tries=3, in_use=in_use)


def _run_nodes(port: int, method: str, outs: list[Path], cwd: Path, extra, env) -> list[tuple[int, str]]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    procs, logs = [], []
    try:
        for k, out in enumerate(outs):
            cmd = [sys.executable, "-m", "labkit", "run", method, "--nproc", "1", *TINY, *extra,
                   "--nnodes", str(len(outs)), "--node-rank", str(k),
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--out", str(out)]
            logs.append(cwd / f"labkit_run_node{k}.txt")  # a file, not a pipe: nothing blocks
            with open(logs[-1], "w") as f:
                procs.append(subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=f,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + TIMEOUT
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
        return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def final(d: Path) -> dict:
    return torch.load(d / "final_model.pt", weights_only=True)


@pytest.fixture(scope="module")
def one_node(ddp_run):
    """The reference: one node, 2 processes, same settings: the session's TINY ddp run
    (conftest; its ranks forked from the warm interpreter, tests/warm.py), read only."""
    return ddp_run


def test_two_nodes_train_exactly_like_one_node(tmp_path, one_node):
    """Two agents with their own --out each (nodes without a shared filesystem).

    torch.equal, not allclose: both runs have world size 2 with the same gloo all-reduce and
    OMP_NUM_THREADS=1, rank k reads shard k in both, and a sum of two float32 values is the
    same whichever comes first, so any difference at all would be a real one (another shard,
    a missing average, a skipped step)."""
    outs = [tmp_path / "node0", tmp_path / "node1"]
    results = run_nodes("ddp", outs, tmp_path)
    for code, text in results:
        assert code == 0, text[-3000:]
    # c10d numbers the ranks itself: global rank 0 (the only writer) may be on either node
    writers = [k for k, d in enumerate(outs) if (d / RESULT).exists()]
    assert len(writers) == 1, [sorted(p.name for p in d.iterdir()) for d in outs]
    w, other = writers[0], 1 - writers[0]
    assert f"results in {outs[w]}" in results[w][1]
    assert "global rank 0 ran on another node" in results[other][1], results[other][1][-2000:]
    assert not (outs[other] / "final_model.pt").exists()
    for k, d in enumerate(outs):  # each node keeps its own logs and launch file
        assert (d / "logs" / f"node{k}" / "torchrun.log").exists()
        assert load_json(d / ("launch.json" if k == 0 else f"launch_node{k}.json"))["returncode"] == 0
    doc = load_json(outs[w] / RESULT)
    assert doc["status"] == "completed" and doc["world_size"] == 2
    # a node of several forks its agent and ranks from the warm process of its machine (the
    # pytest worker's, which fits it), as one node alone does
    assert doc["timeline"]["started_by"] == "warm process", doc["timeline"]

    two, one = final(outs[w]), final(one_node)
    assert set(two) == set(one)
    different = [k for k in one if not torch.equal(two[k], one[k])]
    assert not different, different
    assert doc["all_losses"] == load_json(one_node / RESULT)["all_losses"]


def test_a_rank_failing_on_one_node_is_named_there_and_not_blamed_on_the_other(tmp_path):
    """Both nodes share one --out (a shared filesystem). Rank 1 crashes at step 1 (test-only
    fault switch): the node running rank 1 names it; the other node's rank only lost its peer,
    and that node's launcher says the cause is on another node instead of blaming it."""
    out = tmp_path / "shared"
    results = run_nodes("ddp", [out, out], tmp_path, env={"LABKIT_TEST_FAULT": "ddp:1:1"})
    assert all(code == 1 for code, _ in results), [t[-2000:] for _, t in results]
    texts = [t for _, t in results]
    crashed = [k for k, t in enumerate(texts) if re.search(r"labkit: ddp failed: rank 1 (exited with code 1|"
                                                           r"failed first)", t)]
    assert len(crashed) == 1, texts
    assert "injected fault" in texts[crashed[0]].split("labkit: ddp failed")[-1]
    other = texts[1 - crashed[0]].split("labkit: ddp failed")[-1]
    assert other.startswith(" on another node: rank 0 on this node only lost its peers"), other
    for k in (0, 1):
        assert list((out / "logs" / f"node{k}").glob("**/attempt_0/0/stderr.log"))
    assert {load_json(out / "launch.json")["failed_rank"],
            load_json(out / "launch_node1.json")["failed_rank"]} == {1, None}
    assert load_json(out / RESULT)["status"] == "failed"


# ------------------------------------------------------------------ the Slurm script
SBATCH = ROOT / "slurm" / "labkit.sbatch"


def _srun(text: str) -> tuple[list[str], list[str]]:
    """(srun's own arguments, the command each task runs): the script's one srun line, with
    backslash continuations joined; the task command is the single-quoted `bash -c` body, so
    that each task, not the batch shell, expands $SLURM_NODEID."""
    code = "\n".join(l for l in re.sub(r"\\\n", " ", text).splitlines()
                     if not l.strip().startswith("#"))
    sruns = re.findall(r"^\s*(?:exec\s+)?srun\s(.*?)\bbash -c '([^']*)'", code, re.M | re.S)
    assert len(sruns) == 1, "expected one `srun ... bash -c '...'` line"
    opts, body = sruns[0]
    return shlex.split(opts), shlex.split(body)


def test_slurm_script_starts_one_labkit_agent_per_node():
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    headers = dict(re.findall(r"^#SBATCH\s+--([\w-]+)=(\S+)", text, re.M))
    assert headers.get("ntasks-per-node") == "1", headers
    assert {"nodes", "time", "output"} <= set(headers), headers
    # GPU-less clusters take it as it is: GPUs and cores are asked for at sbatch (documented in
    # the header), and the ranks per node and their threads come from the allocation
    assert not {"gpus-per-node", "gpus", "cpus-per-task"} & set(headers), headers
    assert "sbatch --gpus-per-node=8 slurm/labkit.sbatch" in text and "--cpus-per-task=C" in text
    assert re.search(r'^GPUS=\$\{SLURM_GPUS_ON_NODE:-0\}$', text, re.M)
    assert re.search(r'^CPUS=\$\{SLURM_CPUS_ON_NODE:-1\}$', text, re.M)
    assert re.search(r'^export OMP_NUM_THREADS=\$\{OMP_NUM_THREADS:-\$THREADS\}$', text, re.M)
    opts, task = _srun(text)
    assert "--ntasks-per-node=1" in opts and "--nodes=$SLURM_NNODES" in opts, opts
    assert "--cpus-per-task=$CPUS" in opts and "--label" in opts, opts
    assert task[0] == "exec" and "labkit" in task[1].lower() and task[2] == "run", task
    assert task[3] == "$METHOD"
    flags = {a: task[j + 1] for j, a in enumerate(task[:-1]) if a.startswith("--")}
    assert flags.get("--nnodes") == "$SLURM_NNODES", flags
    assert flags.get("--node-rank") == "$SLURM_NODEID", flags  # per task, inside the quotes
    assert flags.get("--rdzv-endpoint") == "$RDZV_ENDPOINT", flags
    assert flags.get("--nproc") == "$NPROC", flags
    assert "--timeout" in flags and "--out" in flags, flags
    # the endpoint is the first node of the allocation at the address Slurm reaches it by
    # (NodeAddr: a node name need not resolve, as in tests/test_slurm.py's two nodes on one
    # host), and reaches the tasks' environment
    assert re.search(r'^RDZV_NODE=\$\(scontrol show hostnames "\$SLURM_JOB_NODELIST" \| head -n 1\)$',
                     text, re.M)
    assert re.search(r'^RDZV_HOST=\$\(scontrol show node "\$RDZV_NODE" \| grep -o .NodeAddr=', text, re.M)
    assert re.search(r'^RDZV_ENDPOINT="\$RDZV_HOST:\$RDZV_PORT"$', text, re.M)
    assert re.search(r"^RDZV_PORT=\$\{RDZV_PORT:-29500\}", text, re.M)
    exported = set(re.findall(r"^export ([A-Z_ ]+)$", text, re.M)[-1].split())
    assert {"METHOD", "NPROC", "LABKIT", "LABKIT_ARGS", "TIMEOUT", "OUT", "RDZV_ENDPOINT"} <= exported
    for var in ("NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        assert re.search(rf"^export {var}=", text, re.M), var


def test_slurm_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr

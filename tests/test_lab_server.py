"""`make lab` starts JupyterLab as a normal user and as root (containers, cloud notebooks), on
127.0.0.1 only. The test runs the Makefile's own recipe line, on a free port."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from helpers import ROOT, jupyter_port


def lab_command(port: int) -> str:
    """The lab recipe as make would run it (make -n prints it after the setup prerequisites)."""
    # under `make test` MAKELEVEL/MAKEFLAGS are set and a nested make prints "Leaving
    # directory" lines: run it as a user would, from a plain shell
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    p = subprocess.run(["make", "--no-print-directory", "-n", "lab",
                        f"LAB_ARGS=--port={port} --no-browser "
                        "--ServerApp.port_retries=0 --IdentityProvider.token="],
                       cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    return [l for l in p.stdout.splitlines() if l.strip()][-1]


def test_allow_root_only_as_root(tmp_path):
    """The recipe adds --allow-root when id -u is 0 and only then (a fake id plays the user)."""
    line = lab_command(8888)
    assert "--ip=127.0.0.1" in line
    fake = tmp_path / "bin"
    fake.mkdir()
    for uid in ("0", "1000"):
        (fake / "id").write_text(f"#!/bin/sh\necho {uid}\n")
        (fake / "id").chmod(0o755)
        env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
        expanded = subprocess.run(["sh", "-c", "echo " + line], env=env, capture_output=True,
                                  text=True, check=True).stdout
        assert ("--allow-root" in expanded) == (uid == "0"), expanded


@pytest.mark.timeout(180)
def test_make_lab_serves_on_loopback(tmp_path):
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    with open(tmp_path / "lab.log", "w") as log:  # port 0: the server binds one the OS picks
        proc = subprocess.Popen(["sh", "-c", lab_command(0)], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        port = jupyter_port(tmp_path / "runtime", proc)
        deadline, answer = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api", timeout=2) as r:
                    answer = json.load(r)
                break
            except OSError:
                time.sleep(0.5)
        assert answer and "version" in answer, (tmp_path / "lab.log").read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

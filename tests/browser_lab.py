"""A JupyterLab server for the browser tests, and the few UI steps a person takes in it.

The server listens on 127.0.0.1 only, on a free port, behind a random token, with its own
settings and workspace folders (a person's JupyterLab state cannot leak in); stop() ends it and
every process it started (kernels run in their own sessions, and their torchrun children too).
The UI steps go through JupyterLab's menus and widgets, as Galata's do, not through its API.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from helpers import jupyter_port

BIN = Path(sys.executable).parent


class LabServer:
    def __init__(self, root: Path, state: Path):
        self.root, self.token, self.port = root, secrets.token_hex(24), 0  # the OS picks it
        self.log = state / "jupyterlab.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "MPLBACKEND"))}
        # empty user settings: what the page shows is the venv's JupyterLab with the project's
        # settings overrides (make setup installs them: no "Jupyter news?" prompt), as `make lab`
        env.update(JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_RUNTIME_DIR=str(state / "runtime"),
                   JUPYTERLAB_SETTINGS_DIR=str(state / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [str(BIN / "jupyter"), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={root}"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self.port = jupyter_port(state / "runtime", self.proc)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"jupyter lab not answering after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """End the server, its kernels and their children, whatever state they are in."""
        try:
            server = psutil.Process(self.proc.pid)
            procs = [server, *server.children(recursive=True)]
        except psutil.Error:
            procs = []
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server shuts its kernels down
        except ProcessLookupError:
            pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        self.proc.wait(timeout=5)

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Between tests: the last notebook's kernel (and anything it started) ends."""
        for s in self.api("sessions"):
            self.api(f"sessions/{s['id']}", "DELETE")

    def open(self, page, path: str) -> None:
        """Open a notebook (path relative to the root) in a fresh workspace (not the last
        test's tabs) and wait for the project's kernel to be idle."""
        page.goto(f"{self.url}/lab/tree/{path}?reset&token={self.token}")
        page.locator(".jp-KernelName", has_text="Python (labkit)").first.wait_for(timeout=60_000)
        kernel_idle(page)


def kernel_idle(page, timeout: float = 60_000) -> None:
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=timeout)


def menu(page, top: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=top).first.click()
    page.locator(".lm-Menu-itemLabel").get_by_text(item, exact=True).click()


def run_all(page) -> None:
    menu(page, "Run", "Run All Cells")


def prompts(page) -> list[str]:
    # textContent: JupyterLab hides cells outside the view (content-visibility), innerText is "" there
    return page.locator(".jp-CodeCell .jp-InputPrompt").all_text_contents()


def wait_all_ran(page, timeout: float = 120) -> list[str]:
    """Until every code cell shows an execution count (none pending "[*]" or never run "[ ]")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ps = prompts(page)
        if ps and all(p.strip("[]: ").isdigit() for p in ps):
            kernel_idle(page)
            return ps
        page.wait_for_timeout(250)
    raise AssertionError(f"cells still running after {timeout}s: {prompts(page)}")


def screenshot(page, tmp_path: Path, name: str) -> Path:
    """A full-page screenshot of the notebook: JupyterLab scrolls inside its panel, not the
    page, so the panel is unrolled to its whole height first."""
    height = page.evaluate("""() => {
        const nb = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
        if (nb) nb.scrollTop = 0;
        return nb ? nb.scrollHeight - nb.clientHeight + window.innerHeight : 0; }""")
    if height:
        page.set_viewport_size({"width": 1280, "height": max(800, min(height, 16000))})
        page.wait_for_timeout(500)
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot of {name}: {path}")
    return path

"""Section 3.2 of the report: roles and communication flow of each method, with the key code
quoted from labkit's own source at report time, so the write-up never goes stale.

The code is found by a marker comment, ``# report-quote: NAME``, on the line above a function
in labkit/training/sync/ (the source is read as text: the analysis never imports the training code). A
renamed function keeps its marker; a removed marker fails loudly here and in
tests/test_report.py, which checks every name in ``QUOTES`` is present exactly once."""
from __future__ import annotations

import ast
import re
import textwrap
from importlib import resources

from .blocks import Block, Later, Markdown, Text
from .captions import ref

MARKER = re.compile(r"^\s*# report-quote: ([\w-]+)\b")
QUOTES = ("ps-trainer-index", "ps-steps-optimizer", "ps-start-pull", "ps-await-layer",
          "ps-grad-ready", "ps-push", "ps-after-backward", "allreduce-grad-ready",
          "allreduce-start", "allreduce-after-backward", "ddp-setup", "bn-finish-epoch")


class QuoteError(LookupError):
    """A quote marker is missing, repeated, or not above a function."""


def _sources() -> dict[str, str]:
    pkg = resources.files("labkit") / "training" / "sync"
    return {f.name: f.read_text() for f in pkg.iterdir() if f.name.endswith(".py")}


def find_quotes() -> dict[str, list[tuple[str, str]]]:
    """{marker name: [(file, quoted source), ...]} over labkit/training/sync/."""
    found: dict[str, list[tuple[str, str]]] = {}
    for name, src in sorted(_sources().items()):
        lines = src.splitlines()
        funcs = [n for n in ast.walk(ast.parse(src))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for i, line in enumerate(lines, start=1):
            m = MARKER.match(line)
            if not m:
                continue
            # the function whose first line (decorators included) follows the marker
            fn = next((f for f in funcs
                       if min([f.lineno] + [d.lineno for d in f.decorator_list]) == i + 1), None)
            if fn is None:
                raise QuoteError(f"labkit/training/sync/{name}:{i}: marker {m.group(1)!r} is not directly "
                                 "above a function")
            start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
            code = textwrap.dedent("\n".join(lines[start - 1:fn.end_lineno])).rstrip()
            found.setdefault(m.group(1), []).append((name, code))
    return found


def quote(name: str, found: dict | None = None) -> str:
    """The source of the function marked ``# report-quote: name``."""
    hits = (found if found is not None else find_quotes()).get(name, [])
    if len(hits) != 1:
        raise QuoteError(f"report quote {name!r}: found {len(hits)} markers in labkit/training/sync/ "
                         "(expected one)")
    return hits[0][1]


def implementation_markdown(optimizer: str = "SGD") -> str:
    """Section 3.2 as Markdown; ``optimizer``: the workload's ("SGD", "AdamW")."""
    found = find_quotes()

    def code(name: str) -> str:
        return f"```python\n{quote(name, found)}\n```"

    return "\n\n".join([
        "### One training loop, three strategies",
        "All methods share one loop (`labkit/training/trainer.py`). Per step every rank calls "
        "`zero_grad -> before_forward -> [trainers: forward, backward] -> after_backward -> step`; "
        "a method is a small strategy object that fills in these hooks. Trainer *k* of *T* reads "
        f"shard *k* of *T* of the data, gradients are averaged over the trainers, and the same {optimizer} "
        "step is applied, so from one seed all methods reach the same parameters (checked by the "
        "tests against a single-process reference).",
        "### Parameter Server: roles",
        "Rank 0 is the server: it holds the parameters and the optimizer and never runs forward or "
        "backward. Ranks 1..N-1 are workers (trainers). The first worker (rank 1) shows the training "
        "bar and owns the BatchNorm statistics; the server shows batch progress and its "
        "communication times.",
        code("ps-trainer-index") + "\n\n" + code("ps-steps-optimizer"),
        "### Parameter Server: communication flow",
        "Each step: (1) **pull**: the server sends the current parameters to every worker; (2) workers "
        "run forward and backward; (3) **push**: workers send their gradients to the server; (4) the "
        f"server sums and averages them; (5) the server applies the {optimizer} step. `--ps-mode p2p` is the "
        "original guide's protocol: one `send`/`recv` per parameter tensor and per worker, the server "
        "looping over the workers for every tensor. `--ps-mode collective` (default) is the improvement "
        "the guide proposes: parameters and gradients live in one flat buffer each (laid out in the "
        "order backward produces the gradients), cut into buckets. A gradient hook starts each "
        "bucket's `reduce` to rank 0 as soon as backward has produced it, so the push overlaps "
        f"backward; right after its {optimizer} step the server `broadcast`s every bucket, and a worker waits "
        "for a layer's parameters only when its forward reaches that layer, so the pull overlaps "
        "loading the next batch and the forward of the layers before. The pull and push times in "
        "the tables are the time a worker was blocked waiting.",
        "**Parameter pull: started after the server's step, awaited per layer**",
        code("ps-start-pull") + "\n\n" + code("ps-await-layer"),
        "**Gradient push and aggregation**",
        code("ps-grad-ready") + "\n\n" + code("ps-push")
        + "\n\n" + code("ps-after-backward"),
        "### Manual All-Reduce",
        "Gradients are views into flat buckets (about `--bucket-mb` MiB each, in the order backward "
        "produces them). A hook fires when a parameter's gradient is accumulated; when a bucket is "
        "complete its all-reduce starts asynchronously, so communication overlaps the rest of "
        "backward. Buckets start strictly in order on every rank, so the collectives always match. "
        "After backward the trainer only waits for what is still in flight: that wait is the "
        "`avg_comm_time` in the tables. `--no-overlap` starts every bucket after backward instead.",
        code("allreduce-grad-ready") + "\n\n" + code("allreduce-start")
        + "\n\n" + code("allreduce-after-backward"),
        "### Baseline DDP, and how the three compare",
        "DDP does the same bucketing and overlap inside PyTorch's C++ reducer (25 MiB buckets, gradient "
        "hooks, NCCL or gloo all-reduce); the reducer's own runtime statistics give its communication in "
        f"{ref('communication')}, hidden behind backward and exposed. Compared with the parameter server, "
        "both all-reduce methods spread the traffic over all ranks (a ring moves 2(N-1)/N of the gradient "
        "bytes per rank), while the server must receive every worker's gradients and send every worker "
        "the parameters, so its link carries N-1 times the model per step and becomes the bottleneck as "
        "workers are added.",
        code("ddp-setup"),
        "BatchNorm running statistics follow DDP's default (the first trainer's are the model's):",
        code("bn-finish-epoch"),
    ])


def code_blocks(optimizer: str = "SGD") -> list[Block]:
    """Appendix B: the code, quoted when the notebook shows it (Later: the text report only
    says how many functions report.html quotes)."""
    return [Text((f"report.html quotes the code of each method from labkit's own source "
                  f"({len(QUOTES)} functions: the parameter server's pull and push, the manual "
                  f"all-reduce's hooks, DDP's setup).", "")),
            Markdown("The key code, read from labkit's own source when the report is made."),
            Later(lambda: [Markdown(implementation_markdown(optimizer))])]

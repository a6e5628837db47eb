"""The report's order, one list for the notebook (report.ipynb) and the text report: the answer
first, then the results, the optional parts a run has data for, the projection and the
discussion, then the appendix (how to read the report, the code, the environment).

A part appears only when the run has its data; what the run did not include is one line at
the end of the body (not_in_run), with how to add each."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from labkit.core.methods import METHOD_ORDER, SPECS

from . import projection, reading
from .load import RunResults, load_reproduction, load_variants
from .examples import samples_of
from .repeats import has_repeats
from .seeds import has_seeds
from .text import load_bench, ran_on_gpu
from .workload_view import WorkloadView

#: every part of the report in its order: (anchor, heading)
SECTIONS: tuple[tuple[str, str], ...] = (
    ("summary", "Summary"),
    ("results", "Results"),
    ("repeats", "Repeats"),
    ("seeds", "Time to accuracy over seeds"),
    ("variants", "Method variants"),
    ("bench", "Benchmark: where the time goes"),
    ("projection", "Projection to larger clusters"),
    ("discussion", "Discussion"),
    ("examples", "What the model wrote"),
    (reading.ANCHOR, f"Appendix A. {reading.TITLE}"),
    ("code", "Appendix B. Implementation: the code"),
    ("environment", "Appendix C. Environment and configuration"),
)
TITLES = dict(SECTIONS)
APPENDIX = reading.ANCHOR  # the first part of the appendix


def _training(res: RunResults) -> bool:
    return bool(res.docs or res.problems)


def _bench(run: Optional[Path]) -> bool:
    doc = load_bench(run) if run else None
    return doc is not None


def present(res: RunResults, run: Optional[Path]) -> dict[str, bool]:
    """Per part, whether this run has its data."""
    training = _training(res)
    return {"summary": bool(res.ok), "results": training, "repeats": has_repeats(res),
            "seeds": has_seeds(res), "variants": bool(run and load_variants(run)),
            "bench": _bench(run),
            "projection": bool(res.ok) and projection.projected(res) is not None,
            "discussion": training, "examples": bool(samples_of(res)),
            reading.ANCHOR: True, "code": True, "environment": True}


def title(key: str, view: Optional[WorkloadView] = None) -> str:
    """A part's heading, in the words of ``view``'s workload (None: the guide's)."""
    if key == "seeds" and view is not None and not view.guide:
        return "Time to target over seeds"
    return TITLES[key]


def outline(res: RunResults, run: Optional[Path]) -> list[tuple[str, str]]:
    """The parts this run's report has, in order: (anchor, heading)."""
    has = present(res, run)
    return [(k, title(k, res.view)) for k, _ in SECTIONS if has[k]]


def captions_shown(res: RunResults, run: Optional[Path]) -> set[str]:
    """The CAPTIONS keys of the tables the report shows (the appendix defines their terms)."""
    has = present(res, run)
    keys = {"comparison", "communication"} if has["results"] else set()
    keys |= {"efficiency"} if has["results"] and ran_on_gpu(res) else set()
    keys |= {k for k in ("repeats", "seeds", "variants", "bench") if has[k]}
    keys |= {"projection_methods"} if has["projection"] else set()
    keys |= {"reproduction"} if run and load_reproduction(run) else set()
    return keys


def toc_markdown(parts: list[tuple[str, str]]) -> str:
    """The HTML's table of contents: one line of links to the parts' anchors."""
    body = [f"[{t}](#{k})" for k, t in parts if not t.startswith("Appendix")]
    appendix = [f"[{t.split('. ', 1)[0].split()[-1]}. {t.split('. ', 1)[1]}](#{k})"
                for k, t in parts if t.startswith("Appendix")]
    return ("**Contents:** " + " · ".join(body)
            + (" · Appendix: " + " · ".join(appendix) if appendix else ""))


def toc_text(parts: list[tuple[str, str]]) -> str:
    return "Contents: " + "; ".join(t for _, t in parts)


def heading_markdown(key: str, view: Optional[WorkloadView] = None) -> str:
    """A part's heading with its anchor (the table of contents links to it)."""
    return f'## <a id="{key}"></a>{title(key, view)}'


def heading_text(key: str, view: Optional[WorkloadView] = None) -> list[str]:
    t = title(key, view)
    return [t, "-" * len(t), ""]


def not_in_run(res: RunResults, run: Optional[Path]) -> Optional[str]:
    """One line: the parts this run did not include, and how to add each (None: it has all)."""
    has = present(res, run)
    missing = []
    if res.ok and not has["repeats"]:
        to = "accuracy" if res.view.guide else "target"
        missing.append("repeats (`labkit experiment --repeats N`: the spread between launches, "
                       f"and time to {to} over seeds)")
    if res.ok and not has["variants"]:
        missing.append("variants (`--methods ddp,ps,ps-async,allreduce-fp16`, or ps-sharded, "
                       "ddp-fp16, ps-fp16)")
    if not has["bench"]:
        missing.append("bench (`labkit bench --variants ddp,allreduce,ps`: each step against "
                       "compute-only steps and the raw collectives, with the cost model)")
    bound = [m for m in METHOD_ORDER if m in SPECS and SPECS[m].bound]
    if res.ok and bound and not any(m in res.ok for m in bound):
        missing.append(f"the no-communication bound (`--methods ...,{bound[0]}`: what "
                       f"communication costs at most)")
    if res.ok and not has["projection"]:
        missing.append("the projection (DDP and another method, each with its compute-only "
                       "calibration)")
    if res.ok and not ran_on_gpu(res):
        missing.append("GPU use (Table 9: a run on GPUs)")
    return "Not in this run: " + "; ".join(missing) + "." if missing else None

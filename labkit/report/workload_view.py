"""What a run trained and how it is judged, in the report's words: throughput's unit (img/s,
tokens/s), the validation figure a target is set on with its direction (the highest accuracy,
the lowest loss), the other figures, and the figures a reader compares against (a language
model's unigram entropy). Read from the "workload" every result file records
(labkit.workloads.contract.Workload.describe); a file without one, every run folder written
before workloads and the guide's own files, is the guide's image classification.

    view = view_of(res)                  # RunResults, or one Result: view_of_result(doc)
    view.rate, view.target.label         # "tokens/s", "validation loss"
    view.goal(2.46)                      # "a validation loss of 2.460 nats/token"

A workload judged on the guide's validation accuracy (``view.guide``) keeps the guide's words
and sentences exactly: the images report reads as it did before workloads. Nothing here asks a
workload's name: the words follow from its figures' keys, units and directions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from labkit.core import breakdown, stats
from labkit.core.results import Epoch, Result

#: the guide's figure, whose reports keep the guide's words
ACCURACY = "val_accuracy"
#: the default target of a lower-is-better figure: this share of the lowest any method reached
#: (the mirror of breakdown.TARGET_SHARE, 95% of the best accuracy)
LOWER_SHARE = 1.05


def number(v: float) -> str:
    """A figure as the report writes it: 3 decimals in the usual range, else 4 significant
    digits ("2.462", "0.0004521", "1.234e+04")."""
    return f"{v:.3f}" if 0.01 <= abs(v) < 1000 else f"{v:.4g}"


@dataclass(frozen=True)
class FigureView:
    """One validation figure of a workload (a result file's ``workload.figures`` entry)."""
    key: str                    # its key in the epochs: "val_loss", "val_perplexity"
    label: str                  # "validation loss"
    unit: str = ""              # "%", "nats/token", "" for none
    higher_is_better: bool = False
    short: str = ""             # "acc", "loss", "ppl"

    @property
    def percent(self) -> bool:
        return self.unit == "%"

    def value(self, e: Epoch) -> Optional[float]:
        """This figure of epoch ``e``; None where it has none (or not a number)."""
        return e.figure(self.key)

    def text(self, v: float) -> str:
        """A value with its unit: "97.22%", "2.462 nats/token", "20.61"."""
        return f"{v:.2f}%" if self.percent else f"{number(v)} {self.unit}".rstrip()

    def signed(self, v: float) -> str:
        """A difference of two values: "+0.12", "-0.013", "+2.1e-05"."""
        if self.percent:
            return f"{v:+.2f}"
        return f"{v:+.3f}" if v == 0 or abs(v) >= 0.0005 else f"{v:+.1e}"

    def reached(self, v: float, target: float) -> bool:
        """Whether ``v`` is at or beyond ``target`` in the good direction."""
        return v >= target if self.higher_is_better else v <= target

    @property
    def best_word(self) -> str:
        """The best value's adjective: "highest", "lowest"."""
        return "highest" if self.higher_is_better else "lowest"

    @property
    def side(self) -> str:
        """Where a value that reached a target lies: "at or above", "at or below"."""
        return "at or above" if self.higher_is_better else "at or below"

    @property
    def column(self) -> str:
        """Its name with its unit for a table's heading: "validation loss (nats/token)"."""
        return f"{self.label} ({self.unit})" if self.unit else self.label


#: the guide's image classification: judged on validation accuracy, then its loss
IMAGE_FIGURES = (FigureView(ACCURACY, "validation accuracy", "%", True, "acc"),
                 FigureView("val_loss", "validation loss", "", False, "loss"))


@dataclass(frozen=True)
class WorkloadView:
    """A workload as the report speaks of it; the defaults are the guide's image classification."""
    title: str = "image classification"
    unit: str = "images"                 # what throughput counts
    rate: str = "img/s"                  # throughput's unit
    figures: tuple[FigureView, ...] = IMAGE_FIGURES
    optimizer: str = "SGD (momentum, weight decay)"
    references: tuple[tuple[str, float], ...] = field(default=())  # (name, value)
    flops_rule: str = ""                 # how FLOPs per unit are counted, in words

    @property
    def target(self) -> FigureView:
        """The figure a target (time to target) is set on: the first."""
        return self.figures[0]

    @property
    def guide(self) -> bool:
        """Judged on the guide's validation accuracy: the report keeps the guide's words."""
        return self.target.key == ACCURACY

    @property
    def per_unit(self) -> str:
        """One unit, for "GFLOP/image": the unit's singular ("images" -> "image")."""
        return self.unit[:-1] if self.unit.endswith("s") else self.unit

    @property
    def rate_axis(self) -> str:
        """Throughput's axis label: "images / second (all trainers, steady state)"."""
        return f"{self.unit} / second (all trainers, steady state)"

    @property
    def optimizer_step(self) -> str:
        """The optimizer's name without its details: "SGD", "AdamW"."""
        return self.optimizer.split(" (")[0]

    def goal(self, t: float) -> str:
        """The target as the report's sentences name it: "94.21% validation accuracy" (the
        guide's), "a validation loss of 2.462 nats/token"."""
        f = self.target
        return f"{t:.2f}% {f.label}" if self.guide else f"a {f.label} of {f.text(t)}"

    def best_column(self) -> str:
        """The comparison table's column of the best value: "Best accuracy (%)" (the guide's), "Best
        validation loss (nats/token)"."""
        return "Best accuracy (%)" if self.guide else f"Best {self.target.column}"

    def target_references(self) -> list[tuple[str, float]]:
        """(what, value) of each reference in the first figure's unit, or of none stated: a
        name "unigram entropy of the validation text (nats/token)" gives its words before the
        unit."""
        out = []
        for name, v in self.references:
            what, _, unit = name.rstrip(")").partition(" (") if name.endswith(")") else (name, "", "")
            if not unit or unit == self.target.unit:
                out.append((what, v))
        return out

    def extra_figures(self) -> tuple[FigureView, ...]:
        """The figures the epochs' table does not show already (its columns name the guide's)."""
        return tuple(f for f in self.figures if f.key not in (ACCURACY, "val_loss"))


IMAGES = WorkloadView()


def _figure(d: dict) -> Optional[FigureView]:
    key, label = d.get("key"), d.get("label")
    if not isinstance(key, str) or not key:
        return None
    return FigureView(key, str(label or key), str(d.get("unit") or ""),
                      bool(d.get("higher_is_better")), str(d.get("short") or ""))


def view_of_workload(doc: Optional[dict]) -> WorkloadView:
    """The view of a result file's "workload" dict; the guide's image classification for none
    (or one without figures: what it cannot say, the guide's words say)."""
    if not isinstance(doc, dict):
        return IMAGES
    listed = [x for x in doc.get("figures") or [] if isinstance(x, dict)]
    figs = tuple(f for f in map(_figure, listed) if f)
    if not figs:
        return IMAGES
    unit = str(doc.get("unit") or "samples")
    refs = doc.get("references") if isinstance(doc.get("references"), dict) else {}
    return WorkloadView(
        title=str(doc.get("title") or doc.get("name") or ""), unit=unit,
        rate=str(doc.get("rate") or f"{unit}/s"), figures=figs,
        optimizer=str(doc.get("optimizer") or IMAGES.optimizer),
        flops_rule=str(doc.get("flops_rule") or ""),
        references=tuple((str(k), float(v)) for k, v in refs.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)))


def view_of_result(doc: Result) -> WorkloadView:
    return view_of_workload(doc.workload)


def view_of_docs(docs) -> WorkloadView:
    """The view of the first result (of an iterable) that records its workload, else the
    guide's."""
    for d in docs:
        if d.workload is not None:
            return view_of_result(d)
    return IMAGES


def view_of(res) -> WorkloadView:
    """The view of a RunResults (labkit.report.load): its results' workload."""
    return view_of_docs([*res.ok.values(), *res.docs.values()])


# ------------------------------------------------------------------ the target
def default_target(view: WorkloadView, docs: dict[str, Result]) -> Optional[float]:
    """The default target of the view's first figure over ``docs``: 95% of the highest any
    method reached for a higher-is-better figure, 105% of the lowest for a lower-is-better one
    (rounded to the digits the report writes); None where no epoch has the figure."""
    f = view.target
    vals = [v for d in docs.values() for v in d.figure_values(f.key)]
    if not vals:
        return None
    best = max(vals) if f.higher_is_better else min(vals)
    t = (breakdown.TARGET_SHARE if f.higher_is_better else LOWER_SHARE) * best
    return float(f"{t:.2f}") if f.percent else float(number(t))


def target_value(view: WorkloadView, docs: dict[str, Result], given: Optional[float]) -> Optional[float]:
    """The target: ``given``, else the default rule (the guide's: labkit.core.breakdown's)."""
    if view.guide:
        return breakdown.target_accuracy(docs, given)
    return float(given) if given is not None else default_target(view, docs)


def rule_words(view: WorkloadView, flag: Optional[str]) -> str:
    """Where the target came from: the flag that set it, or the default rule in words ("105%
    of the lowest validation loss any method reached")."""
    if flag:
        return f"set by {flag}"
    f = view.target
    share = breakdown.TARGET_SHARE if f.higher_is_better else LOWER_SHARE
    return f"{100 * share:.0f}% of the {f.best_word} {f.label} any method reached"


def time_to_target(view: WorkloadView, doc: Result, target: float) -> breakdown.TimeToAccuracy:
    """When ``doc``'s first figure first reached ``target`` in its good direction: the wall
    time of its epochs up to then (training and validation) and the steps they trained (the
    guide's accuracy: labkit.core.breakdown.time_to_accuracy)."""
    if view.guide:
        return breakdown.time_to_accuracy(doc, target)
    f = view.target
    seconds, steps = 0.0, 0
    for e in doc.epochs:
        seconds += e.train_time + (e.val_time if e.val_time is not None else 0.0)
        steps = None if steps is None or e.steps is None else steps + e.steps
        v = f.value(e)
        if v is not None and f.reached(v, target):
            return breakdown.TimeToAccuracy(target, seconds, steps, e.epoch)
    return breakdown.TimeToAccuracy(target, None, None, None)


def sent_until(doc: Result, epoch: Optional[int]) -> Optional[float]:
    """MB (10^6 bytes) a trainer sent up to the end of ``epoch`` (its epochs' steps x the
    bytes per step the lab counted on the wire, mean over the trainers); None where an epoch
    lacks either."""
    if epoch is None:
        return None
    total = 0.0
    for e in doc.epochs:
        w = e.wire if isinstance(e.wire, dict) else {}
        trainer = w.get("trainer") or []
        sent = [x for x, t in zip(w.get("sent_per_step") or [], trainer) if t] or w.get("sent_per_step")
        if not sent or e.steps is None:
            return None
        total += e.steps * sum(sent) / len(sent) / 1e6
        if e.epoch == epoch:
            return total
    return None


def measure(view: WorkloadView, final: bool = False) -> stats.Measure:
    """The view's first figure as labkit.core.stats compares it over seeds: the best (by its
    direction) or ``final`` value of each run (the guide's: stats.accuracy)."""
    if view.guide:
        return stats.accuracy(final)
    f = view.target
    of = (lambda d: d.final_figure(f.key)) if final else (lambda d: d.best_figure(f.key, f.higher_is_better))
    return stats.Measure(f.label, of, f.text, f.signed, f.unit if f.unit != "%" else "points")

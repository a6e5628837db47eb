"""What a report section returns: blocks, one list that both renderers read. The notebook shows
them (``shown``: Markdown and Html blocks, which Jupyter displays as they are: report.ipynb's one
loop), the text report prints them (``plain``: the lines of performance_report.txt), and the
tests read what they say (a shown block's ``text``).

Most blocks are one thing said both ways: a table's caption (TableCaption: the notebook's bold
caption, the text report's heading) and its rows (Table: HTML, aligned text), both named by the
caption's key and numbered when rendered (labkit.report.captions), so no section types a number.
Where the two say different things a block says which: Markdown and Html are the notebook's,
with the lines the text report prints for them in ``plain`` (none: the notebook's alone), Text
is the text report's alone, a Figure is the notebook's (drawn when it is shown), and Later
holds what only the notebook shows, made only when it shows it (the code listings, the cost
model's validation: the text report never computes them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from . import captions, reading
from .figures import figure_html
from .load import RunResults
from .tables import html_table, text_table
from .workload_view import WorkloadView


def caption(key: str, view: Optional[WorkloadView] = None, **fields) -> str:
    """A table's caption as the notebook shows it: its number, title and text
    (captions.lead), and the link to the definitions its terms have in the appendix."""
    said = captions.lead(key, view, **fields)
    return f"{said} {reading.POINTER}" if reading.shown([key]) else said


class Shown:
    """A block Jupyter displays as it is: its text under its MIME type, and a short plain-text
    stand-in (the default, its repr, would repeat a figure's inline PNG)."""
    MIME = "text/plain"
    text: str
    plain: tuple[str, ...]

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return {self.MIME: self.text, "text/plain": f"<{type(self).__name__} block>"}

    def shown(self) -> list[Shown]:
        return [self]

    def printed(self) -> tuple[str, ...]:
        return self.plain


@dataclass(frozen=True)
class Markdown(Shown):
    text: str
    plain: tuple[str, ...] = ()  # what the text report prints for it (none: the notebook's alone)
    MIME = "text/markdown"


@dataclass(frozen=True)
class Html(Shown):
    text: str
    plain: tuple[str, ...] = ()
    MIME = "text/html"


@dataclass(frozen=True)
class Text:
    """Lines of the text report alone."""
    lines: tuple[str, ...]

    def shown(self) -> list[Shown]:
        return []

    def printed(self) -> tuple[str, ...]:
        return self.lines


@dataclass(frozen=True)
class TableCaption:
    """A table's caption by its key: the notebook's caption (with ``fields`` filled in), the
    text report's heading with ``notes`` under it and a blank line (``in_text`` False: the
    notebook's alone)."""
    key: str
    view: Optional[WorkloadView] = None
    fields: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    in_text: bool = True

    def shown(self) -> list[Shown]:
        return [Markdown(caption(self.key, self.view, **self.fields))]

    def printed(self) -> tuple[str, ...]:
        return (captions.heading(self.key, self.view), *self.notes, "") if self.in_text else ()


@dataclass(frozen=True)
class Table:
    """A table's rows: HTML in the notebook; in the text report ``text`` (None: the rows as
    tables.text_table aligns them), the ``notes`` under it and a blank line."""
    rows: list[dict]
    text: Optional[str] = None
    notes: tuple[str, ...] = ()

    def shown(self) -> list[Shown]:
        return [Html(html_table(self.rows))]

    def printed(self) -> tuple[str, ...]:
        return (text_table(self.rows) if self.text is None else self.text, *self.notes, "")


@dataclass(frozen=True)
class Figure:
    """A figure by its caption key, in the notebook alone (the text report points to plots/):
    its PNG, or a function that draws it and returns its path, called when it is shown."""
    key: str
    png: Union[Path, Callable[[], Path]]
    view: Optional[WorkloadView] = None

    def shown(self) -> list[Shown]:
        png = self.png() if callable(self.png) else self.png
        return [Html(figure_html(png, captions.figure_caption(self.key, self.view)))]

    def printed(self) -> tuple[str, ...]:
        return ()


@dataclass(frozen=True)
class Later:
    """What only the notebook shows, made when it shows it: ``make()``'s blocks."""
    make: Callable[[], list]

    def shown(self) -> list[Shown]:
        return shown(self.make())

    def printed(self) -> tuple[str, ...]:
        return ()


Block = Union[Markdown, Html, Text, TableCaption, Table, Figure, Later]


def shown(blocks: list[Block]) -> list[Shown]:
    """The notebook's rendering: every block as the Markdown and Html Jupyter displays, in
    order, figures drawn and numbers filled in."""
    return [s for b in blocks for s in b.shown()]


def plain(blocks: list[Block]) -> list[str]:
    """The text report's rendering: the lines every block prints, in order."""
    return [line for b in blocks for line in b.printed()]


@dataclass
class Page:
    """What a section is given: the results, the run folder (None: result files from
    elsewhere), its environment, the folder whose plots/ the notebook's own figures go in (None:
    the text report alone, which draws none) and the figures write_plots drew, by caption key."""
    res: RunResults
    run: Optional[Path] = None
    env: Optional[dict] = None
    out: Optional[Path] = None
    plots: dict[str, Path] = field(default_factory=dict)

    @property
    def view(self) -> WorkloadView:
        return self.res.view

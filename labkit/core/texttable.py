"""One plain-text table formatter for every command that prints rows of dicts (report, bench,
cost model). Callers differ only in how a cell reads and how columns align, so those are
arguments, not copies of the function."""
from __future__ import annotations

from typing import Any, Callable, Iterable


def cell(v: Any, none: str = "-") -> str:
    """A cell as text: None as ``none``, everything else with ``str``."""
    return none if v is None else str(v)


def short_number(v: Any) -> str:
    """Measurements: 3 decimals below 10, one above; None as '-' (bench tables)."""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return cell(v)


def two_decimals(v: Any) -> str:
    """Report figures: thousands separators, 2 decimals, NaN as 'nan'."""
    if isinstance(v, float):
        return "nan" if v != v else f"{v:,.2f}"
    return str(v)


def text_table(rows: list[dict], fmt: Callable[[Any], str] = cell, *, empty: str = "(empty)",
               right: bool = False, strip: bool = False, columns: Iterable[str] | None = None) -> str:
    """Rows of dicts as aligned text: a header, a rule of dashes, one line per row.

    ``fmt`` turns a value into its cell; ``right`` right-aligns every column but the first
    (numbers); ``strip`` drops trailing blanks from each line."""
    if not rows:
        return empty
    cols = list(columns or rows[0])
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(xs: list[str]) -> str:
        s = "  ".join(x.rjust(w) if right and i > 0 else x.ljust(w)
                      for i, (x, w) in enumerate(zip(xs, widths)))
        return s.rstrip() if strip else s

    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, cells)])

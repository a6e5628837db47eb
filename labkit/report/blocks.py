"""What a report section returns: blocks that Jupyter shows as they are (``display(*blocks)``)
and that the text report and the tests read (``block.text``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Markdown:
    text: str

    def _repr_markdown_(self) -> str:
        return self.text


@dataclass(frozen=True)
class Html:
    text: str

    def _repr_html_(self) -> str:
        return self.text


Block = Markdown | Html

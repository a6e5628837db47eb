"""What every figure of the report shares: the methods' colours, a figure drawn and saved
atomically, and a figure as an HTML block with its caption."""
from __future__ import annotations

import html
from pathlib import Path

from labkit.core.files import atomic_path

from .workload_view import WorkloadView


class _Colors(dict):
    """The built-ins' colours; a method of one's own gets one of the others, by its name."""
    OTHERS = ("#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")

    def __missing__(self, m: str) -> str:
        return self.OTHERS[sum(map(ord, m)) % len(self.OTHERS)]

    def get(self, m, default=None):
        return default if m is None else self[m]


COLORS = _Colors(ddp="#4C72B0", allreduce="#55A868", ps="#C44E52")


def plot_stem(key: str, view: WorkloadView) -> str:
    """The file name (without .png) of the figure ``key`` (a PLOTS or SEED_PLOTS name): the
    key itself, or for a workload not judged on accuracy its "accuracy" read "validation"
    (accuracy_curves.png holds a language model's validation loss as validation_curves.png)."""
    return key if view.guide else key.replace("accuracy", "validation")


def plot_key(stem: str) -> str:
    """The figure's key (its caption's) of a file name plot_stem gave."""
    return "accuracy" + stem[len("validation"):] if stem.startswith("validation_") else stem


def save_figure(png: Path, size: tuple[float, float], panels: int, draw) -> Path:
    """``draw(ax)`` (or ``draw(axes)`` for several panels side by side) into ``png``,
    written atomically (the sweep's figures)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(1, panels, figsize=size, dpi=110)
    draw(ax)
    fig.tight_layout()
    with atomic_path(str(png)) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return png


def figure_html(png: Path, caption: str) -> str:
    """A figure with its caption in one block that a PDF page break cannot split."""
    import base64

    b64 = base64.b64encode(Path(png).read_bytes()).decode()
    cap = html.escape(caption)
    return (f'<figure style="break-inside: avoid; margin: 0 0 1.5em 0"><figcaption><b>{cap}</b>'
            f'</figcaption><img src="data:image/png;base64,{b64}" alt="{cap}" style="max-width: 100%">'
            f'</figure>')

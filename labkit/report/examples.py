"""What each method's model wrote at the end of its run: a result file's "examples" (a language
model's samples, each continuing a prompt taken from the validation text; labkit.workloads'
Workload.finish), shown near the end of the report, escaped (the model may write anything).
Methods whose models wrote the same samples are named together, shown once."""
from __future__ import annotations

import html

from labkit.core.methods import METHOD_ORDER, label

from .blocks import Block, Html, Markdown, Shown, plain, shown
from .load import RunResults

#: the most characters of one sample's prompt or text the report shows
MAX_CHARS = 600


def _part(s: dict, words: str, ids: str) -> str:
    """A sample's prompt or text: its decoded string, else its token ids (a tokens dataset)."""
    v = s.get(words)
    if isinstance(v, str):
        return v[:MAX_CHARS]
    v = s.get(ids)
    return " ".join(map(str, v))[:MAX_CHARS] if isinstance(v, list) else ""


def samples_of(res: RunResults) -> list[tuple[list[str], list[tuple[str, str]]]]:
    """([methods], [(prompt, text), ...]) per distinct set of samples, in the registry's order:
    methods whose models wrote the same samples share one entry."""
    groups: dict[tuple, list[str]] = {}
    for m in METHOD_ORDER:
        d = res.ok.get(m)
        got = (d.examples or {}).get("samples") if d is not None and isinstance(d.examples, dict) else None
        pairs = tuple((_part(s, "prompt", "prompt_tokens"), _part(s, "text", "tokens"))
                      for s in got or [] if isinstance(s, dict))
        pairs = tuple(p for p in pairs if p[1])
        if pairs:
            groups.setdefault(pairs, []).append(m)
    return [(ms, list(pairs)) for pairs, ms in groups.items()]


INTRO = ("At the end of its run each method's final model continued a few prompts taken from the "
         "validation text (grey: the prompt; black: what the model wrote). Methods named together "
         "wrote the same samples.")


def examples_blocks(res: RunResults) -> list[Block]:
    """The report's part (blocks): the intro, then each set of samples under the methods that
    wrote it; the text report quotes each prompt and what followed it."""
    groups = samples_of(res)
    if not groups:
        return []
    parts, said = [], []
    for ms, pairs in groups:
        names = ", ".join(label(m) for m in ms)
        samples = "".join(f'<pre style="white-space: pre-wrap; margin: 0.3em 0 0.6em 0; padding: 0.4em; '
                          f'background: #f7f7f7; border-left: 3px solid #ccc">'
                          f'<span style="color:#888">{html.escape(p)}</span>{html.escape(t)}</pre>'
                          for p, t in pairs)
        parts.append(f"<p><b>{html.escape(names)}</b></p>{samples}")
        said += [names + ":", *(f"  {p!r} -> {t!r}" for p, t in pairs), ""]
    plain_intro = INTRO.replace(" (grey: the prompt; black: what the model wrote)", "")
    return [Markdown(INTRO, plain=(plain_intro, "")), Html("".join(parts), plain=tuple(said))]


def examples_section(res: RunResults) -> list[Shown]:
    """The part as the notebook shows it."""
    return shown(examples_blocks(res))


def examples_text(res: RunResults) -> list[str]:
    """The same for performance_report.txt: each prompt and what followed it, quoted."""
    return plain(examples_blocks(res))

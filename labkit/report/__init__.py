"""The analysis: the guide's analyze_results.py, for a run folder or any result files.

    labkit report runs/latest                      # a run folder
    labkit report results_*.json --out analysis/   # files from the original scripts work too

Prints the comparison and communication tables, writes seven plots under plots/ (the guide's
five, the ranks' waits and the bytes on the wire) and performance_report.txt. A missing, failed or corrupt result file is named and the rest
still renders. Result files are only read, never modified.

Modules: ``load`` (result files), ``tables``, ``plots``, ``text`` (findings, the terminal's
summary), ``sections`` (the results, benchmark and cost model, variants, reproduction,
environment), ``repeats`` (--repeats), ``seeds`` (time to accuracy over seeds, with MLPerf's
scoring), ``sweep`` (the scaling study of `labkit sweep`), ``implementation`` (the code
listings, quoting the source by marker), ``captions`` (every caption, numbered by its place, and
references by key), ``reading`` (the definitions the captions point to), ``summary`` (page
one), ``blocks`` (what a part returns, and the notebook's and the text's rendering of it),
``outline`` (the parts in order, each with the function that makes it, and the table of
contents), ``textreport`` (performance_report.txt), ``workload_view`` (the workload's words:
img/s or tokens/s, accuracy or loss, the target's direction) and ``examples`` (what a language
model wrote).
The names below are what notebooks/report.ipynb, explore and the CLI use.
"""
from __future__ import annotations

from labkit.core.methods import METHOD_ORDER, RESULT_FILES, SHORT

from .blocks import Block, Html, Markdown, Page, caption, plain, shown
from .captions import CAPTIONS, figure_caption, heading, ref
from .implementation import QuoteError, implementation_markdown, quote
from .load import (NAN, ResultError, RunResults, load_env, load_files,
                   load_reproduction, load_result, load_run, load_variants, method_key)
from .figures import COLORS, figure_html, plot_key, plot_stem
from .plots import (PLOTS, plot_accuracy, plot_communication, plot_losses, plot_throughput,
                    plot_training_time, write_plots)
from .repeats import aggregate_rows, repeat_rows, repeats_section
from .projection import projection_section
from .seeds import SEED_PLOTS, seeds_section
from .sections import bench_section, packages_html, reproduction_section, variants_section
from .tables import (comm_ms, communication_rows, comparison_rows, config_rows, efficiency_rows,
                     environment_rows,
                     epoch_rows, html_table, intervals, method_runs, reproduction_rows, target_text, text_table,
                     variant_rows)
from .discuss import discussion, discussion_markdown
from .text import (accuracy_verdicts, load_bench, ran_on_gpu, reproduction_summary,
                   speed_verdicts, terminal_summary, verdict_lines)
from .textreport import text_report, write_report
from .summary import summary_lines
from .outline import (SECTIONS, captions_shown, heading_markdown, not_in_run, outline, page_blocks,
                      toc_markdown)
from .reading import reading_markdown
from .examples import examples_section, examples_text
from .workload_view import IMAGES, FigureView, WorkloadView, view_of, view_of_result

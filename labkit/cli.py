"""`labkit [-v | -q] run | experiment | sweep | bench | model | report | reproduce | runs | diff |
check | warm` (also `python -m labkit ...`). Progress goes through each module's logger
(labkit.core.log: -q hides it, -v adds debug lines); what a command produces (its summary, a
table, JSON) is printed to stdout, and shows with -q too."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Optional

from .core import params, stop
from .core.cliparser import OneLineParser
from .core.config import DEFAULT_VARIANTS, VARIANTS, ConfigError, TrainConfig
from .core.log import setup as setup_logging, transcript
from .core.status import Status
from .orchestrate.check import add_check_parser, checked_launch, cmd_check, method_help

log = logging.getLogger(__name__)


def _nproc(text: str) -> Optional[int]:
    """--nproc N, or --nproc auto (labkit.launch.launch_params.machine_defaults; N < 1 is rejected by validate)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes or auto, got {text!r}") from None


NPROC_HELP = ("processes per node, or auto: one per GPU, 2 sharing a single GPU, else 4 "
              "(default: auto)")


def _add_nodes(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-node (torchrun c10d rendezvous; single node on loopback by default)")
    g.add_argument("--nnodes", type=int, help="number of nodes (default 1)")
    g.add_argument("--node-rank", dest="node_rank", type=int,
                   help="this node's number, 0..nnodes-1, different on every node: names its "
                        "logs/node<k> folder (default 0). torchrun's c10d rendezvous numbers the "
                        "ranks itself, so global rank 0, which writes the results, may run on any node")
    g.add_argument("--rdzv-endpoint", dest="rdzv_endpoint", help="host:port of the rendezvous")
    g.add_argument("--max-restarts", dest="max_restarts", type=int,
                   help="torchrun restarts of the worker group after a failure; each restart "
                        "resumes from the last epoch checkpoint (default 0)")
    c = p.add_argument_group("an emulated cluster on this machine (docs/emulated-cluster.md)")
    c.add_argument("--emulate-nodes", dest="emulate_nodes", type=int,
                   help="run on N emulated nodes of --nproc ranks each: network namespaces "
                        "with their own hostnames, joined by shaped links (default: none)")
    c.add_argument("--link", help="with --emulate-nodes: each node's link, each way: 100mbit, "
                   "1gbit, 2.5gbit, ... or unshaped (default); a one-way delay as 100mbit:5ms "
                   "(needs sch_netem)")


def _percent(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not an accuracy in (0, 100]")
    return v


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v == v and abs(v) != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    return v


def _add_experiment(e: argparse.ArgumentParser, sweep: bool = False) -> None:
    """`labkit experiment`'s flags; `labkit sweep` takes them all, for every grid point."""
    e.add_argument("-f", "--parameters-file", dest="parameters_file",
                   help="papermill-style YAML file of parameters (flags override it)")
    e.add_argument("--methods", help="comma-separated, e.g. ddp,file.py:Class (default: ddp,allreduce,ps,nosync)")
    e.add_argument("--nproc", type=_nproc, help=NPROC_HELP + (" (a grid's nproc=... overrides it)"
                                                              if sweep else ""))
    e.add_argument("--repeats", type=int, help="run every method N times, in rotated order "
                   "(ABC, BCA, CAB, ...), repeat i from seed + i - 1 (default 1)")
    e.add_argument("--runs-dir", dest="runs_dir", help="where run folders go (default: the "
                   "project's runs/, from any folder)")
    e.add_argument("--tag", help="suffix of the run folder name" + (" (default: sweep)" if sweep else ""))
    e.add_argument("--cell-timeout", dest="cell_timeout", type=int,
                   help="seconds a notebook cell may run (default 3600)")
    e.add_argument("--target-accuracy", dest="target_accuracy", type=_percent,
                   help="validation accuracy (%%) for the report's time to accuracy (default: "
                        "95%% of the best accuracy any method reached)")
    e.add_argument("--target", dest="target", type=_finite,
                   help="the target of the workload's first validation figure, for the report's "
                        "time to target: a validation loss for lm (reached at or below it), an "
                        "accuracy (%%) for images (default: 95%% of the best accuracy, or 105%% "
                        "of the lowest loss, any method reached)")
    e.add_argument("--no-report", dest="report", action="store_false",
                   help="results only: skip the report notebook, HTML and PDF"
                        + (" of each grid point (the sweep report is always written)" if sweep else ""))
    params.add_arguments(e, TrainConfig, skip=("method", "out"), defaults=False)
    _add_nodes(e)


#: the commands that train, whose flags are TrainConfig's and a plug-in's options
TRAINING = ("run", "experiment", "sweep", "bench")


def build_parser(plugins: tuple[type, ...] = ()) -> argparse.ArgumentParser:
    """The `labkit` command's parser; ``plugins``: the Options dataclasses of the methods and
    workload of one's own a command line names, whose fields become flags of the commands
    that train (labkit.training.plugin_options)."""
    # errors in one line and a hint, like every other labkit error (not argparse's usage block)
    p = OneLineParser(prog="labkit", description="Measure what data-parallel training costs.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more detail: the torchrun "
                   "command, torchrun's own lines (kept in torchrun.log otherwise)")
    p.add_argument("-q", "--quiet", action="count", default=0, help="only the summary, warnings "
                   "and errors (-qq: the summary and errors)")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_run_parser, _experiment_parser, _sweep_parser, _bench_parser, _model_parser,
                _report_parser, _reproduce_parser, _runs_parser, _diff_parser, add_check_parser,
                _warm_parser):
        add(sub)
    if plugins:
        from .training.plugin_options import add_flags
        for name in TRAINING:
            add_flags(sub.choices[name], list(plugins))
    return p


def parse_args(argv: list[str]) -> dict:
    """The command line as a dict, a plug-in's options under ``options`` (their flags known
    once the command line's first reading named the plug-in: labkit.training.plugin_options)."""
    if not any(a in TRAINING for a in argv):  # report, runs, diff, ...: no plug-in to look for
        return vars(build_parser().parse_args(argv))
    from .training.plugin_options import into_options, parse

    ns, names = parse(lambda found: build_parser(tuple(found)), argv)
    return into_options(vars(ns), names)


# argument_default=SUPPRESS: only flags the user gave appear, so they can override a YAML file
def _run_parser(sub) -> None:
    r = sub.add_parser("run", help="run one method under torchrun (validated, live output, "
                       "per-rank logs)", argument_default=argparse.SUPPRESS)
    r.add_argument("method", help=method_help())
    r.add_argument("--nproc", type=_nproc, help=NPROC_HELP)
    params.add_arguments(r, TrainConfig, skip=("method",), defaults=False)
    r.add_argument("--runs-dir", dest="runs_dir", help="without --out: where the new run folder "
                   "goes (default: the project's runs/, from any folder)")
    _add_nodes(r)


def _experiment_parser(sub) -> None:
    e = sub.add_parser("experiment", help="all methods via papermill notebooks, then the report",
                       argument_default=argparse.SUPPRESS)
    _add_experiment(e)
    e.add_argument("--continue", dest="continue_run", metavar="RUN", help="finish an interrupted "
                   "experiment in its own folder: complete methods are kept, the others resume "
                   "from their last checkpoint or run again (no other flags)")
    e.add_argument("--allow-changed-env", dest="allow_changed_env", action="store_true",
                   help="with --continue: go on although code, packages or data changed since "
                        "the run started (the change is recorded)")


def _sweep_parser(sub) -> None:
    s = sub.add_parser("sweep", help="a scaling study: one experiment per grid point (e.g. "
                       "nproc=2,4), then throughput vs processes and scaling efficiency",
                       argument_default=argparse.SUPPRESS)
    s.add_argument("grid", nargs="*", metavar="NAME=V1,V2",
                   help="a parameter and its values, e.g. nproc=2,3,4 or batch_size=16,32 (any training "
                        "parameter, nproc, or with --emulate-nodes link=100mbit,1gbit; several give "
                        "their product; also `sweep: {nproc: [2, 4]}` in the -f file)")
    _add_experiment(s, sweep=True)
    s.add_argument("--slurm", action="store_true", help="each grid point a Slurm job (one sbatch "
                   "job array), gathered with the sweep report when they end (docs/sweep.md)")
    s.add_argument("--sbatch-args", dest="sbatch_args", metavar="ARGS", help="with --slurm: more "
                   "sbatch options for the points' jobs, e.g. \"--partition=gpu --gpus-per-node=8\"")


def _bench_parser(sub) -> None:
    from .launch.launch_params import Nodes
    b = sub.add_parser("bench", help="time each method against DDP and the raw collectives "
                       "(compute-only steps, exposed communication, bandwidths)",
                       argument_default=argparse.SUPPRESS)
    b.add_argument("--variants", help="comma-separated, from: " + ", ".join(VARIANTS) +
                   f" (default: {','.join(DEFAULT_VARIANTS)})")
    b.add_argument("--nproc", help="comma-separated process counts, per node with --emulate-nodes "
                   "(default: the GPU count with GPUs, 2 sharing a single GPU, else 2,4)")
    b.add_argument("--steps", type=int, help="steps per trial (default 10)")
    b.add_argument("--trials", type=int, help="timed trials, synchronised and compute-only each (default 3)")
    b.add_argument("--warmup", type=int, help="untimed steps before each kind of trial (default 3)")
    b.add_argument("--profile", action="store_const", const=3, dest="profile_steps",
                   help="also write a torch.profiler Chrome trace of 3 steps per variant and rank")
    b.add_argument("--profile-steps", dest="profile_steps", type=int,
                   help="like --profile, with this many steps")
    b.add_argument("--runs-dir", dest="runs_dir", help="where run folders go (default: the project's runs/)")
    b.add_argument("--tag", help="suffix of the run folder name (default: bench)")
    b.add_argument("--no-pricing", dest="pricing", action="store_false", help="time each method's own "
                   "loop only, not the rounds that price its instruments (a shorter bench)")
    b.add_argument("--overhead-control", dest="control", action="store_true",
                   help="the overhead job runs the plain loop twice, and reports the second against "
                   "the first (an A/A control: the job's own noise floor), 1.5x its time")
    b.add_argument("--no-report", dest="report", action="store_false",
                   help="skip the HTML/PDF report (bench.json, bench.txt and bench.png are written)")
    params.add_arguments(b, TrainConfig, skip=("method", "out"), defaults=False)
    params.add_arguments(b, Nodes, skip=("nnodes", "node_rank", "rdzv_endpoint", "max_restarts"), defaults=False)


def _model_parser(sub) -> None:
    sub.add_parser("model", add_help=False, prefix_chars="\0",
                   help="cost model: validate against a bench.json and project to 1024 GPUs "
                        "(labkit model --help)").add_argument("argv", nargs="*")


def _warm_parser(sub) -> None:
    sub.add_parser("warm", help="run a command (labkit warm -- jupyter lab) beside one warm "
                   "process: every launch under it forks its agent, ranks and notebook kernels "
                   "from there, torch imported once").add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG ...]")


def _report_parser(sub) -> None:
    rp = sub.add_parser("report", help="tables, seven plots and performance_report.txt; with "
                        "--html, a run folder's report.html and report.pdf")
    rp.add_argument("paths", nargs="+", metavar="RUN_DIR_OR_FILES",
                    help="a run folder, a folder with results_*.json, or result files")
    rp.add_argument("--out", help="where plots/ and performance_report.txt go (default: "
                    "<run>/report for a run folder, else the current folder, as the guide's "
                    "analyze_results.py)")
    rp.add_argument("--html", action="store_true",
                    help="write the report labkit experiment writes (report.ipynb executed, "
                         "report.html, report.pdf where Chromium is) into RUN_DIR/report/, for a "
                         "run folder made with --no-report, moved or made by an older labkit; a "
                         "previous report is replaced whole, and the command says so")


def _reproduce_parser(sub) -> None:
    rr = sub.add_parser("reproduce", help="run a recorded experiment again into a new run folder "
                        "and compare: identical, equal within tolerance, or different")
    rr.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by labkit experiment")
    rr.add_argument("--methods", help="comma-separated subset of the run's methods (default: all)")
    rr.add_argument("--out", help="folder the new run folder goes in (default: the folder "
                    "holding RUN_DIR, e.g. runs/)")
    rr.add_argument("--tolerance", type=float, help="largest absolute difference of a loss, "
                    "metric or parameter that still counts as reproduced (default: bit for bit)")


def _runs_parser(sub) -> None:
    r = sub.add_parser("runs", help="the lab notebook: one row per run folder, the parameters "
                       "that differ, each method's throughput with its 95%% CI and verdict")
    r.add_argument("runs_dir", nargs="?", default=None, metavar="RUNS_DIR",
                   help="default: the project's runs/, from any folder")
    r.add_argument("--tag", help="only runs whose tag contains this")
    r.add_argument("--since", help="only runs started since a date (2026-11-20) or an age (3d, 12h)")
    r.add_argument("--status", help="only runs with this status (complete, failed, interrupted, "
                   "running, stopped, pending, unreadable)")
    r.add_argument("--sort", default="when", help="a column or a parameter (default: when)")
    r.add_argument("--reverse", action="store_true", help="sort descending")
    r.add_argument("--all", dest="all_params", action="store_true", help="every parameter, not "
                   "only those that differ")
    r.add_argument("--json", dest="as_json", action="store_true", help="JSON for scripts")


def _diff_parser(sub) -> None:
    d = sub.add_parser("diff", help="what changed between two run folders (parameters, code, "
                       "packages, data, machine) and what came of it")
    d.add_argument("run_a", metavar="RUN_A")
    d.add_argument("run_b", metavar="RUN_B")
    d.add_argument("--all", dest="everything", action="store_true",
                   help="show every parameter and reason, not only what differs")
    d.add_argument("--figure", help="the loss curves of both runs (default: "
                   "diff_<A>_vs_<B>.png in the current folder)")
    d.add_argument("--json", dest="as_json", action="store_true", help="JSON for scripts")


def _load_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise ConfigError(f"cannot read parameters file {path!r}: {err.strerror}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"parameters file {path!r} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"parameters file {path!r} must be a mapping of name: value")
    return data


def _split(values: dict):
    """Flags and file values -> (TrainConfig with the machine's defaults, LaunchParams), checked
    like the notebook's parameters."""
    from .launch.launch_params import split_params, with_machine_defaults

    train, launch_params = split_params(values)
    return TrainConfig(**with_machine_defaults(train, launch_params.nproc)), launch_params


def _refuse_others_options(values: dict, method: str) -> None:
    """`labkit run M`: an option that only other built-in methods read (``--no-reshard-after-
    forward`` for ddp) would be ignored: one line. A method of one's own may read any (a
    subclass of a built-in's reads its options), and an experiment's flags go to all its
    methods, so only a built-in's run is checked."""
    from .core import builtins, params

    own = builtins.METHODS.get(method)
    if own is None:
        return
    for k in values:
        owners = [m for m, d in builtins.METHODS.items() if k in d.get("options", ())]
        if owners and k not in own["options"]:
            raise ConfigError(f"{params.flag(k)} is an option of {', '.join(owners)}, which "
                              f"{method} does not read: drop it, or run {owners[0]}")


def cmd_run(values: dict) -> int:
    from .launch.launch_params import method_out, nproc_or_default

    cfg, lp = _split(values)
    _refuse_others_options(values, cfg.method)
    out = method_out(cfg, lp.runs_dir)
    res = checked_launch(cfg, nproc_or_default(lp.nproc), out, lp.nodes())  # exact? then run
    if not res.ok:
        log.error("labkit: %s", res.message)
        return 1
    if os.path.exists(os.path.join(out, cfg.result_file)):
        print(f"labkit: {cfg.method} finished in {res.wall_time:.0f}s; results in {out}")
    else:  # several nodes: global rank 0 ran elsewhere (a fresh --out had no result file before)
        print(f"labkit: {cfg.method} finished in {res.wall_time:.0f}s; global rank 0 ran on "
              f"another node and wrote the results in its --out; this node's logs are in {res.log_dir}")
    return 0


def _experiment_params(values: dict):
    """Flags and the -f file -> (TrainConfig, Experiment, what is left: e.g. a YAML sweep)."""
    from .orchestrate.experiment import Experiment

    if "parameters_file" in values:
        values = {**_load_yaml(values.pop("parameters_file")), **values}
    if values.get("nproc") == "auto":  # as in a parameters file; the flag gives None already
        values["nproc"] = None
    exp_keys = ("methods", "runs_dir", "tag", "cell_timeout", "repeats", "report", "target_accuracy",
                "target")
    exp_kw = {k: values.pop(k) for k in exp_keys if k in values}
    if isinstance(exp_kw.get("methods"), str):
        exp_kw["methods"] = [m.strip() for m in exp_kw["methods"].split(",") if m.strip()]
    extra = {k: values.pop(k) for k in ("sweep", "grid") if k in values}
    cfg, lp = _split(values)
    return cfg, Experiment(**exp_kw, nproc=lp.nproc, nodes=lp.nodes()), extra


def cmd_experiment(args: dict) -> int:
    from .orchestrate.experiment import run_experiment

    allow = args.pop("allow_changed_env", False)
    if "continue_run" in args:
        from .orchestrate.continuation import continue_experiment
        run_dir = args.pop("continue_run")
        if args:
            typed = [params.flag(k) if v is not False else "--no-" + params.flag(k)[2:]
                     for k, v in args.items()]  # --no-progress as given, not --progress
            raise ConfigError(f"--continue takes no other flags (the run's recorded parameters "
                              f"are used), got {', '.join(typed)}")
        run, status = continue_experiment(run_dir, allow)
    else:
        if allow:
            raise ConfigError("--allow-changed-env goes with --continue RUN")
        cfg, exp, extra = _experiment_params(args)
        if "sweep" in extra:
            raise ConfigError("a sweep: in the parameters file belongs to labkit sweep, not experiment")
        run, status = run_experiment(cfg, exp)
    print(f"\nrun folder: {run}")
    for m, e in status["methods"].items():
        print(f"  {m:10s} {e['status']}" + (f"  ({e['error']})" if e.get("error") else ""))
    print(f"report: {status['report']}")
    from .report import load_run, terminal_summary
    print("\n" + terminal_summary(load_run(run)))  # the comparison table with its CIs and the verdicts
    from .report.accounting import account_text
    # the lab's own time beside training's; -q: the summary alone
    if logging.getLogger("labkit").isEnabledFor(logging.INFO) and (text := account_text(run)):
        print("\n" + text)
    return 0 if status["status"] == Status.COMPLETED else 1


def cmd_sweep(args: dict) -> int:
    from .orchestrate.sweep import parse_grid

    slurm = {k: args.pop(k) for k in ("slurm", "sbatch_args") if k in args}
    cfg, exp, extra = _experiment_params(args)
    specs = extra.get("grid") or []
    yaml_grid = extra.get("sweep") or {}
    if not isinstance(yaml_grid, dict):
        raise ConfigError("sweep: in the parameters file must map a parameter to its values")
    grid = {**(parse_grid(yaml_grid) if yaml_grid else {}), **(parse_grid(specs) if specs else {})}
    if not grid:
        grid = parse_grid([])  # says what to give
    from .orchestrate.slurm import sweep_here_or_on_slurm
    root, doc = sweep_here_or_on_slurm(cfg, exp, grid, **slurm)
    print(f"\nsweep folder: {root}")
    for p in doc["points"]:
        print(f"  {p['name']:24s} {p['status']}")
    print(f"sweep report: {doc.get('report')}")
    return 0 if doc["status"] == Status.COMPLETED else 1


def cmd_bench(args: dict) -> int:
    from .orchestrate.bench import bench, bench_params
    from .bench.bench_view import text_table

    cfg, plan = bench_params(args)
    run, doc = bench(cfg, plan, transcript("labkit.orchestrate.bench"))
    print("\n" + text_table(doc))
    print(f"\nrun folder: {run}\nbench.json, bench.txt, bench.png"
          + ("" if not doc[Status.FAILED] else "\nfailed: " + ", ".join(
              f"{f['variant']} x{f['nproc']}" for f in doc[Status.FAILED])))
    return 0 if doc["status"] == Status.COMPLETED else 1


def cmd_reproduce(args: dict) -> int:
    from .orchestrate import reproduce

    methods = args.get("methods")
    if methods is not None:
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    plan = reproduce.plan(args["run_dir"], methods, args.get("out"), args.get("tolerance"))
    new_run, doc, status = reproduce.run(plan, args.get("tolerance"))
    print("\n".join(reproduce.report_lines(new_run, doc, status)))
    return 0 if doc["reproduced"] and status["status"] == Status.COMPLETED else 1


def cmd_report(args: dict) -> int:
    """`labkit report PATH...`: the guide's text report and plots (labkit.runs.readers); with
    --html, a run folder's report notebook, HTML and PDF (labkit.orchestrate.render), the HTML's
    path printed last."""
    paths, out = args["paths"], args.get("out")
    if not args.get("html"):
        from .runs import readers
        return readers.report_command(paths, out)
    if len(paths) != 1 or out is not None:
        raise ConfigError("--html takes one run folder and writes into its report/ folder, as "
                          "labkit experiment does" + (f"; got {len(paths)} paths" if len(paths) != 1
                                                       else "; --out is for the text report"))
    from .orchestrate.render import remake_report
    html, lines = remake_report(paths[0], transcript("labkit.orchestrate.render"))
    if html is None:  # the notebook or the export failed: said in one line, the old report kept
        return 1
    print("\n".join([*lines, f"report: {html}"]))
    return 0


def cmd_warm(args: dict) -> int:
    """``labkit warm -- COMMAND ...``: COMMAND beside one warm process (labkit.launch.warm) of
    every built-in workload's imports, torchrun's agent and a notebook kernel's, named in
    LABKIT_WARM: each launch under it (a JupyterLab server's notebooks, a script of labkit
    commands) forks its agent, ranks and kernels there rather than importing torch in each.
    COMMAND's exit code (128+N where signal N ended it). Ctrl-C reaches COMMAND from the
    terminal and this command waits for it; a SIGTERM here is passed on to it."""
    import shutil
    import subprocess

    from .launch import warm
    from .launch.agent import AGENT, PRELOAD
    from .orchestrate.kernels import KERNEL

    argv = args["argv"][1:] if args["argv"][:1] == ["--"] else args["argv"]
    if not argv:
        raise ConfigError("give the command to run beside the warm process, e.g. "
                          "`labkit warm -- jupyter lab`")
    if shutil.which(argv[0]) is None:
        raise ConfigError(f"cannot run {argv[0]!r}: no such program (on PATH or at that path)")
    with warm.node(KERNEL + PRELOAD + AGENT):  # a notebook's kernel is forked before torch is in
        proc = subprocess.Popen(argv)
        signal.signal(signal.SIGINT, lambda *_: None)  # COMMAND has it too, and decides
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        code = proc.wait()
    return 128 - code if code < 0 else code


def _run_warm(argv: list[str]) -> None:
    """The `labkit` program beside `labkit warm` (LABKIT_WARM names a warm process that
    answers and fits this process: labkit.launch.warm_client.fits): the command runs forked
    from that process, its imports already done, and this process only relays
    (labkit.launch.warm_client.run_through: streams, signals, exit code); never returns.
    Elsewhere, and in a process that warm process forked, nothing happens: the command runs
    here. `labkit warm` itself always runs here: its COMMAND must stay in this
    terminal's process group, where Ctrl-C reaches it."""
    from .core import procs
    from .launch import warm_client

    if procs.warm_server or not os.environ.get(warm_client.ENV):
        return
    sock, why = warm_client.fits(os.environ[warm_client.ENV])
    if sock is None:  # gone (LABKIT_WARM outlived `labkit warm`), or not this process's like
        log.debug("%s; running here", why)
        return
    warm_client.run_through(sock, ["-m", "labkit", *argv], before_fork=stop.on_sigterm)


def _without_iri_grammars() -> None:
    """papermill and nbconvert import nbformat, which imports jsonschema, whose optional IRI
    format checks import rfc3987_syntax where it is installed (JupyterLab's jupyter_events asks
    for it), and that builds 38 Lark grammars at import: 2.0 of the 2.4 CPU s of `import
    papermill` on a 2-vCPU VM, in every command that runs a notebook. Nothing in this process
    checks an IRI's format (nbformat validates without a format checker), so the import is
    refused here: jsonschema then leaves those formats unchecked, as it does where the package
    is not installed. The JupyterLab server (`make lab`) is its own process and keeps it."""
    sys.modules.setdefault("rfc3987_syntax", None)


def main(argv: Optional[list[str]] = None) -> int:
    as_program, argv = argv is None, sys.argv[1:] if argv is None else argv
    command = stop.command_of(argv)  # the parser's own, once it has said
    stop.Stop.raised, stop.Stop.running = False, True
    signal.signal(signal.SIGTERM, stop.on_sigterm)  # SIGTERM as Ctrl-C (labkit.core.stop)
    try:  # from here on: a SIGTERM or Ctrl-C while the parser or the imports run too
        if as_program:
            sys.unraisablehook = stop.unraisable(sys.unraisablehook)
        _without_iri_grammars()
        args = parse_args(argv)
        setup_logging(args.pop("verbose") - args.pop("quiet"))
        command = args.pop("command")
        if as_program and command != "warm":
            _run_warm(argv)
        return _command(command, args)
    except KeyboardInterrupt:
        return stop.interrupted(command)
    finally:
        stop.Stop.running = False
        stop.Stop.raised = as_program  # the program ends: a SIGTERM from here on is let pass


def _command(command: str, args: dict) -> int:
    """Run ``command``; its exit code, with a ConfigError, a workload's own exception or a full
    disk said in one line."""
    if command == "model":  # its own parser and messages (labkit.costmodel.cli)
        from .costmodel.cli import main as model_main
        return model_main(args["argv"])
    from .runs import readers  # report, runs, diff: the commands that only read run folders
    try:
        return {"run": cmd_run, "experiment": cmd_experiment, "sweep": cmd_sweep, "bench": cmd_bench,
                "report": cmd_report,
                "reproduce": cmd_reproduce, "runs": lambda a: readers.runs_command(**a),
                "diff": lambda a: readers.diff_command(**a), "check": cmd_check,
                "warm": cmd_warm}[command](args)
    except ConfigError as e:
        log.error("labkit %s: error: %s", command, e)
        return 2
    except Exception as e:  # noqa: BLE001 - only the two kinds below become a line
        import errno

        from .workloads.catalog import raised_line
        line = raised_line(e, args["workload"]) if args.get("workload") else None
        if line is not None:  # the user's workload file raised (its datasets(), model, ...)
            log.error("labkit %s: error: %s", command, line)
            return 2
        if not isinstance(e, OSError) or e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # a full disk under labkit itself (experiment.json, a notebook): what, where; what ran
        # before is kept, every file being written atomically
        log.error("labkit %s: error: the disk is full: %s writing %s; every file written before "
                  "is kept", command, e.strerror, e.filename or "a file")
        return 1


if __name__ == "__main__":
    sys.exit(main())

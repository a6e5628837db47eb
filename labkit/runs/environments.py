"""How two environment records differ, in lines people read: the code (commit, diff), the
packages, the data fingerprints, threads and devices. For ``labkit reproduce`` (this machine
against a recorded run) and for comparing two run folders.
"""
from __future__ import annotations

from typing import Optional

from labkit.core.lockfile import PROJECT
from labkit.core.run_folder import RunFolder


def load_environment(rec: RunFolder) -> dict:
    """What the comparison of environments reads from a run folder: environment.json, the
    packages of its requirements.lock, and each method's rank-0 determinism facts."""
    env = dict(rec.env)
    env["package_versions"] = rec.package_versions()
    env["rank_determinism"] = {m: d.determinism for m in rec.methods
                               if (d := rec.result(m)) is not None and d.determinism}
    return env


def _short(commit: Optional[str]) -> str:
    return commit[:10] if commit else "unknown"


def _code(git: dict) -> str:
    if not git.get("dirty"):
        return f"{_short(git.get('commit'))} (clean)"
    h = git.get("diff_sha256")
    return f"{_short(git.get('commit'))} (dirty" + (f", diff {h[:12]}" if h else "") + ")"


def environment_diff(recorded: dict, current: dict) -> list[str]:
    """Readable lines naming what differs between two environment records (as
    :func:`load_environment` returns, or environment.json plus "package_versions" for this
    machine): commit and uncommitted diff, package versions, data fingerprints, thread counts,
    device. No lines: nothing that matters differs."""
    lines: list[str] = []
    ga, gb = recorded.get("git") or {}, current.get("git") or {}
    if (ga.get("commit"), bool(ga.get("dirty")), ga.get("diff_sha256")) != \
            (gb.get("commit"), bool(gb.get("dirty")), gb.get("diff_sha256")):
        lines.append(f"code: recorded {_code(ga)}, now {_code(gb)}")
    ua, ub = set(ga.get("untracked") or []), set(gb.get("untracked") or [])
    if ua != ub:
        lines.append(f"untracked files: {len(ua - ub)} only in the recorded run, "
                     f"{len(ub - ua)} only now" + (f" (e.g. {sorted(ua ^ ub)[0]})" if ua ^ ub else ""))
    pa, pb = recorded.get("package_versions"), current.get("package_versions")
    if pa is None or pb is None:
        if pa is None:
            lines.append("packages: the recorded run has no requirements.lock (not compared)")
    else:
        changed = [f"{n} {pa[n]} -> {pb[n]}" for n in sorted(set(pa) & set(pb)) if pa[n] != pb[n]]
        gone = [f"{n} {pa[n]}" for n in sorted(set(pa) - set(pb))]
        new = [f"{n} {pb[n]}" for n in sorted(set(pb) - set(pa))]
        for what, items in (("changed", changed), ("missing now", gone), ("added", new)):
            if items:
                shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
                lines.append(f"packages {what}: {shown}")
    va = (recorded.get("packages") or {}).get(PROJECT)
    vb = (current.get("packages") or {}).get(PROJECT)
    if va and vb and va != vb:
        lines.append(f"{PROJECT} version: recorded {va}, now {vb}")
    for k in ("python", "torch", "platform"):
        if recorded.get(k) and current.get(k) and recorded[k] != current[k]:
            lines.append(f"{k}: recorded {recorded[k]}, now {current[k]}")
    da, db = recorded.get("data") or {}, current.get("data") or {}
    for m in sorted(set(da) & set(db)):
        why = fingerprint_reason(da[m], db[m])
        if why:
            lines.append(f"data ({m}): {why}")
    xa, xb = recorded.get("determinism") or {}, current.get("determinism") or {}
    for k in ("torch_num_threads", "omp_num_threads_env", "deterministic_algorithms",
              "cudnn_deterministic", "cudnn_benchmark", "backend", "device", "seed"):
        if k in xa and k in xb and xa[k] != xb[k]:
            lines.append(f"{k}: recorded {xa[k]}, now {xb[k]}")
    ra, rb = recorded.get("rank_determinism") or {}, current.get("rank_determinism") or {}
    for m in sorted(set(ra) & set(rb)):
        for k in ("torch_num_threads", "deterministic_algorithms", "backend"):
            if ra[m].get(k) != rb[m].get(k):
                lines.append(f"{m} rank 0 {k}: recorded {ra[m].get(k)}, now {rb[m].get(k)}")
    gpa = [g.get("name") for g in recorded.get("gpus") or []]
    gpb = [g.get("name") for g in current.get("gpus") or []]
    if gpa != gpb:
        lines.append(f"GPUs: recorded {', '.join(gpa) or 'none'}, now {', '.join(gpb) or 'none'}")
    if recorded.get("cpu") and current.get("cpu") and recorded["cpu"] != current["cpu"]:
        lines.append(f"CPU: recorded {recorded['cpu']}, now {current['cpu']}")
    return lines


def fingerprint_reason(a: Optional[dict], b: Optional[dict]) -> Optional[str]:
    if not a or not b:
        return None
    if a.get("sha256") == b.get("sha256"):
        return None
    why = (f"data fingerprint differs ({a.get('dataset')}: recorded {str(a.get('sha256'))[:12]}, "
           f"reproduced {str(b.get('sha256'))[:12]})")
    if a.get("layout_sha256") and a.get("layout_sha256") == b.get("layout_sha256"):
        why += "; same image paths and sizes, only modification times differ (a copy?)"
    return why

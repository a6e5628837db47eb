"""What a result file says about training that went wrong without crashing, for its writer
(labkit.training.guards) and its readers (the report, the explorer) alike, read from the
result's model (labkit.core.results.Result):

- ``Result.diverged``: the first non-finite loss, where it was (epoch, step of steps, global
  step), the learning rate, and the losses of that epoch (null where not a number, its
  ``value`` saying which it was); the run's status is failed and that epoch is not among
  ``Result.epochs``.
- ``Epoch.replicas``: the replica check at the epoch's end found every rank's parameters and
  buffers identical: ``{"identical": true, "tensors": N, "ranks": R, "seconds": t}``.
- ``Result.replicas_differ``: the check that failed: epoch, the first tensor that differs and
  the first rank that holds another copy of it, with the float64 sums; status failed, that
  epoch not among ``Result.epochs``.
"""
from __future__ import annotations

import math
from typing import Optional

from .results import Result


def _number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def diverged_where(doc: Result) -> Optional[str]:
    """"diverged at epoch 2 step 1 (of 6)", or None for a run that did not diverge. Files
    written before the check (NaN losses, status completed) are read from their losses."""
    d = doc.diverged
    if isinstance(d, dict):
        return f"diverged at epoch {d.get('epoch')} step {d.get('step')} (of {d.get('steps')})"
    for e in doc.epochs:
        losses = e.all_losses
        bad = next((i for i, x in enumerate(losses) if not _number(x)), None)
        if bad is not None:
            return f"diverged at epoch {e.epoch} step {bad + 1} (of {len(losses)})"
        if e.val_loss is not None and not _number(e.val_loss):
            return (f"diverged at epoch {e.epoch} step {len(losses) or '?'} (of "
                    f"{len(losses) or '?'}: the validation loss after it is not a number)")
    return None


def replicas_verdict(doc: Result) -> Optional[str]:
    """"replicas identical after each of 3 epochs", "replicas differed after epoch 2 (rank 1,
    conv1.weight)", or None where no epoch was checked (files from before the check, or runs
    with --no-check-replicas)."""
    bad = doc.replicas_differ
    if isinstance(bad, dict):
        return (f"replicas differed after epoch {bad.get('epoch')} (rank {bad.get('rank')}, "
                f"{bad.get('tensor')})")
    epochs = doc.epochs
    checked = [e for e in epochs if isinstance(e.replicas, dict) and e.replicas.get("identical")]
    if not checked:
        return None
    n, unchecked = len(checked), len(epochs) - len(checked)
    text = (f"replicas identical after each of {n} epochs" if n > 1 else
            f"replicas identical after epoch {checked[0].epoch}")
    return text + (f" ({unchecked} more not checked)" if unchecked else "")

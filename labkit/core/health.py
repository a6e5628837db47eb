"""What a result file says about training that went wrong without crashing, for its writer
(labkit.training.guards) and its readers (the report, the explorer) alike.

- ``"diverged"`` (top level): the first non-finite loss, where it was (epoch, step of steps,
  global step), the learning rate, and the losses of that epoch (null where not a number,
  ``"value"`` saying which it was); the run's status is failed and that epoch is not in
  ``"epochs"``.
- ``"replicas"`` (in each epoch): the replica check at the epoch's end found every rank's
  parameters and buffers identical: ``{"identical": true, "tensors": N, "ranks": R,
  "seconds": t}``.
- ``"replicas_differ"`` (top level): the check that failed: epoch, the first tensor that
  differs and the first rank that holds another copy of it, with the float64 sums; status
  failed, that epoch not in ``"epochs"``.
"""
from __future__ import annotations

import math
from typing import Optional

DIVERGED = "diverged"
REPLICAS = "replicas"
REPLICAS_DIFFER = "replicas_differ"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def diverged_where(doc: dict) -> Optional[str]:
    """"diverged at epoch 2 step 1 (of 6)", or None for a run that did not diverge. Files
    written before the check (NaN losses, status completed) are read from their losses."""
    d = doc.get(DIVERGED)
    if isinstance(d, dict):
        return f"diverged at epoch {d.get('epoch')} step {d.get('step')} (of {d.get('steps')})"
    for e in doc.get("epochs") or []:
        if not isinstance(e, dict):
            continue
        losses = e.get("all_losses") if isinstance(e.get("all_losses"), list) else []
        bad = next((i for i, x in enumerate(losses) if not _number(x)), None)
        if bad is not None:
            return f"diverged at epoch {e.get('epoch')} step {bad + 1} (of {len(losses)})"
        if "val_loss" in e and not _number(e["val_loss"]):
            return (f"diverged at epoch {e.get('epoch')} step {len(losses) or '?'} (of "
                    f"{len(losses) or '?'}: the validation loss after it is not a number)")
    return None


def replicas_verdict(doc: dict) -> Optional[str]:
    """"replicas identical after each of 3 epochs", "replicas differed after epoch 2 (rank 1,
    conv1.weight)", or None where no epoch was checked (files from before the check, or runs
    with --no-check-replicas)."""
    bad = doc.get(REPLICAS_DIFFER)
    if isinstance(bad, dict):
        return (f"replicas differed after epoch {bad.get('epoch')} (rank {bad.get('rank')}, "
                f"{bad.get('tensor')})")
    epochs = [e for e in doc.get("epochs") or [] if isinstance(e, dict)]
    checked = [e for e in epochs if isinstance(e.get(REPLICAS), dict) and e[REPLICAS].get("identical")]
    if not checked:
        return None
    n, unchecked = len(checked), len(epochs) - len(checked)
    text = (f"replicas identical after each of {n} epochs" if n > 1 else
            f"replicas identical after epoch {checked[0].get('epoch')}")
    return text + (f" ({unchecked} more not checked)" if unchecked else "")

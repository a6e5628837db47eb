"""An MLP classifying the rows of a table: a complete labkit workload in one file.

    labkit run ddp --workload examples/workloads/table_mlp.py:TableMLP --nproc 2 --epochs 5

The table is scikit-learn's bundled breast-cancer data (Wisconsin diagnostic: 569 tumours, 30
measurements each, malignant or benign), which ships inside scikit-learn: nothing to download.
Each feature is standardised with the training rows' mean and standard deviation; the
train/validation split (80/20, stratified by class) is fixed, whatever --seed says, so runs of
different seeds are judged on the same rows. A row is a sample, so throughput is rows/s.

Only the five questions are answered here (model, data, loss, units, figures) and the
validation accuracy: the optimizer and its learning rate are labkit's defaults (SGD with
momentum, 0.1 x global batch / 256).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from labkit.workloads import Datasets, Figure, Workload

VAL_SHARE = 0.2
SPLIT_SEED = 0  # the split's own seed, not --seed: every run validates on the same rows
HIDDEN = 64


def read_table():
    """The table as NumPy arrays: x (569 rows x 30 features), y (0 malignant, 1 benign)."""
    from sklearn.datasets import load_breast_cancer

    return load_breast_cancer(return_X_y=True)


def load_table():
    """(train x, train y, val x, val y) as tensors: standardised float32 features, int64 labels."""
    from sklearn.model_selection import train_test_split

    x, y = read_table()
    xt, xv, yt, yv = train_test_split(x, y, test_size=VAL_SHARE, stratify=y, random_state=SPLIT_SEED)
    mean, std = xt.mean(axis=0), xt.std(axis=0) + 1e-8  # the training rows' statistics only
    f = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    return f(xt), torch.tensor(yt), f(xv), torch.tensor(yv)


class TableMLP(Workload):
    title = "table classification (MLP)"
    unit = "rows"
    val_sum_keys = ("loss", "correct", "count")
    figures = (Figure("val_accuracy", "validation accuracy", "%", higher_is_better=True, short="acc"),
               Figure("val_loss", "validation loss", "", higher_is_better=False, short="loss"))

    def datasets(self) -> Datasets:
        xt, yt, xv, yv = load_table()
        return Datasets(TensorDataset(xt, yt), TensorDataset(xv, yv), in_memory=True,
                        num_classes=int(yt.max()) + 1)

    def build_model(self):
        # sizes from the NumPy table: labkit also builds the model on torch's meta device (to
        # count its weights without memory), where a tensor's values cannot be read
        x, y = read_table()
        return nn.Sequential(nn.Linear(x.shape[1], HIDDEN), nn.ReLU(),
                             nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                             nn.Linear(HIDDEN, int(y.max()) + 1))

    # the loss is the default: the mean cross-entropy of the batch; a row is one unit (default)

    def val_sums(self, output, target):
        return {"loss": F.cross_entropy(output.float(), target, reduction="sum"),
                "correct": (output.argmax(1) == target).sum(),
                "count": torch.tensor(float(target.numel()), device=target.device)}

    def val_figures(self, sums):
        n = max(1.0, sums["count"])
        return {"val_accuracy": 100.0 * sums["correct"] / n, "val_loss": sums["loss"] / n}

    def train_hits(self, output, target):
        return output.argmax(1) == target  # the training accuracy's right predictions

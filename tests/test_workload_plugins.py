"""Workloads of one's own (docs/workloads.md): the two examples load, pass the checks before
anything is spawned and train (the hand-written GPT is causal and learns); a broken workload
is bad input, one line, exit 2, nothing created (issue 69, item 5), whether named to a bare
rank (torchrun -m labkit.train) or to `labkit run`. All in-process: nothing is spawned."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch
from torch.utils.data import default_collate

from helpers import ROOT, expect_error
from labkit import cli
from labkit.core.config import TrainConfig
from labkit.training import rank
from labkit.workloads import Datasets, Workload, load_workload, make_workload, resolve

GPT = f"{ROOT}/examples/workloads/student_gpt.py:StudentGPT"
TABLE = f"{ROOT}/examples/workloads/table_mlp.py:TableMLP"


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


# ------------------------------------------------------------------ broken workloads
# each a small file of a user's: a healthy base, and the one thing wrong with it
HEADER = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from labkit.workloads import Datasets, Workload


def tables(n=64, n_val=16):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 5, generator=g), torch.randint(0, 2, (n,), generator=g)
    return TensorDataset(x, y), TensorDataset(x[:n_val], y[:n_val])


class Healthy(Workload):
    def datasets(self):
        return Datasets(*tables(), in_memory=True)

    def build_model(self):
        return nn.Sequential(nn.Linear(5, 2))
'''

BROKEN = {
    "forward": '''
class Broken(Healthy):
    def build_model(self):
        return nn.Sequential(nn.Linear(7, 2), nn.ReLU())  # 7 inputs, the rows have 5
''',
    "loss": '''
class Broken(Healthy):
    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target, reduction="none")  # one per sample
''',
    "empty": '''
class Broken(Healthy):
    def datasets(self):
        return Datasets(*tables(0, 0), in_memory=True)
''',
    "no_val": '''
class Broken(Healthy):
    def datasets(self):
        return Datasets(tables()[0], None, in_memory=True)
''',
    "not_a_workload": '''
class Broken:  # a plain class: no Workload
    def datasets(self):
        return tables()
''',
}

# what the one line says of each (besides the workload's name)
SAYS = {
    "forward": ("the model's forward fails on a first batch", "[2, 5] float32",
                "its first layer: 0: Linear(in_features=7, out_features=2", "RuntimeError"),
    "loss": ("its loss must be a scalar tensor", "[2] float32"),
    "empty": ("its training dataset is empty",),
    "no_val": ("has no validation data",),
    "not_a_workload": ("Broken", "is not a workload", "labkit.workloads.Workload"),
    "missing": ("no file", "nope.py"),
}

def broken_file(folder, case: str) -> str:
    """The workload reference of ``case``, its file written under ``folder``."""
    if case == "missing":
        return f"{folder}/nope.py:Broken"
    path = folder / f"{case}.py"
    path.write_text(textwrap.dedent(HEADER) + textwrap.dedent(BROKEN[case]))
    return f"{path}:Broken"


def flags(ref: str, out) -> list[str]:
    return ["--workload", ref, "--batch-size", "8", "--epochs", "1", "--max-steps-per-epoch", "2",
            "--max-val-steps", "1", "--no-progress", "--timeout", "30", "--out", str(out)]


CASES = [*BROKEN, "missing"]


@pytest.mark.parametrize("case", CASES)
def test_a_broken_workload_is_one_line_to_a_rank(tmp_path, capsys, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    ref = broken_file(tmp_path, case)
    before = set(os.listdir(tmp_path))
    expect_error(flags(ref, tmp_path / "out"), capsys, f"workload {ref}", *SAYS[case])
    assert set(os.listdir(tmp_path)) == before  # nothing created: no output folder


@pytest.mark.parametrize("case", CASES)
def test_a_broken_workload_is_one_line_to_labkit_run(tmp_path, capsys, monkeypatch, case):
    """The launcher's checks, before anything is spawned (labkit.workloads.checks)."""
    monkeypatch.chdir(tmp_path)  # the default runs/ would be created here
    ref = broken_file(tmp_path, case)
    before = set(os.listdir(tmp_path))
    code = cli.main(["run", "ddp", "--nproc", "2", *flags(ref, tmp_path / "out")])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"labkit run: error: workload {ref}"), err
    for needle in SAYS[case]:
        assert needle in lines[0], err
    assert set(os.listdir(tmp_path)) == before


# ------------------------------------------------------------------ the examples
@pytest.mark.parametrize("ref", [GPT, TABLE])
def test_the_examples_load_and_pass_the_checks(ref):
    cls = load_workload(ref)
    assert issubclass(cls, Workload)
    cfg = resolve(TrainConfig(workload=ref, batch_size=8), False, 2)
    w = make_workload(cfg)
    data = w.check()
    assert isinstance(data, Datasets) and len(data.train) > len(data.val) > 0
    d = w.describe()
    assert d["unit"] == ("tokens" if ref == GPT else "rows")
    assert d["figures"][0]["key"] == ("val_loss" if ref == GPT else "val_accuracy")
    assert d["figures"][0]["higher_is_better"] is (ref == TABLE)
    assert w.units_per_sample == (cfg.seq_len if ref == GPT else 1)
    x, y = default_collate([data.val[i] for i in range(4)])
    with torch.no_grad():
        out = w.build_model().eval()(x)
    sums = w.val_sums(out, y)
    assert set(sums) == set(w.val_sum_keys)
    figures = w.val_figures({k: float(v) for k, v in sums.items()})
    assert {f.key for f in w.figures} <= set(figures)


def test_the_gpt_decides_its_defaults_and_keeps_the_users():
    cfg = resolve(TrainConfig(workload=GPT, batch_size=8), False, 2)
    assert (cfg.seq_len, cfg.lr, cfg.weight_decay) == (64, 3e-3, 0.1)
    cfg = resolve(TrainConfig(workload=GPT, batch_size=8, seq_len=16, lr=1e-3, weight_decay=0.0),
                  False, 2)
    assert (cfg.seq_len, cfg.lr, cfg.weight_decay) == (16, 1e-3, 0.0)
    w = make_workload(cfg)
    assert isinstance(w.optimizer(w.build_model().parameters()), torch.optim.AdamW)
    x, y = w.datasets().train[3]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])  # y is x shifted by one


def test_the_table_split_does_not_follow_the_seed():
    a = make_workload(resolve(TrainConfig(workload=TABLE, batch_size=8, seed=0), False, 2)).datasets()
    b = make_workload(resolve(TrainConfig(workload=TABLE, batch_size=8, seed=7), False, 2)).datasets()
    assert torch.equal(a.val.tensors[0], b.val.tensors[0]) and torch.equal(a.val.tensors[1], b.val.tensors[1])
    assert set(a.val.tensors[1].tolist()) == {0, 1}  # stratified: both classes validated


def gpt(seq_len: int = 32):
    cfg = resolve(TrainConfig(workload=GPT, batch_size=8, seq_len=seq_len), False, 1)
    return make_workload(cfg)


def test_the_student_gpt_is_causal():
    """Changing the token at position t changes no logit before t."""
    w = gpt()
    torch.manual_seed(0)
    model = w.build_model().eval()
    x = torch.stack([w.datasets().val[i][0] for i in range(2)])
    t = 20
    changed = x.clone()
    changed[:, t] = (changed[:, t] + 1) % len(w.vocabulary())
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])  # it does see the token from t on


def test_the_student_gpt_learns_its_text():
    """30 AdamW steps on its own windows: the mean loss of the last five steps is well below the
    first step's (ln(vocab), about 4.6 nats, at initialisation)."""
    torch.set_num_threads(1)  # the fixture restores the count
    w = gpt()
    data = w.datasets()
    torch.manual_seed(0)
    model = w.build_model()
    opt = w.optimizer(model.parameters())
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        x, y = default_collate([data.train[i] for i in torch.randint(len(data.train), (8,), generator=g)])
        loss = w.loss(model(x), y)
        assert loss.dim() == 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses

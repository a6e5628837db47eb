"""Workloads of one's own (docs/workloads.md): the two examples load, pass the checks before
anything is spawned and train (the hand-written GPT is causal and learns); a broken workload
is bad input, one line, exit 2, nothing created (issue 69, item 5), whether named to a bare
rank (torchrun -m labkit.train) or to `labkit run`; an exception in the user's own file, a layer
the forward never uses and samples that are no pair or dict say so in one line too (issue 83).
In-process, nothing spawned, but for one warm run: DDP on dict samples with a spare layer."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch
from torch.utils.data import default_collate

from helpers import ROOT, check_ok, expect_error
from labkit import cli
from labkit.core.config import TrainConfig
from labkit.training import rank
from labkit.workloads import Datasets, Workload, load_workload, make_workload, resolve
from warm import warm_run

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
    # an exception in the user's own code, not a check of labkit's (issue 83, item 1)
    "raises": '''
class Broken(Healthy):
    def datasets(self):
        return Datasets(*tables())  # in_memory forgotten
''',
    # a layer the forward never uses (item 2): DDP would fail at its first step, by indices
    "unused": '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(5, 2), nn.Linear(5, 4)

    def forward(self, x):
        return self.used(x)


class Broken(Healthy):
    def build_model(self):
        return Net()
''',
    # dict samples whose keys are not the input's and target's (item 3)
    "dict_keys": '''
class Rows(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return {"x": x, "y": y}


class Broken(Healthy):
    def datasets(self):
        train, val = tables()
        return Datasets(Rows(train), Rows(val), in_memory=True)
''',
    "not_a_pair": '''
class Broken(Healthy):
    def datasets(self):
        train, val = tables()
        return Datasets(TensorDataset(*train.tensors, train.tensors[1]), val, in_memory=True)
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
    "raises": ("raises.py:", "in datasets(): TypeError", "'in_memory'"),
    "unused": ("2 of the model's 4 parameters get no gradient from a first batch",
               "unused.weight, unused.bias", "--find-unused-parameters"),
    "dict_keys": ("its first training sample is a dict of keys 'x', 'y'", "'input_ids'",
                  "'labels'", "input_key and target_key"),
    "not_a_pair": ("its first training sample is a tuple of 3", "a pair (input, target)"),
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


def test_a_workload_raising_names_its_own_file_and_line(tmp_path, capsys, monkeypatch):
    """The line names the user's file and the line that raised, not labkit's frames."""
    monkeypatch.chdir(tmp_path)
    ref = broken_file(tmp_path, "raises")
    path = ref.rpartition(":")[0]
    line = next(i for i, text in enumerate(open(path), 1) if "in_memory forgotten" in text)
    assert cli.main(["run", "ddp", "--nproc", "2", *flags(ref, tmp_path / "out")]) == 2
    assert f"{path}:{line} in datasets()" in capsys.readouterr().err


DICTS = '''
import torch
from torch import nn
from labkit.workloads import Datasets, Workload


class Tokens(torch.utils.data.Dataset):
    """Hugging Face's style: each sample a dict of the input ids and the labels."""
    def __init__(self, n):
        g = torch.Generator().manual_seed(n)
        self.ids = torch.randint(0, 16, (n, 9), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.spare = nn.Linear(8, 8)  # used on no batch: needs --find-unused-parameters

    def forward(self, ids):
        return self.head(self.emb(ids))


class Dicts(Workload):
    unit = "tokens"

    def datasets(self):
        return Datasets(Tokens(96), Tokens(32), in_memory=True)

    def build_model(self):
        return Net()

    def loss(self, output, target):
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
'''


def test_dict_samples_are_read_by_the_workloads_keys(tmp_path):
    """Samples as dicts (item 3): the model gets the "input_ids", the loss the "labels", as
    a pair sample's parts; the same batches through the lab's loader as through the dicts."""
    from labkit.workloads import checks

    path = tmp_path / "dicts.py"
    path.write_text(DICTS)
    w = make_workload(resolve(TrainConfig(workload=f"{path}:Dicts", batch_size=4,
                                          find_unused_parameters=True), False, 1))
    assert w.check() is not None  # the first batch's forward, loss and backward pass
    data = checks.samples(w)
    raw = w.datasets().train
    x, y = default_collate([data.train[i] for i in range(3)])
    assert torch.equal(x, torch.stack([raw[i]["input_ids"] for i in range(3)]))
    assert torch.equal(y, torch.stack([raw[i]["labels"] for i in range(3)]))
    assert len(data.val) == len(w.datasets().val) == 32


def test_a_workloads_options_are_flags_of_its_own(tmp_path, capsys, monkeypatch):
    """A workload's Options dataclass makes its flags (issue 84): listed by --help once the
    workload is named, given on the command line into the config's options, read by the
    workload as self.options; a value its field refuses is one line."""
    from labkit.core.config import TrainConfig

    path = tmp_path / "opts.py"
    path.write_text(DICTS.replace("class Dicts(Workload):", """from dataclasses import dataclass
from labkit.core.params import option


@dataclass
class DictsOptions:
    windows: int = option(96, "dicts: training windows", "data", at_least=8)


class Dicts(Workload):
    Options = DictsOptions""").replace("Tokens(96)", "Tokens(self.options.windows)"))
    ref = f"{path}:Dicts"
    monkeypatch.chdir(tmp_path)  # a default runs/ would be made here
    with pytest.raises(SystemExit):
        cli.main(["run", "ddp", "--workload", ref, "--help"])
    assert "--windows WINDOWS" in capsys.readouterr().out
    args = cli.parse_args(["run", "ddp", "--workload", ref, "--windows", "40"])
    assert args["options"] == {"windows": 40}
    w = make_workload(TrainConfig(workload=ref, options=args["options"]))
    assert w.options.windows == 40 and len(w.datasets().train) == 40
    assert cli.main(["run", "ddp", "--workload", ref, "--windows", "4", "--nproc", "2"]) == 2
    assert "--windows must be at least 8 (got 4)" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["opts.py"]  # nothing made


def test_a_plug_in_files_class_unpickles_in_a_process_that_never_loaded_it(tmp_path):
    """A DataLoader worker is sent the dataset pickled; its class lives in the user's file,
    loaded under a module name of labkit's: the worker imports the file by that name."""
    import pickle
    import sys

    path = tmp_path / "dicts.py"
    path.write_text(DICTS)
    cls = load_workload(f"{path}:Dicts")
    blob = pickle.dumps(cls(TrainConfig()).datasets().train)
    name = cls.__module__
    del sys.modules[name]  # as in a fresh process
    try:
        ds = pickle.loads(blob)
        assert type(ds).__module__ == name and ds[0]["input_ids"].shape == (8,)
    finally:
        sys.modules.pop(name, None)


@pytest.mark.warm
def test_ddp_trains_dict_samples_and_a_spare_layer_with_find_unused_parameters(tmp_path):
    """Two DDP ranks (its reducer would fail at the first step on a parameter without a
    gradient): with --find-unused-parameters the run completes, the spare layer keeps its
    initial weights (no gradient, so no step) and the layers the forward uses moved."""
    path = tmp_path / "dicts.py"
    path.write_text(DICTS)
    ref, out = f"{path}:Dicts", tmp_path / "ddp"
    check_ok(warm_run(2, ["--method", "ddp", *flags(ref, out), "--find-unused-parameters",
                          "--calibrate-steps", "2", "--no-pin-cpus"], cwd=tmp_path))
    torch.manual_seed(0)
    start = make_workload(TrainConfig(workload=ref)).build_model().state_dict()
    final = torch.load(out / "final_model.pt", weights_only=True)
    assert torch.equal(final["spare.weight"], start["spare.weight"])
    assert not torch.equal(final["head.weight"], start["head.weight"])


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

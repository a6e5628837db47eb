"""The lm workload (labkit.workloads.lm): the transformer's causality, tied head, counts and FLOP
rule against a built model and torch's flop counter; the embedded corpus, the text and token
files and every bad input's one line; the loss, figures, optimizer, schedule and samples."""
from __future__ import annotations

import hashlib
import math
import os
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from labkit.core.config import ConfigError
from labkit.workloads.lm import LR, REFERENCE, SEQ_LEN, LanguageModel, sizes, unigram_entropy
from labkit.workloads.lm.corpus import VAL_SHARE
from labkit.workloads.lm.sources import CORPUS_BYTES, corpus_sha256, embedded_corpus

from helpers import lm_workload

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def one_thread():
    """As each torchrun rank runs (OMP_NUM_THREADS=1); conftest restores the count after."""
    torch.set_num_threads(1)


workload = lm_workload


@pytest.fixture
def embedded():
    w = workload()
    w.datasets()
    return w


def model_of(w: LanguageModel, seed: int = 0):
    torch.manual_seed(seed)
    return w.build_model()


def state_count(model) -> int:
    return sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())


# ------------------------------------------------------------------ resolve
def test_defaults_per_size():
    w = workload()
    assert (w.cfg.dataset, w.cfg.model, w.cfg.data_dir) == ("embedded", "tiny", None)
    assert w.cfg.weight_decay == 0.1
    for size in ("tiny", "small", "gpt2"):
        c = workload(model=size).cfg
        assert (c.seq_len, c.lr) == (SEQ_LEN[size], LR[size])
    assert SEQ_LEN == {"tiny": 64, "small": 256, "gpt2": 1024}
    assert LR["tiny"] > LR["small"] > LR["gpt2"] == 6e-4
    given = workload(lr=0.5, weight_decay=0.0, seq_len=16).cfg
    assert (given.lr, given.weight_decay, given.seq_len) == (0.5, 0.0, 16)


def test_the_data_dir_decides_the_dataset(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "one.bin").write_bytes(b"\0\0")
    both = tmp_path / "nano"
    both.mkdir()
    for s in ("train", "val"):
        (both / f"{s}.bin").write_bytes(b"\0\0")
    assert workload(data_dir=str(tmp_path / "a.txt")).cfg.dataset == "text"
    assert workload(data_dir=str(tmp_path)).cfg.dataset == "text"  # a folder with a .bin in it
    assert workload(data_dir=str(tmp_path / "one.bin")).cfg.dataset == "tokens"
    assert workload(data_dir=str(both)).cfg.dataset == "tokens"


def test_unknown_names_are_one_line():
    with pytest.raises(ConfigError, match="^unknown dataset 'x' for the lm workload; choose one of: "
                                          "embedded, text, tokens$"):
        workload(dataset="x")
    with pytest.raises(ConfigError, match=r"^unknown model 'huge' for the lm workload; choose a "
                                          r"size \(tiny, small, gpt2, shakespeare, cs336-small, "
                                          r"cs336-medium, cs336-large, cs336-xl, cs336-2\.7b\) "
                                          r"or a shape LxDxH"):
        workload(model="huge")
    with pytest.raises(ConfigError, match="--dataset embedded reads no --data-dir"):
        workload(dataset="embedded", data_dir="/tmp")
    with pytest.raises(ConfigError, match="--dataset text needs --data-dir"):
        workload(dataset="text")


# ------------------------------------------------------------------ the model
def test_causal_a_later_token_changes_no_earlier_logit():
    w = workload(model="small", seq_len=32)
    model = model_of(w).eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    changed = x.clone()
    changed[:, 20] = (x[:, 20] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert a.shape == (2, 32, 256)
    assert torch.equal(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])  # the change is seen from its position on


def test_head_and_embedding_are_one_tensor(embedded):
    model = model_of(embedded)
    assert model.head.weight is model.tok.weight
    assert model.head.weight.data_ptr() == model.tok.weight.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert "tok.weight" in names and "head.weight" not in names  # one parameter, one gradient
    assert {"tok.weight", "head.weight"} <= set(model.state_dict())


def test_gpt2_style_init_and_no_dropout_or_batchnorm(embedded):
    model = model_of(workload(model="small"))
    layers = sizes.SIZES["small"].layers
    assert not any(isinstance(m, (torch.nn.Dropout, torch.nn.modules.batchnorm._BatchNorm))
                   for m in model.modules())
    residual = model.blocks[0].proj.weight.std().item()
    assert residual == pytest.approx(0.02 / math.sqrt(2 * layers), rel=0.1)
    assert model.blocks[0].fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.blocks[0].fc.bias.abs().max().item() == 0


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_state_values_count_the_built_model(size):
    w = workload(model=size)
    assert w.state_values() == state_count(model_of(w))


def test_state_values_of_gpt2_and_its_parameters():
    w = workload(model="gpt2")
    with torch.device("meta"):
        model = w.build_model()
    assert w.state_values() == state_count(model)
    n = sum(p.numel() for p in model.parameters())
    assert n == sizes.parameters(sizes.SIZES["gpt2"], 256, 1024)
    assert 85e6 < n < 87e6  # GPT-2 small less its 50257-token embedding's 38.4M
    gpt2 = sizes.parameters(sizes.SIZES["gpt2"], 50257, 1024)
    assert 124e6 < gpt2 < 125e6  # GPT-2 small, as published


@pytest.mark.parametrize("size,seq_len", [("tiny", 64), ("small", 128)])
def test_flop_rule_against_torchs_flop_counter(size, seq_len):
    """The counter, on the meta device as the contract's default counts, sees the matrix
    products (attention's included); the rule's 2N also counts a multiply-add for each bias
    and LayerNorm parameter, which is the whole difference (about 1%)."""
    from torch.utils.flop_counter import FlopCounterMode

    w = workload(model=size, seq_len=seq_len)
    with torch.device("meta"):
        model = w.build_model().eval()
        x = torch.empty((1, seq_len), dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        model(x)
    counted, rule = counter.get_total_flops(), w.forward_flops(None)
    assert rule == pytest.approx(counted, rel=0.02)
    s = sizes.SIZES[size]
    assert rule - counted == 2 * seq_len * (s.layers * 13 * s.d_model + 2 * s.d_model)
    assert "6N + 12·L·T·d" in w.flops_rule()


# ------------------------------------------------------------------ data
def test_unigram_entropy_by_hand():
    assert unigram_entropy([0, 0, 1, 1]) == pytest.approx(math.log(2))
    assert unigram_entropy(torch.tensor([7, 7, 7])) == 0
    assert unigram_entropy(torch.arange(256)) == pytest.approx(math.log(256))
    p = np.array([3, 1]) / 4
    assert unigram_entropy([5, 5, 5, 9]) == pytest.approx(float(-(p * np.log(p)).sum()))


def test_embedded_corpus_is_the_same_bytes_and_windows_shift_by_one(embedded):
    corpus = embedded_corpus()
    assert corpus == embedded_corpus() and 0 < len(corpus) <= CORPUS_BYTES
    assert corpus_sha256() == hashlib.sha256(corpus).hexdigest()
    again = workload()  # a second build reads the same bytes
    s, t = embedded.streams(), again.streams()
    assert torch.equal(s.train, t.train) and torch.equal(s.val, t.val)
    stream = torch.cat([s.train, s.val])
    assert bytes(stream.to(torch.uint8).tolist()) == corpus
    assert len(s.val) == int(len(corpus) * VAL_SHARE)  # the end, whatever the seed
    data, T = embedded.datasets(), embedded.cfg.seq_len
    assert len(data.train) == (len(s.train) - 1) // T
    for i in (0, 1, len(data.train) - 1):
        x, y = data.train[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (T,)
        assert torch.equal(x, s.train[i * T:(i + 1) * T])
        assert torch.equal(y, s.train[i * T + 1:(i + 1) * T + 1])  # y is x shifted by one
    x, _ = data.val[0]
    assert torch.equal(x, s.val[:T])
    assert embedded.data_bytes() == 8 * len(stream)
    assert embedded.sample_bytes() == 2 * T * 8
    assert embedded.references() == {REFERENCE: unigram_entropy(s.val)}


def test_summary_line_names_model_and_windows(embedded):
    data = embedded.datasets()
    line = embedded.summary_line(data)
    assert line.startswith("transformer tiny (2 layers, d 64, ")
    assert "tied" in line and hashlib.sha256(embedded_corpus()).hexdigest()[:12] in line
    assert f"{len(data.train):,} train / {len(data.val):,} val windows of 64" in line


def test_a_text_folder_is_read_recursively_in_sorted_order(tmp_path):
    root = tmp_path / "texts"
    (root / "b").mkdir(parents=True)
    (root / ".git").mkdir()
    parts = {"a.txt": b"first " * 40, "b/c.txt": b"second " * 40, "b/d.md": "th\u00efrd ".encode() * 40}
    for name, data in parts.items():
        (root / name).write_bytes(data)
    (root / ".git" / "HEAD").write_bytes(b"left out")
    (root / ".hidden").write_bytes(b"left out too")
    w = workload(data_dir=str(root), seq_len=16)
    s = w.streams()
    stream = bytes(torch.cat([s.train, s.val]).to(torch.uint8).tolist())
    assert w.cfg.dataset == "text" and s.vocab == 256
    assert stream == parts["a.txt"] + parts["b/c.txt"] + parts["b/d.md"]
    assert w.check() is not None  # the contract's checks: data and a first batch
    one = workload(data_dir=str(root / "a.txt"), seq_len=8).streams()
    assert bytes(torch.cat([one.train, one.val]).to(torch.uint8).tolist()) == parts["a.txt"]


def test_a_uint16_token_file_and_a_train_val_folder(tmp_path):
    tokens = np.arange(2000, dtype=np.uint16) * 7 % 301  # largest 300: a vocabulary of 320
    tokens.tofile(tmp_path / "all.bin")
    w = workload(data_dir=str(tmp_path / "all.bin"), seq_len=16)
    s = w.streams()
    assert (w.cfg.dataset, s.vocab) == ("tokens", 320)
    assert torch.equal(torch.cat([s.train, s.val]), torch.from_numpy(tokens.astype(np.int64)))
    assert len(s.val) == 200  # 90/10
    assert w.datasets().train[1][0].tolist() == tokens[16:32].tolist()
    assert w.state_values() == state_count(model_of(w))
    assert w.data_bytes() == 8 * 2000
    folder = tmp_path / "nano"
    folder.mkdir()
    np.array([1, 2, 3] * 20, dtype=np.uint16).tofile(folder / "train.bin")
    np.array([50256, 4] * 10, dtype=np.uint16).tofile(folder / "val.bin")
    s = workload(data_dir=str(folder), seq_len=8).streams()
    assert (len(s.train), len(s.val), s.vocab) == (60, 20, 50304)  # GPT-2's, padded as nanoGPT
    assert s.val[:2].tolist() == [50256, 4]


# ------------------------------------------------------------------ bad input
def bad(tmp_path, what: str) -> str:
    """A --data-dir of the bad kind ``what`` under tmp_path."""
    if what == "missing":
        return str(tmp_path / "nowhere")
    if what == "empty file":
        (tmp_path / "empty.txt").write_bytes(b"")
        return str(tmp_path / "empty.txt")
    if what == "empty folder":
        (tmp_path / "void").mkdir()
        return str(tmp_path / "void")
    if what == "odd bin":
        (tmp_path / "odd.bin").write_bytes(b"\0" * 101)
        return str(tmp_path / "odd.bin")
    if what == "short val":
        (tmp_path / "short.txt").write_bytes(b"x" * 200)  # 180 train bytes, 20 val
        return str(tmp_path / "short.txt")
    folder = tmp_path / "short_train"
    folder.mkdir()
    np.zeros(10, dtype=np.uint16).tofile(folder / "train.bin")
    np.zeros(100, dtype=np.uint16).tofile(folder / "val.bin")
    return str(folder)


@pytest.mark.parametrize("what,message", [
    ("missing", r"--data-dir '.*nowhere' does not exist"),
    ("empty file", r"--data-dir '.*empty.txt' is empty"),
    ("empty folder", r"--data-dir '.*void' is an empty folder"),
    ("odd bin", r"token file '.*odd.bin' has an odd length \(101 bytes\)"),
    ("short val", r"is too short: its validation split has 20 tokens, fewer than one window of "
                  r"--seq-len \+ 1 = 65"),
    ("short train", r"is too short: its training split has 10 tokens"),
])
def test_bad_data_is_one_line(tmp_path, what, message):
    w = workload(data_dir=bad(tmp_path, what))
    with pytest.raises(ConfigError, match=message) as e:
        w.check()
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ loss, figures, optimisation
def test_loss_and_validation_figures():
    w = workload(seq_len=8)
    g = torch.Generator().manual_seed(0)
    out, target = torch.randn(3, 8, 256, generator=g), torch.randint(0, 256, (3, 8), generator=g)
    mean = F.cross_entropy(out.reshape(24, 256), target.reshape(24))
    assert torch.allclose(w.loss(out, target), mean)
    sums = w.val_sums(out.bfloat16(), target)
    assert set(sums) == set(w.val_sum_keys) and sums["count"].item() == 24
    figures = w.val_figures({k: float(v) for k, v in sums.items()})
    assert figures["val_loss"] == pytest.approx(mean.item(), rel=0.02)  # bf16 logits
    assert figures["val_perplexity"] == pytest.approx(math.exp(figures["val_loss"]))
    assert w.units_per_sample == 8
    assert [f.key for f in w.figures] == ["val_loss", "val_perplexity"]


def test_adamw_decays_matrices_only(embedded):
    model = model_of(embedded)
    opt = embedded.optimizer(model.parameters())
    assert isinstance(opt, torch.optim.AdamW) and embedded.optimizer_state_per_value == 2
    decay = {g["weight_decay"]: g["params"] for g in opt.param_groups}
    assert set(decay) == {embedded.cfg.weight_decay, 0.0}
    assert all(p.dim() >= 2 for p in decay[embedded.cfg.weight_decay])
    assert all(p.dim() == 1 for p in decay[0.0])
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert all(g["betas"] == (0.9, 0.95) and g["lr"] == embedded.cfg.lr for g in opt.param_groups)


def test_lr_warms_up_then_decays_to_a_tenth(embedded):
    lr, total = embedded.cfg.lr, 200
    warmup = round(0.05 * total)
    lrs = [embedded.lr_at(s, total) for s in range(total + 1)]
    assert lrs[0] == pytest.approx(lr / warmup)
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1:warmup]))  # warm-up rises
    assert max(lrs) == pytest.approx(lr) and lrs[warmup - 1] == pytest.approx(lr)
    assert all(a >= b for a, b in zip(lrs[warmup - 1:], lrs[warmup:]))  # then only decays
    assert lrs[total] == pytest.approx(0.1 * lr)
    assert embedded.lr_at(total + 50, total) == pytest.approx(0.1 * lr)  # held past the end
    assert isinstance(embedded.lr_at(0, 1), float) and embedded.lr_at(0, 1) == pytest.approx(lr)


# ------------------------------------------------------------------ samples at the end
def test_samples_are_reproducible_quick_and_leave_the_model_training(embedded):
    model = model_of(embedded).train()
    start = time.process_time()  # CPU seconds: other processes on the machine do not count
    first = embedded.finish(model)
    took = time.process_time() - start
    assert model.training
    assert first == embedded.finish(model)  # seeded by --seed
    samples = first["samples"]
    assert len(samples) == 3 and all(s["text"] for s in samples)
    val = bytes(embedded.streams().val.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
    assert all(s["prompt"] in val and len(s["prompt"]) <= 32 for s in samples)
    assert took < 2.0


def test_token_samples_are_ids(tmp_path):
    np.array(list(range(300)) * 4, dtype=np.uint16).tofile(tmp_path / "t.bin")
    w = workload(data_dir=str(tmp_path / "t.bin"), seq_len=16)
    samples = w.finish(model_of(w))["samples"]
    assert len(samples) == 3
    assert all(len(s["tokens"]) == 160 and len(s["prompt_tokens"]) == 16 for s in samples)
    assert all(0 <= t < w.vocab() for s in samples for t in s["tokens"])
    assert os.path.getsize(tmp_path / "t.bin") == 2400

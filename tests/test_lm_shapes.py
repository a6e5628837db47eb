"""The lm workload's shapes (--model LxDxH and the named sizes beside tiny, small and gpt2), a
nanoGPT character-level folder's meta.pkl (its vocabulary and characters), and --weights as a
warm start: each bad input one line (issue 86). In-process and on the CPU: no run is started."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from labkit.core.config import ConfigError
from labkit.training.checkpoint import atomic_torch_save
from labkit.workloads.lm import BY_WIDTH, LR, SEQ_LEN, defaults, sizes
from labkit.workloads.lm.sizes import SIZES, Size

from helpers import lm_workload as workload


@pytest.fixture(autouse=True)
def one_thread():
    """As each torchrun rank runs (OMP_NUM_THREADS=1); conftest restores the count after."""
    torch.set_num_threads(1)

pytestmark = pytest.mark.unit

#: nanoGPT's shakespeare_char vocabulary: the 65 characters of tiny Shakespeare
CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"



def text_dir(tmp_path) -> str:
    """A small text file: a byte dataset with no embedded corpus to read."""
    path = tmp_path / "text.txt"
    path.write_bytes(b"To be, or not to be, that is the question.\n" * 40)
    return str(path)


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert message and "\n" not in message
    return message


# ------------------------------------------------------------------ --model: sizes and shapes
def test_a_shape_and_the_named_sizes_resolve():
    assert sizes.parse("6x384x6") == Size(6, 384, 6) == SIZES["shakespeare"]
    assert sizes.parse(" 12X768X12 ") == SIZES["gpt2"]
    assert SIZES["tiny"] == (2, 64, 2) and SIZES["small"] == (4, 128, 4)  # unchanged
    assert {n: SIZES[n] for n in ("cs336-small", "cs336-medium", "cs336-large", "cs336-xl",
                                  "cs336-2.7b")} == {
        "cs336-small": (12, 768, 12), "cs336-medium": (24, 1024, 16),
        "cs336-large": (36, 1280, 20), "cs336-xl": (48, 1600, 25), "cs336-2.7b": (32, 2560, 32)}
    for name, s in SIZES.items():
        assert s.d_model % s.heads == 0, name  # a whole head width
        assert sizes.parse(s.shape) == s and sizes.parse(name) == s
    c = workload(model=" 6X64X2").cfg
    assert (c.model, c.seq_len, c.lr) == ("6x64x2", 64, 3e-3)  # recorded as a shape, tiny's


def test_defaults_by_width_keep_the_old_sizes_own():
    for name in ("tiny", "small", "gpt2"):  # bit for bit what they were
        assert defaults(SIZES[name]) == (SEQ_LEN[name], LR[name])
        c = workload(model=name).cfg
        assert (c.model, c.seq_len, c.lr) == (name, SEQ_LEN[name], LR[name])
    assert defaults(SIZES["shakespeare"]) == (256, 1e-3)  # nanoGPT's block_size and lr
    assert defaults(Size(1, 65, 1)) == (256, 1e-3) and defaults(Size(1, 385, 1))[0] == 1024
    assert [defaults(SIZES[f"cs336-{n}"])[1] for n in ("small", "medium", "large", "xl", "2.7b")] \
        == [6e-4, 3e-4, 2.5e-4, 2e-4, 1.6e-4]  # GPT-3's for its models of those widths
    assert defaults(Size(1, 10_000, 1)) == BY_WIDTH[-1][1:]
    given = workload(model="shakespeare", seq_len=32, lr=0.1).cfg
    assert (given.seq_len, given.lr) == (32, 0.1)


@pytest.mark.parametrize("model,message", [
    ("huge", r"^unknown model 'huge' for the lm workload; choose a size \(tiny, small, gpt2, "
             r"shakespeare, cs336-small, .*\) or a shape LxDxH \(layers x width x heads"),
    ("6x384", r"^--model '6x384' has 2 parts, not 3: a shape is LxDxH"),
    ("6x384x6x1", r"^--model '6x384x6x1' has 4 parts, not 3"),
    ("6x384x5", r"^--model '6x384x5': width 384 is not a multiple of 5 heads .* LxDxH"),
    ("0x64x2", r"^--model '0x64x2': layers '0' is not a positive integer; a shape is LxDxH"),
    ("6x-64x2", r"^--model '6x-64x2': width '-64' is not a positive integer"),
    ("6x64x0", r"^--model '6x64x0': heads '0' is not a positive integer"),
    ("6x64.5x2", r"^--model '6x64.5x2': width '64.5' is not a positive integer"),
    ("6xx2", r"^--model '6xx2': width '' is not a positive integer"),
])
def test_a_bad_model_is_one_line(model, message):
    with pytest.raises(ConfigError, match=message) as e:
        workload(model=model)
    assert "LxDxH" in one_line(e)


@pytest.mark.parametrize("shape", ["3x48x4", "1x24x3", "2x96x2"])
def test_a_shapes_model_has_the_counted_parameters(shape, tmp_path):
    w = workload(model=shape, seq_len=16, data_dir=text_dir(tmp_path))
    s = sizes.parse(shape)
    assert w.size() == s
    torch.manual_seed(0)
    model = w.build_model()
    counted = sum(p.numel() for p in model.parameters())  # the tied head once
    assert counted == sizes.parameters(s, 256, 16)
    assert (len(model.blocks), model.tok.weight.shape[1], model.blocks[0].attn.heads) == s
    assert w.state_values() == sum(t.numel() for t in model.state_dict().values())
    line = w.summary_line(w.datasets())
    assert line.startswith(f"transformer {shape} ({s.layers} layers, d {s.d_model}, "
                           f"{s.heads} heads, {counted / 1e6:.2f}M params")
    d = w.describe()
    assert {k: d[k] for k in ("model", "layers", "d_model", "heads", "parameters", "vocab")} == {
        "model": shape, "layers": s.layers, "d_model": s.d_model, "heads": s.heads,
        "parameters": counted, "vocab": 256}
    assert d["flops_per_token"] == 3 * w.forward_flops(None) // 16 == 6 * (
        counted - 16 * s.d_model) + 12 * s.layers * 16 * s.d_model
    assert f"{d['flops_per_token'] / 1e6:.2f} MFLOP/token" in line


def test_every_named_size_builds_with_its_counted_parameters():
    """On the meta device: no weights made, so the 2.7B one costs nothing."""
    for name, s in SIZES.items():
        T, _ = defaults(s)
        with torch.device("meta"):
            model = workload(model=name).build_model()
        assert sum(p.numel() for p in model.parameters()) == sizes.parameters(s, 256, T), name


# ------------------------------------------------------------------ nanoGPT's meta.pkl
def char_folder(tmp_path, meta: object = None, name: str = "shakespeare_char") -> str:
    """A folder as nanoGPT's data/shakespeare_char/prepare.py leaves it: train.bin and val.bin
    of uint16 ids below 65 (all 65 used), and meta.pkl (``meta``, or the 65 characters')."""
    folder = tmp_path / name
    folder.mkdir()
    stoi = {ch: i for i, ch in enumerate(CHARS)}
    ids = np.random.default_rng(0).integers(0, 65, size=4000).astype(np.uint16)  # 1 in 65 "\n"
    ids[: len(ids) * 9 // 10].tofile(folder / "train.bin")
    ids[len(ids) * 9 // 10:].tofile(folder / "val.bin")
    if meta is None:
        meta = {"vocab_size": 65, "itos": dict(enumerate(CHARS)), "stoi": stoi}
    if meta is not False:
        (folder / "meta.pkl").write_bytes(meta if isinstance(meta, bytes) else pickle.dumps(meta))
    return str(folder)


def test_meta_pkl_gives_the_vocabulary_and_text_samples(tmp_path):
    w = workload(data_dir=char_folder(tmp_path), seq_len=16)
    assert w.cfg.dataset == "tokens" and w.vocab() == 65
    assert w.shape()["vocab"] == 65 and "65 tokens" in w.summary_line(w.datasets())
    torch.manual_seed(0)
    model = w.build_model()
    assert model.tok.weight.shape == (65, 64)
    samples = w.finish(model)["samples"]
    val = "".join(CHARS[i] for i in w.streams().val.tolist())
    assert len(samples) == 3 and all(set(s) == {"prompt", "text"} for s in samples)
    assert all(len(s["text"]) == 160 and set(s["text"]) <= set(CHARS) for s in samples)
    assert all(len(s["prompt"]) == 16 and s["prompt"] in val for s in samples)
    assert all(val[val.index(s["prompt"]) - 1] == "\n" for s in samples)  # each at a line's start
    without = workload(data_dir=char_folder(tmp_path, meta=False, name="no_meta"), seq_len=16)
    assert without.vocab() == 128  # as before: the largest token, 64, + 1, rounded up to 64s
    assert "tokens" in without.finish(without.build_model())["samples"][0]


@pytest.mark.parametrize("meta,message", [
    (b"not a pickle", r"'.*meta.pkl' is unreadable: not a pickled dict"),
    ({"itos": {}, "stoi": {}}, r"'.*meta.pkl' has no vocab_size \(a positive int; it holds "
                               r"'itos', 'stoi'\)"),
    ({"vocab_size": "65"}, r"'.*meta.pkl' has no vocab_size"),
    ([65], r"'.*meta.pkl' holds a list, not nanoGPT's dict"),
    ({"vocab_size": 60}, r"token file '.*train.bin' holds token 64, not below the vocab_size 60 "
                         r"of '.*meta.pkl'"),
])
def test_a_bad_meta_pkl_is_one_line(tmp_path, meta, message):
    w = workload(data_dir=char_folder(tmp_path, meta=meta), seq_len=16)
    with pytest.raises(ConfigError, match=message) as e:
        w.check()
    assert "meta.pkl" in one_line(e)


# ------------------------------------------------------------------ --weights: a warm start
def saved_model(tmp_path, model: str = "tiny", seed: int = 1) -> tuple[str, dict]:
    """A method's folder as a finished lm run leaves it: its final_model.pt, a state_dict."""
    folder = tmp_path / "run" / "ddp"
    folder.mkdir(parents=True)
    torch.manual_seed(seed)
    state = workload(model=model, seq_len=16).build_model().state_dict()
    path = folder / "final_model.pt"
    atomic_torch_save(state, str(path))
    return str(path), state


def test_weights_start_every_build_from_the_saved_model(tmp_path):
    path, state = saved_model(tmp_path)
    fresh = workload(seq_len=16)
    torch.manual_seed(0)
    assert not torch.equal(fresh.build_model().tok.weight, state["tok.weight"])
    for given in (path, str(tmp_path / "run" / "ddp")):  # the file, or the method's folder
        w = workload(seq_len=16, weights=given)
        assert w.cfg.weights == path
        for seed in (0, 5):  # whatever each rank's seed made, the file's model
            torch.manual_seed(seed)
            model = w.build_model()
            assert model.state_dict().keys() == state.keys()
            assert all(torch.equal(t, state[k]) for k, t in model.state_dict().items())
        assert model.head.weight is model.tok.weight  # still tied
        assert w.note == f"warm start: weights loaded from {path}"
        assert w.shape()["weights"] == path


@pytest.mark.parametrize("model,message", [
    ("2x32x2", r"does not fit --model 2x32x2 \(vocabulary 256, --seq-len 16\): tok.weight is "
               r"\[256, 64\] in the file, \[256, 32\] in the model$"),
    ("3x64x2", r"does not fit --model 3x64x2 .*: it has no blocks.2.ln1.weight"),
    ("1x64x2", r"holds 12 tensor\(s\) the model has not, the first blocks.1.ln1.weight"),
])
def test_weights_of_another_model_are_one_line(tmp_path, model, message):
    path, _ = saved_model(tmp_path)
    w = workload(model=model, seq_len=16, weights=path)
    with pytest.raises(ConfigError, match=message) as e:
        w.build_model()
    assert one_line(e).startswith(f"--weights '{path}'")


def test_missing_or_unreadable_weights_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^--weights '.*nowhere.pt' not found") as e:
        workload(weights=str(tmp_path / "nowhere.pt"))
    assert one_line(e)
    saved_model(tmp_path)
    with pytest.raises(ConfigError, match=r"is a folder without final_model.pt; name one "
                                          r"method's: .*run/ddp/final_model.pt$") as e:
        workload(weights=str(tmp_path / "run"))
    assert one_line(e)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    w = workload(weights=str(tmp_path / "junk.pt"))
    with pytest.raises(ConfigError, match=r"is not a loadable state_dict") as e:
        w.build_model()
    assert one_line(e)

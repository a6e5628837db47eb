"""Memory per rank (issue 85, items 5, 7 and 6's preflight per method): the CPU's step tracker
against an MLP's arithmetic, DDP's held state against its memory model (the session's TINY
ddp run: FSDP's and zero3's are asserted on their own modules' runs, tests/test_fsdp.py and
tests/test_zero3.py), the report's memory table and its sentence on page one from a run folder
made here, and the host-memory preflight holding a sharded method to its share of a replica.
No run of its own: in-process, and ddp_run's figures."""
from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from helpers import load_json

GiB = 1 << 30


# ------------------------------------------------------------------ the tracker, by arithmetic
@pytest.mark.unit
def test_the_step_tracker_sees_an_mlps_parameters_gradients_state_and_activations():
    """SGD with momentum on an MLP whose every size is known. Between steps it holds its
    parameters P, their gradients P and the momentum P. The step's peak is the end of backward:
    zero_grad freed the old gradients, backward made new ones, and what is still live then is
    the input x (B x D) and the gradient flowing into the first layer (B x H); the forward's
    activations (2 x 2 B x H) are freed by then, and the optimizer's step works in place. So
    the peak is 3 P + 4 B D + 4 B H bytes, to within the loss's scalars."""
    from labkit.training.instruments.memory import StepTracker, held

    torch.manual_seed(0)
    B, D, H, C = 256, 512, 1024, 16
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, C))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(B, D), torch.randint(0, C, (B,))

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    P = 4 * sum(p.numel() for p in model.parameters())
    assert held(model, state) == [P, P, P]
    tracker = StepTracker(model, state)
    with tracker:
        step()
    assert tracker.failed is None and tracker.most == [P, P]
    assert tracker.peak == pytest.approx(3 * P + 4 * B * D + 4 * B * H, rel=1e-3)
    assert torch.UntypedStorage.resize_ is tracker._resize  # put back


@pytest.mark.unit
def test_the_tracker_follows_a_storage_resized_outside_any_operator():
    """FSDP2 and zero3 gather into a storage they empty with resize_(0) between uses: the
    tracker counts what resize_ gives it and what it takes back."""
    from labkit.training.instruments.memory import StepTracker

    model = nn.Linear(4, 4)
    whole = torch.zeros(1000)
    whole.untyped_storage().resize_(0)
    tracker = StepTracker(model, [])
    with tracker:
        whole.untyped_storage().resize_(4000)
        gathered = tracker.now
        whole.untyped_storage().resize_(0)
    assert gathered - tracker.now == 4000 and tracker.peak >= 4000 + 4 * 20


# ------------------------------------------------------------------ DDP against its model
@pytest.mark.warm
def test_ddp_holds_what_its_memory_model_declares(ddp_run):
    """The TINY ddp run on 2 ranks (SGD with momentum on the ResNet): each rank holds the
    parameters, the gradients and the momentum, 4 bytes a weight each, as memory_per_rank's
    replica declares (within 1%: the model counts the trainable weights, the run the storages);
    its step's peak holds them and more (activations, DDP's buckets); the largest ResNet of
    the family fits this machine by the model."""
    doc = load_json(ddp_run / "results_baseline_ddp.json")
    mem, model = doc["epochs"][-1]["memory"], doc["memory_model"]
    assert model["world"] == 2 and model["state_per_value"] == 1
    for k in ("parameters", "gradients", "optimizer"):
        assert model[k] == [4 * model["values"]] * 2
        for measured, modelled in zip(mem[k], model[k]):
            assert measured == pytest.approx(modelled, rel=0.01), (k, mem, model)
    assert mem["step"] == 3 and mem["allocator_peak"] is None  # the last of 3 warm-up steps
    for r in range(2):
        assert mem["step_parameters"][r] == mem["parameters"][r]  # a replica gathers nothing
        assert mem["tracked_peak"][r] > sum(mem[k][r] for k in ("parameters", "gradients", "optimizer"))
    assert model["capacity"] == "host memory" and model["capacity_per_rank"] > 0
    # the most weights that fit a rank, as the preflight reckons them: 5 x 4 bytes a weight
    room = model["capacity_per_rank"] - model["overhead"]
    assert model["largest_values"] == pytest.approx(room / 20, rel=1e-6)


# ------------------------------------------------------------------ the report
def _result(method: str, step_s: float, held: list[int], step: list[int], peak: int,
            model: list[int], sent: float) -> dict:
    """A lab result file of 2 ranks, 3 epochs of 20 steps near ``step_s`` s, whose memory
    record holds ``held`` (parameters, gradients, optimizer: each rank's), ``step`` (the most
    parameters and gradients in a step) and ``peak``, its model ``model``."""
    import numpy as np

    MiB = 1 << 20
    names = {"ddp": "Baseline DDP (PyTorch)", "fsdp": "FSDP2 (PyTorch fully_shard)"}
    rng = np.random.default_rng(len(method))
    memory = {"step": 3, **{k: [v] * 2 for k, v in zip(("parameters", "gradients", "optimizer"), held)},
              "step_parameters": [step[0]] * 2, "step_gradients": [step[1]] * 2,
              "tracked_peak": [peak, peak - 8], "allocator_peak": None}
    epochs = []
    for i in range(3):
        times = (step_s * (1 + 0.01 * rng.standard_normal(20))).tolist()
        epochs.append({"epoch": i + 1, "train_loss": 1.0, "train_accuracy": 50.0 + i,
                       "train_time": sum(times), "train_throughput": 16 / step_s, "avg_batch_time": step_s,
                       "val_loss": 1.0, "val_accuracy": 60.0 + i, "step_times": times,
                       "steps": 23, "memory": memory,
                       "wire": {"trainer": [True, True], "sent_per_step": [sent] * 2,
                                "received_per_step": [sent] * 2}})
    return {"method": names[method], "method_key": method, "world_size": 2, "batch_size": 8,
            "trainers": 2, "status": "completed", "schema": "labkit.results/1",
            "config": {"seed": 0, "model": "resnet10_small", "dataset": "digits"}, "epochs": epochs,
            "memory_model": {"values": 1 << 20, "state_per_value": 1, "world": 2,
                             **{k: [v] * 2 for k, v in zip(("parameters", "gradients", "optimizer"), model)},
                             "tensors": 5 * sum(model) // 3, "capacity_per_rank": 4 * GiB,
                             "capacity": "host memory", "overhead": 0,
                             "largest_values": 200_000_000 * 12 * MiB // sum(model)}}


@pytest.mark.unit
def test_the_memory_table_and_page_one_say_what_sharding_saves_and_costs(tmp_path):
    """A run folder of DDP and FSDP: the table has a row per method with its held state, the
    most in a step, the model, the peak, the preflight's estimate, the time per step with its
    interval and the bytes per step; page one says what FSDP saves against DDP and what it costs
    in time with the interval and its verdict, and what of the family fits; a folder without
    the records (labkit before them) has neither, its report as before
    (tests/test_old_run_folders.py)."""
    from labkit import report

    MiB = 1 << 20
    for m, doc in (("ddp", _result("ddp", 0.100, [4 * MiB, 4 * MiB, 4 * MiB], [4 * MiB, 4 * MiB],
                                   20 * MiB, [4 * MiB] * 3, 2e6)),
                   ("fsdp", _result("fsdp", 0.150, [2 * MiB, 2 * MiB, 2 * MiB], [3 * MiB, 3 * MiB],
                                    15 * MiB, [2 * MiB] * 3, 3e6))):
        (tmp_path / m).mkdir()
        (tmp_path / m / f"results_{'baseline_ddp' if m == 'ddp' else m}.json").write_text(json.dumps(doc))
    text = report.text_report(report.load_run(tmp_path))
    at = text.index("\nMemory per rank\n---")
    part = text[at:text.index("\n\n\n", at) if "\n\n\n" in text[at:] else None]
    assert "Table 13. Memory per rank (the fullest rank; measured, and each method's own model)" in part
    rows = {line.split("  ")[0]: line for line in part.splitlines() if line.startswith(("Baseline DDP", "FSDP"))}
    assert "4.00 + 4.00 + 4.00 = 12.00" in rows["Baseline DDP"] and "20.00" in rows["Baseline DDP"]
    assert "2.00 + 2.00 + 2.00 = 6.00" in rows["FSDP"] and "8.00" in rows["FSDP"]  # the most in a step
    assert re.search(r" 1(49|50)\.\d \(1\d\d\.\d-1\d\d\.\d\) ", rows["FSDP"]) and "3.00 / 3.00" in rows["FSDP"]
    said = next(line for line in text.splitlines() if line.startswith("- Memory per rank against DDP"))
    assert said.startswith("- Memory per rank against DDP (Table 13): FSDP saves 33% of DDP's state "
                           "per rank at most in a step (8.00 of 12.00 MiB), saves 25% of DDP's peak "
                           "(15.00 of 20.00 MiB), and takes 1.50x DDP's time per step (95% CI "), said
    assert said.endswith(": slower than DDP)."), said
    fits = next(line for line in text.splitlines() if line.startswith("- Largest model"))
    assert fits.startswith("- Largest model that fits this machine's memory per rank (4.00 GiB of "
                           "host memory a rank, 2 ranks), "), fits
    assert fits.endswith(": Baseline DDP 200M weights, FSDP 400M weights; this model has 1.05M."), fits
    # the appendix defines the table's terms, only where the table is
    assert "Memory per rank. MiB (2^20 bytes) of the rank that held the most." in text
    for d in ("ddp", "fsdp"):
        path = next((tmp_path / d).glob("results_*.json"))
        doc = json.loads(path.read_text())
        doc.pop("memory_model")
        for e in doc["epochs"]:
            e.pop("memory")
        path.write_text(json.dumps(doc))
    old = report.text_report(report.load_run(tmp_path))
    assert "Memory per rank" not in old and "Largest model" not in old and "Table 13" not in old


# ------------------------------------------------------------------ the preflight per method
@pytest.mark.unit
def test_the_preflight_admits_a_sharded_method_where_a_replica_does_not_fit(tmp_path, monkeypatch):
    """GPT-2 small (byte vocabulary, 1024 tokens: 86.2M values, 329 MiB) on 4 ranks with 6 GiB
    free: DDP needs 4 x (500 MiB + 5 x the model) and is refused in one line; FSDP holds a
    quarter of a replica's state on each rank (memory_per_rank: 1/N of each) and needs 4 x
    (500 MiB + 5 x the model x 0.25): admitted. zero3 holds its shard and the units it gathers
    (the root and the largest block), a little more than FSDP."""
    from labkit.core import resources
    from labkit.core.config import ConfigError, TrainConfig
    from labkit.training.budget import check, needs
    from labkit.workloads import make_workload, resolve

    monkeypatch.setattr(resources, "free_memory", lambda: 6 * GiB)

    def memory(method):
        cfg = resolve(TrainConfig(method=method, workload="lm", model="gpt2"), False, 4)
        w = make_workload(cfg)
        return w, next(n for n in needs(cfg, w, 4, 0, str(tmp_path)) if n.what == "host memory")

    w, ddp = memory("ddp")
    model, data = 4 * w.state_values(), w.data_bytes()
    assert w.state_values() == 86_235_648
    assert ddp.needed == 4 * (resources.RANK_BASE + 5 * model + data) and ddp.short
    assert "(4 rank(s) x (500.0 MiB for torch + 5 x the 329.0 MiB model + " in ddp.line()
    with pytest.raises(ConfigError, match=r"^not enough host memory in this node: the run needs "
                                          r"about 8\.4 GiB .* 6\.0 GiB free"):
        check([ddp])
    _, fsdp = memory("fsdp")
    assert fsdp.needed == 4 * (resources.RANK_BASE + round(5 * model * 0.25) + data)
    assert not fsdp.short and check([fsdp]) == []  # admitted, with room to spare
    assert "5 x the 329.0 MiB model x 0.25 (fsdp holds 25% of a replica's state per rank)" in fsdp.line()
    _, zero3 = memory("zero3")
    assert fsdp.needed < zero3.needed < ddp.needed and not zero3.short

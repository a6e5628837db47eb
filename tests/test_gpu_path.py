"""The GPU path's switches, checked for correctness on the CPU: AMP (bf16, fp16 with a
gradient scaler), channels_last and torch.compile change how a step is computed, not what it
computes. On a GPU they are measured by `labkit bench` (docs/performance.md, "On one GPU")."""
from __future__ import annotations

import pytest
import torch

from helpers import TINY, TINY_CFG, check_ok
from warm import warm_run
from labkit.core.config import TrainConfig
from labkit.training import rank
from labkit.workloads.images.models import build_model

# the session's equivalence_runs are built once: every test using them on one xdist worker.
# Every test here trains for real (in-process through the rank's entry point, or on ranks
# forked from the warm interpreter): the torchrun kind, not make test-fast's (fp16 on a CPU:
# seconds a step)
pytestmark = [pytest.mark.xdist_group("equivalence_runs"), pytest.mark.torchrun]

# Synthetic 8x8 images: on this CPU an fp16 convolution backward has no fast kernel and takes
# ~48 s per step at 32x32, ~1 s at 8x8 (measured). The checks are about the numerics of a
# step, which do not depend on the image size. (Not 4x4: layer4 then sees 1x1 inputs, where
# the CPU's bf16 convolution returned garbage gradients.)
STEPS = ["--max-steps-per-epoch", "3", "--dataset", "synthetic", "--image-size", "8",
         "--num-classes", "10", "--synthetic-samples", "64"]


@pytest.fixture(autouse=True, scope="module")
def true_fp32():
    """On a GPU, cuDNN convolutions run in TF32 by default (a 10-bit mantissa): on an H100 the
    first loss of channels_last then differed from NCHW's by 8.8e-5 relative (2026-11-23),
    which is TF32's rounding, not the layout. These checks compare layouts and precisions
    against true fp32 (no effect on a CPU)."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def run_single(tmp_path, name, *flags):
    out = tmp_path / name
    assert rank.main([*TINY, *STEPS, "--method", "ddp", "--out", str(out), *flags]) == 0
    doc = __import__("json").loads((out / "results_baseline_ddp.json").read_text())
    return torch.load(out / "final_model.pt", weights_only=True), doc["epochs"][0]["all_losses"]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return run_single(tmp_path_factory.mktemp("fp32"), "fp32")


def initial_state() -> dict:
    """The weights every run here starts from: the rank's seed, then its model (as
    labkit.training.rank builds it)."""
    torch.manual_seed(TrainConfig().seed)
    model, _ = build_model(TINY_CFG["model"], int(STEPS[STEPS.index("--num-classes") + 1]))
    return model.state_dict()


def update(model: dict, start: dict) -> torch.Tensor:
    """What training changed: every trained parameter less its start, as one vector."""
    return torch.cat([(model[k].float() - start[k].float()).flatten() for k in model
                      if model[k].is_floating_point() and "running_" not in k])


def _max_diff(a, b, buffers=True):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a
               if a[k].is_floating_point() and (buffers or "running_" not in k))


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_trains_like_fp32_but_computes_in_low_precision(tmp_path, fp32, amp):
    try:
        with torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[amp]):
            torch.nn.functional.conv2d(torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3))
    except RuntimeError as e:
        pytest.skip(f"this CPU build has no {amp} autocast for convolutions: {e}")
    model, losses = run_single(tmp_path, amp, "--amp", amp)
    ref_model, ref_losses = fp32
    assert all(l == l for l in losses)  # finite
    # low precision really happened: the losses differ from fp32 ...
    assert losses != ref_losses
    # ... by about the precision of the format, not by a broken step
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 0.1
    assert _max_diff(model, ref_model) < 0.05
    # the weights moved, and as fp32's did: these 3 steps move no weight by more than about
    # 0.02, so "0.05 apart" alone would pass a run that never updated. AMP's update (its
    # weights less the initial ones) points where fp32's does and is as long (measured on this
    # CPU, 2026-11-28: cosine 0.974 bf16, 0.996 fp16; lengths within 0.5%)
    start = initial_state()
    amp_step, fp32_step = update(model, start), update(ref_model, start)
    assert fp32_step.norm() > 0
    assert torch.nn.functional.cosine_similarity(amp_step, fp32_step, dim=0) > 0.9
    assert 0.8 < amp_step.norm() / fp32_step.norm() < 1.25


def test_channels_last_computes_the_same_model(tmp_path, fp32):
    model, losses = run_single(tmp_path, "cl", "--channels-last")
    ref_model, ref_losses = fp32
    # the first loss comes from the same weights: only the summation order differs
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-5)
    # later steps start from weights that drifted by rounding (seen: 1.3e-4 relative at step 3
    # on digits); a wrong layout would change the loss at once, by far more
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    # channels_last runs other convolution kernels, which sum in another order; after 3 steps
    # the largest difference measured was 1.0e-3 (first conv's weights, values up to 0.2) and
    # 1.8e-3 in BatchNorm running variances (values near 1); a wrong layout would be O(0.1)
    assert _max_diff(model, ref_model) < 1e-2


def test_compile_keeps_the_synchronisation(tmp_path, equivalence_runs):
    """torch.compile with the hand-written all-reduce: its gradient hooks must still fire
    (graph capture with aot_eager; inductor's code generation is the same graph, minutes slower)."""
    eager_dir, _ = equivalence_runs["allreduce"]
    out = tmp_path / "compiled"
    p = warm_run(2, TINY + ["--method", "allreduce", "--bucket-mb", "1", "--compile",
                            "--compile-backend", "aot_eager", "--out", str(out)], cwd=tmp_path)
    check_ok(p)
    a = torch.load(out / "final_model.pt", weights_only=True)
    b = torch.load(eager_dir / "final_model.pt", weights_only=True)
    assert _max_diff(a, b) < 1e-4

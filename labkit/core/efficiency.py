"""How much of a GPU a run used: model FLOPs utilisation (MFU) against the GPU's peak for the
precision used, and when a run's data wait makes it a measurement of the data loader.

MFU = model FLOPs per image (forward x 3 for forward and backward, counted by
torch.utils.flop_counter on one forward) x images per second / (peak FLOP/s per GPU x GPUs).
The peaks are the vendors' dense (no sparsity) figures per GPU, by the name
torch.cuda.get_device_name() gives; a GPU not in the table has no MFU (None), nor has a CPU.
"""
from __future__ import annotations

from typing import Optional

# dense tensor-core TFLOP/s per GPU (NVIDIA datasheets; fp32: the non-tensor-core figure)
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.8, "fp32": 60.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}
#: a run whose trainers waited for data longer than this share of the step measured the loader
DATA_WAIT_FLAG = 0.10
LOADER_FLAG_TEXT = "this run measured the data loader"


def gpu_model(device_name: Optional[str]) -> Optional[str]:
    """The PEAK_TFLOPS row of a torch.cuda.get_device_name() (e.g. "NVIDIA H100 80GB HBM3")."""
    n = (device_name or "").upper()
    if "H200" in n:
        return "H200"
    if "H100" in n:
        return "H100 NVL" if "NVL" in n else "H100 PCIe" if "PCIE" in n else "H100 SXM"
    if "A100" in n:
        return "A100"
    return None


def precision(amp: str, tf32: bool) -> str:
    """The precision the model's matrix work runs in: the autocast type, else TF32 where cuDNN
    may use it (its default), else fp32."""
    return {"bf16": "bf16", "fp16": "fp16"}.get(amp, "tf32" if tf32 else "fp32")


def peak_flops(device_name: Optional[str], prec: str) -> Optional[float]:
    """Peak FLOP/s of one GPU at ``prec``; None for a GPU not in the table (or a CPU)."""
    row = PEAK_TFLOPS.get(gpu_model(device_name) or "")
    return row[prec] * 1e12 if row and prec in row else None


def mfu(flops_per_image: Optional[float], images_per_s: Optional[float],
        peak: Optional[float], gpus: int) -> Optional[float]:
    """Achieved model FLOP/s over the GPUs' peak (0-1); None where a figure is missing."""
    if not flops_per_image or not images_per_s or not peak or gpus < 1:
        return None
    return flops_per_image * images_per_s / (peak * gpus)


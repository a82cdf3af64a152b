"""The MFU denominator: one device's peak FLOP/s, and where the figure came from.

Three sources, first that applies:

- ``monitor.peak_tflops`` when set: ``"configured"``;
- on a GPU whose name :data:`PUBLISHED_PEAKS` recognises and which has a figure for the
  run's matmul precision: the vendor's published *dense* peak,
  ``"published:<gpu>:<precision>"``;
- otherwise a matmul timed on this device at start: ``"measured:cpu"``, or
  ``"measured:cuda:<precision>"`` on a GPU the table does not know.

The matmul precision is the training precision, except that fp32 training on a GPU whose
fp32 matmuls are allowed to run on TF32 tensor cores
(``torch.set_float32_matmul_precision("high")``) is held to the TF32 peak.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

CONFIGURED = "configured"
MEASURED_CPU = "measured:cpu"

# matmul precisions (keys of GpuPeaks.tflops) and the dtype a measurement uses for each
MATMUL_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16,
                                         "tf32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device and its source (see the module docstring)."""

    flops: float
    source: str


@dataclass(frozen=True)
class GpuPeaks:
    """A GPU model: ``pattern`` is searched in the upper-cased
    ``torch.cuda.get_device_name()``; ``tflops`` maps a matmul precision to the vendor's
    dense (not 2:4-sparse) peak TFLOP/s of one torch device."""

    name: str
    pattern: str
    tflops: Mapping[str, float]


# First match wins, so a model's variants (PCIe, NVL) come before its bare name. The
# figures are written from the vendors' own documents; where a datasheet gives only the
# 2:4-sparsity figure (marked with an asterisk there), the dense peak is half of it.
# "fp32" is the non-tensor-core peak on NVIDIA parts, the matrix-core FP32 peak on AMD's.
PUBLISHED_PEAKS: tuple[GpuPeaks, ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM, PCIe and NVL columns; tensor figures
    # are with sparsity, halved here)
    GpuPeaks("H100-NVL", r"\bH100\b.*\bNVL\b",
             {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    GpuPeaks("H100-PCIe", r"\bH100\b.*\bPCIE\b",
             {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    GpuPeaks("H100-SXM", r"\bH100\b",  # "NVIDIA H100 80GB HBM3"
             {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM and NVL columns; same convention)
    GpuPeaks("H200-NVL", r"\bH200\b.*\bNVL\b",
             {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    GpuPeaks("H200-SXM", r"\bH200\b",
             {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA A100 Tensor Core GPU datasheet: the 40GB and 80GB, PCIe and SXM columns
    # list the same dense peaks ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")
    GpuPeaks("A100-PCIe", r"\bA100\b.*\bPCIE\b",
             {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    GpuPeaks("A100-SXM", r"\bA100\b",
             {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    # NVIDIA L40S datasheet (lists dense and sparse figures)
    GpuPeaks("L40S", r"\bL40S\b",
             {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    # NVIDIA L4 Tensor Core GPU datasheet (sparse figures, halved)
    GpuPeaks("L4", r"\bL4\b",
             {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # NVIDIA A10 Tensor Core GPU datasheet (dense and sparse). The A10G (AWS G5) is a
    # different part with no NVIDIA datasheet, and published third-party figures for its
    # tensor cores disagree, so it is not listed: an A10G is measured.
    GpuPeaks("A10", r"\bA10\b",
             {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    # NVIDIA Tesla V100 datasheet ("Tesla V100-SXM2-16GB", "Tesla V100-PCIE-32GB",
    # "Tesla V100S-PCIE-32GB"): tensor cores take fp16 only (no bf16, no tf32), so a
    # bf16 run on a V100 is measured
    GpuPeaks("V100S-PCIe", r"\bV100S\b", {"fp16": 130.0, "fp32": 16.4}),
    GpuPeaks("V100-SXM2", r"\bV100\b.*\bSXM2\b", {"fp16": 125.0, "fp32": 15.7}),
    GpuPeaks("V100-PCIe", r"\bV100\b.*\bPCIE\b", {"fp16": 112.0, "fp32": 14.0}),
    # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090 column: fp16 and bf16
    # tensor figures with FP32 accumulation (what torch's matmuls use), dense. The name
    # must end at "4090": the 4090 D and the laptop part are slower.
    GpuPeaks("RTX-4090", r"\bRTX 4090$",
             {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    # AMD Instinct MI300X data sheet (one torch device per package)
    GpuPeaks("MI300X", r"\bMI300X\b",
             {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    # AMD Instinct MI250X data sheet, per package (383 bf16/fp16, 95.7 FP32 matrix),
    # halved: each of its two dies is a torch device of its own. A name that also reads
    # MI250 ("MI250X / MI250") cannot tell the two parts apart and is measured.
    GpuPeaks("MI250X", r"\bMI250X\b(?!.*\bMI250\b)",
             {"bf16": 191.5, "fp16": 191.5, "fp32": 47.85}),
)


def matmul_precision(precision: str) -> str:
    """The key of :attr:`GpuPeaks.tflops` for training ``precision`` (fp32, bf16 or
    fp16) on a GPU: fp32 becomes tf32 when torch lets fp32 matmuls use TF32."""
    if precision != "fp32":
        return precision
    tf32 = (torch.backends.cuda.matmul.allow_tf32
            or torch.get_float32_matmul_precision() != "highest")
    return "tf32" if tf32 else "fp32"


def published_peak(device_name: str, precision: str) -> Peak | None:
    """The published dense peak of the GPU called ``device_name`` (as
    ``torch.cuda.get_device_name`` gives it) at matmul ``precision``; None when the
    model is not in the table or the table has no figure for that precision."""
    name = device_name.upper().strip()
    for gpu in PUBLISHED_PEAKS:
        if re.search(gpu.pattern, name):
            tflops = gpu.tflops.get(precision)
            return None if tflops is None else Peak(tflops * 1e12,
                                                    f"published:{gpu.name}:{precision}")
    return None


def gpu_peak(device_name: str, precision: str, measure: Callable[[], float]) -> Peak:
    """The published peak of ``device_name`` at matmul ``precision``, else what
    ``measure()`` gives, labelled as measured."""
    return (published_peak(device_name, precision)
            or Peak(measure(), f"measured:cuda:{precision}"))


def resolve_peak(configured_tflops: float, device: torch.device, precision: str) -> Peak:
    """This rank's MFU denominator (see the module docstring): ``configured_tflops``
    (``monitor.peak_tflops``) when > 0, a published GPU peak, or a measured one."""
    if configured_tflops > 0:
        return Peak(configured_tflops * 1e12, CONFIGURED)
    if device.type == "cuda":
        key = matmul_precision(precision)
        return gpu_peak(torch.cuda.get_device_name(device), key,
                        lambda: measure_peak_flops(device, MATMUL_DTYPES[key]))
    return Peak(measure_peak_flops(device), MEASURED_CPU)


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32,
                       seconds: float = 0.3) -> float:
    """Achievable matmul FLOP/s of this device in ``dtype`` (4096-square matrices on a
    GPU, 512 on a CPU, which always measures fp32)."""
    n = 4096 if device.type == "cuda" else 512
    dtype = dtype if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    (a @ b).sum().item()  # warm up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        c = a @ b
        count += 1
    c.sum().item()
    return 2 * n ** 3 * count / (time.perf_counter() - start)


def model_flops_utilisation(tokens_per_s: float, flops_per_token: float | None,
                            peak_flops: float, world: int) -> float | None:
    """Model FLOP/s over the ``world`` devices' peak; None when FLOPs or peak are
    unknown. ``tokens_per_s``: tokens the whole job processes per second (every
    position the loss runs over, trained or not)."""
    if not flops_per_token or peak_flops <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * world)

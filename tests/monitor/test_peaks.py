"""The MFU denominator: published GPU peaks by device name, else measured, else configured."""

from __future__ import annotations

import pytest
import torch

from disttrain.monitor import peaks
from disttrain.monitor.peaks import (
    CONFIGURED,
    MEASURED_CPU,
    gpu_peak,
    matmul_precision,
    model_flops_utilisation,
    published_peak,
    resolve_peak,
)

# names as torch.cuda.get_device_name() gives them -> the table entry they must find
KNOWN = {
    "NVIDIA H100 80GB HBM3": "H100-SXM",
    "NVIDIA H100 PCIe": "H100-PCIe",
    "NVIDIA H100 NVL": "H100-NVL",
    "NVIDIA H200": "H200-SXM",
    "NVIDIA H200 NVL": "H200-NVL",
    "NVIDIA A100-SXM4-40GB": "A100-SXM",
    "NVIDIA A100-SXM4-80GB": "A100-SXM",
    "NVIDIA A100-PCIE-40GB": "A100-PCIe",
    "NVIDIA A100 80GB PCIe": "A100-PCIe",
    "NVIDIA L4": "L4",
    "NVIDIA L40S": "L40S",
    "NVIDIA A10": "A10",
    "Tesla V100-SXM2-16GB": "V100-SXM2",
    "Tesla V100-PCIE-32GB": "V100-PCIe",
    "Tesla V100S-PCIE-32GB": "V100S-PCIe",
    "NVIDIA GeForce RTX 4090": "RTX-4090",
    "AMD Instinct MI300X": "MI300X",
    "AMD Instinct MI250X": "MI250X",
}

# names that contain a listed model's name but are other parts, or are not listed
UNKNOWN = [
    "NVIDIA A10G",                       # AWS's part: no vendor datasheet
    "NVIDIA L40",                        # not the L40S, not the L4
    "NVIDIA GeForce RTX 4090 D",         # a slower variant
    "NVIDIA GeForce RTX 4090 Laptop GPU",
    "NVIDIA GeForce RTX 3090",
    "AMD Instinct MI250X / MI250",       # cannot tell the two parts apart
    "NVIDIA A100X",
    "Tesla T4",
    "",
]


@pytest.mark.parametrize("name,entry", sorted(KNOWN.items()))
def test_a_known_gpu_name_finds_its_own_entry(name, entry):
    peak = published_peak(name, "fp16")
    assert peak is not None and peak.source == f"published:{entry}:fp16"
    assert published_peak(name.lower(), "fp16") == peak  # case does not matter


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_gpu_has_no_published_peak(name):
    for precision in ("bf16", "fp16", "tf32", "fp32"):
        assert published_peak(name, precision) is None


def test_published_figures_are_dense_and_per_precision():
    h100 = "NVIDIA H100 80GB HBM3"
    assert published_peak(h100, "bf16").flops == pytest.approx(989.5e12)
    assert published_peak(h100, "tf32").flops == pytest.approx(494.5e12)
    assert published_peak(h100, "fp32").flops == pytest.approx(67e12)
    assert published_peak("NVIDIA A100-SXM4-80GB", "bf16").flops == pytest.approx(312e12)
    assert published_peak("NVIDIA L4", "bf16").flops == pytest.approx(121e12)
    # each MI250X die is a torch device: half the package's figure
    assert published_peak("AMD Instinct MI250X", "bf16").flops == pytest.approx(191.5e12)
    for gpu in peaks.PUBLISHED_PEAKS:
        assert set(gpu.tflops) <= set(peaks.MATMUL_DTYPES), gpu.name
        # tensor-core precisions are never slower than plain fp32
        assert all(v >= gpu.tflops.get("fp32", 0) for v in gpu.tflops.values()), gpu.name


def test_an_unknown_gpu_or_a_missing_precision_falls_back_to_measuring():
    calls = []

    def measure() -> float:
        calls.append(1)
        return 123e12

    peak = gpu_peak("NVIDIA Future GPU 9000", "bf16", measure)
    assert (peak.flops, peak.source) == (123e12, "measured:cuda:bf16")
    # a V100 has no bf16 tensor cores: no published bf16 figure
    assert gpu_peak("Tesla V100-SXM2-16GB", "bf16", measure).source == "measured:cuda:bf16"
    published = gpu_peak("NVIDIA H100 PCIe", "bf16", measure)
    assert published.source == "published:H100-PCIe:bf16" and len(calls) == 2


def test_fp32_is_held_to_the_tf32_peak_when_torch_allows_tf32():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_precision("fp32") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert matmul_precision("fp32") == "tf32"
        assert matmul_precision("bf16") == "bf16" and matmul_precision("fp16") == "fp16"
    finally:
        torch.set_float32_matmul_precision(before)


def test_configured_peak_wins_and_cpu_is_measured_and_says_so():
    cpu = torch.device("cpu")
    configured = resolve_peak(2.5, cpu, "fp32")
    assert (configured.flops, configured.source) == (2.5e12, CONFIGURED)
    measured = resolve_peak(0.0, cpu, "bf16")
    assert measured.source == MEASURED_CPU and measured.flops > 1e6


def test_mfu_is_model_flops_over_the_devices_peak():
    assert model_flops_utilisation(1000.0, 6e9, 1e13, 2) == pytest.approx(0.3)
    assert model_flops_utilisation(1000.0, None, 1e13, 2) is None
    assert model_flops_utilisation(1000.0, 6e9, 0.0, 2) is None

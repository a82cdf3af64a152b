"""``disttrain env``: what a bug report needs to know about this machine, as plain
lines to paste or (``--json``) one JSON object. Nothing here fails: what cannot be
found is reported as such."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from importlib import metadata
from typing import Any

from .. import __version__

EXTRAS = ("transformers", "datasets", "matplotlib", "tensorboard", "scikit-learn",
          "safetensors", "numpy", "tomli")
NOT_INSTALLED = "not installed"
SOCKET_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def add_env_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    env = sub.add_parser(
        "env", help="print versions, backends, devices and network interfaces (for a "
        "bug report)",
        description="Print disttrain's, Python's and torch's versions, torch's CUDA / "
        "cuDNN / NCCL, which process-group backends are built in, the devices, the "
        "network interfaces and the optional packages installed: paste it into a bug "
        "report.")
    env.add_argument("--json", action="store_true", help="print one JSON object")
    return env


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def collect() -> dict[str, Any]:
    """The report: every key is always present (a value may be None or NOT_INSTALLED)."""
    import torch

    return {
        "disttrain": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": _torch(torch),
        "backends": _backends(),
        "devices": _devices(torch),
        "network": _network(),
        "packages": {name: package_version(name) for name in EXTRAS},
    }


def _torch(torch: Any) -> dict[str, Any]:
    cuda = torch.version.cuda
    nccl = None
    if cuda is not None:
        try:
            version = torch.cuda.nccl.version()  # an int in older torch, else a tuple
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - a build without NCCL, or a broken driver
            nccl = None
    return {"version": torch.__version__, "cuda": cuda,
            "cudnn": torch.backends.cudnn.version() if cuda is not None else None,
            "nccl": nccl}


def _backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"gloo": False, "nccl": False, "mpi": False}
    return {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available()}


def _devices(torch: Any) -> dict[str, Any]:
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "memory_bytes": props.total_memory})
    return {"cuda": gpus, "cpu_count": os.cpu_count(), "host_memory_bytes": _host_memory()}


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX, or unknown
        return None


def _network() -> dict[str, Any]:
    try:
        interfaces = [name for _, name in socket.if_nameindex()]
    except OSError:
        interfaces = []
    return {"interfaces": interfaces,
            "env": {k: os.environ[k] for k in SOCKET_ENV if k in os.environ}}


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"


def format_text(report: dict[str, Any]) -> str:
    t, b, d, n = report["torch"], report["backends"], report["devices"], report["network"]
    lines = [f"disttrain: {report['disttrain']}", f"Python: {report['python']}",
             f"platform: {report['platform']}", f"torch: {t['version']}"]
    if t["cuda"] is not None:
        lines.append(f"torch CUDA: {t['cuda']}; cuDNN: {t['cudnn']}; NCCL: {t['nccl']}")
    else:
        lines.append("torch CUDA: not built with CUDA")
    lines.append("backends: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in b.items()))
    for i, gpu in enumerate(d["cuda"]):
        lines.append(f"cuda:{i}: {gpu['name']}, {_gib(gpu['memory_bytes'])}")
    if not d["cuda"]:
        lines.append("CUDA devices: none")
    lines.append(f"CPUs: {d['cpu_count']}; host memory: {_gib(d['host_memory_bytes'])}")
    lines.append("network interfaces: " + (", ".join(n["interfaces"]) or "none found"))
    lines += [f"{k}={v}" for k, v in n["env"].items()]
    lines += [f"{name}: {v}" for name, v in report["packages"].items()]
    return "\n".join(lines)


def run_env(ns: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if ns.json else format_text(report))
    return 0

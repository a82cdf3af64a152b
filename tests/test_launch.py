"""The launcher: its torchrun arguments (the default rendezvous id names the job), and
the allocator settings its workers start with."""

from __future__ import annotations

import os
import platform

import pytest

from disttrain.cli import build_parser
from disttrain.commands.launch_flags import launch_options as _launch_options
from disttrain.launch import agent
from disttrain.launch.agent import torchrun_args
from disttrain.launch.allocator import (
    ALLOCATOR_CHOICE_ENV,
    ALLOCATOR_ENV,
    ALLOCATOR_RETURN,
    allocator_env,
)


def _rdzv_id(*argv: str) -> str:
    ns = build_parser().parse_args(["train", "--nnodes", "2", "--rdzv-endpoint", "h:29400",
                                    *argv])
    args = torchrun_args(_launch_options(ns, f"/shared/{ns.run_dir}"), [])
    return args[args.index("--rdzv-id") + 1]


def test_default_rendezvous_id_is_derived_from_the_run_directory():
    assert _rdzv_id("--run-dir", "a") == _rdzv_id("--run-dir", "a")  # every node agrees
    assert _rdzv_id("--run-dir", "a") != _rdzv_id("--run-dir", "b")  # jobs never meet
    assert _rdzv_id("--run-dir", "a", "--rdzv-id", "mine") == "mine"


# ----------------------------------------------------------- the workers' allocator

# a process that frees 64 one-MiB buffers below a live one, after freeing a 16 MiB one
# (which, by glibc's default, raises its mmap threshold to 16 MiB): the MiB still resident
_RETAINED_MIB = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
MiB = 1 << 20
big = libc.malloc(16 * MiB); ctypes.memset(big, 1, 16 * MiB); libc.free(big)
before = rss()
blocks = [libc.malloc(MiB) for _ in range(65)]
for b in blocks:
    ctypes.memset(b, 1, MiB)
for b in blocks[:-1]:  # the last stays: the heap's top in use, what is below never trimmed
    libc.free(b)
print((rss() - before) / MiB)
"""


def _retained_mib(env: dict[str, str]) -> float:
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _RETAINED_MIB], env=base | env,
                         capture_output=True, text=True, timeout=60, check=True)
    return float(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_the_allocator_settings_return_freed_buffers():
    # glibc's default keeps the 64 MiB resident; the workers' settings unmap each buffer
    # as it is freed (a few pages of slack: the interpreter's own allocations meanwhile)
    assert _retained_mib({}) > 48
    assert _retained_mib(allocator_env({ALLOCATOR_CHOICE_ENV: ALLOCATOR_RETURN})) < 8


def test_the_launcher_sets_the_allocator_when_asked_unless_the_user_did(monkeypatch):
    # every variable _worker_env sets, restored after the test
    for name in (*ALLOCATOR_ENV, ALLOCATOR_CHOICE_ENV, "OMP_NUM_THREADS", "PYTHONUNBUFFERED"):
        monkeypatch.delenv(name, raising=False)
    agent._worker_env(2)  # by default glibc's own (no step-time cost)
    assert not any(k in os.environ for k in ALLOCATOR_ENV)
    monkeypatch.setenv(ALLOCATOR_CHOICE_ENV, ALLOCATOR_RETURN)
    agent._worker_env(2)
    assert {k: os.environ[k] for k in ALLOCATOR_ENV} == ALLOCATOR_ENV
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own value wins
    agent._worker_env(2)
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "65536"

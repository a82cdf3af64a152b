"""Run a function in N spawned Gloo (or NCCL) processes with a hard timeout.

    from disttrain.testing import run_distributed, distributed

    def _body(scale):                    # module-level, so spawn can import it
        t = torch.ones(2) * scale
        dist.all_reduce(t)
        return t

    results = run_distributed(_body, world_size=4, args=(2.0,), timeout=60)

    @distributed(world_size=2)           # the test body itself runs on every rank
    def test_all_reduce():
        ...

Each child initialises a Gloo process group (NCCL with ``backend="nccl"``, rank r on
GPU r) on a free port (rank = its index), runs the function and sends back its return
value or its traceback. If any rank raises, the
others are stopped and the parent raises with that rank's traceback. If the whole run
outlasts ``timeout`` seconds, every child is killed and the parent raises naming the
ranks that had not finished, so a hung collective fails one test instead of CI.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import random
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any


class DistributedTestError(AssertionError):
    """A rank failed or the run timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (for a rendezvous), drawn at
    random below the kernel's ephemeral range: a port the kernel hands out (to another
    process's ``bind(0)``, or a Gloo connection) cannot take it before rank 0 binds it,
    and two test processes asking at once (pytest-xdist workers) draw the same one once
    in ~10,000 draws; where no such port is free, one the kernel picks."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.randrange(max(1024, low - 10_000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


START_METHOD_ENV = "DISTTRAIN_TEST_START_METHOD"
# the attribute of a @distributed wrapper holding the test body a rank runs
_WRAPPED_BODY = "__wrapped_body__"


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (),
                    kwargs: dict | None = None, timeout: float = 120.0,
                    backend: str = "gloo", start_method: str | None = None,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result in
    rank order. ``backend="nccl"`` puts rank r on GPU r (``torch.cuda.set_device``)
    before the process group is created; it needs ``world_size`` GPUs. ``env``:
    environment variables every rank starts with (set before its first import, e.g.
    ``CUDA_VISIBLE_DEVICES``; this process's own environment is left as it was).
    ``start_method="fork"`` starts the ranks in a fraction of a second instead of each
    importing torch again (each rank then runs torch on one thread, so a parent that
    used its intra-op threads is safe; never after touching CUDA, never with NCCL).
    Default: ``$DISTTRAIN_TEST_START_METHOD`` (the test suite sets ``fork``) for Gloo,
    else ``spawn``; and ``spawn`` whenever this process has a process group of its own
    (a forked rank would inherit it) or has initialised CUDA (a forked rank could use
    neither CUDA nor autograd: autograd's device threads do not survive a fork)."""
    if start_method is None:
        start_method = default_start_method(backend)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use 'gloo' or 'nccl'")
    if start_method not in ("spawn", "fork") or (start_method, backend) == ("fork", "nccl"):
        raise ValueError(f"start_method={start_method!r} with backend={backend!r}: use "
                         "'spawn', or 'fork' with gloo")
    ctx = mp.get_context("spawn") if start_method == "spawn" else mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    target = (fn.__module__, fn.__qualname__)
    # not daemonic: a rank may start processes of its own (loader workers,
    # data.workers), as a torchrun rank can; the finally below still ends every rank
    procs = [ctx.Process(target=_child, daemon=False,
                         args=(target, rank, world_size, port, args, kwargs or {}, queue,
                               timeout, backend))
             for rank in range(world_size)]
    with _environment(env or {}):
        _start(procs, forked=start_method == "fork")
    try:
        return _collect(procs, queue, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def default_start_method(backend: str) -> str:
    """``spawn``, or ``$DISTTRAIN_TEST_START_METHOD`` for a Gloo world started from a
    process that holds no process group and has not initialised CUDA."""
    import torch
    import torch.distributed as dist

    if backend != "gloo" or dist.is_initialized() or torch.cuda.is_initialized():
        return "spawn"
    return os.environ.get(START_METHOD_ENV) or "spawn"


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment while the ranks start (a forked or spawned
    rank inherits it from its first instruction), then the environment as it was."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Modules nearly every rank imports on first use, imported once in a parent that forks
# its ranks so that each rank inherits them instead of importing them again: the first
# torch.optim.Optimizer imports torch._dynamo (sympy with it: ~1.5 s of CPU per rank on
# 2 cores), rank 0's TensorBoard writer torch.utils.tensorboard (~0.3 s). Neither
# starts a thread on import, so forking after them stays safe.
_FORK_PRELOAD = ("torch._dynamo", "torch.utils.tensorboard")


def _preload_for_fork() -> None:
    for name in _FORK_PRELOAD:
        with contextlib.suppress(ImportError):  # tensorboard is an optional extra
            importlib.import_module(name)


def _start(procs: list, forked: bool) -> None:
    """Start the ranks. Forked ones inherit the parent's objects: frozen first
    (``gc.freeze``), so a rank's garbage collector never finalises the parent's garbage
    (a thread pool, a logger's client, whose finalisers hang or abort in a forked
    process); the parent unfreezes its own once they are started."""
    if forked:  # (the parent's garbage too: frozen, a rank never finalises it)
        _preload_for_fork()
        gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        if forked:
            gc.unfreeze()


def _collect(procs: list, queue: Any, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    while len(results) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(results))
            raise DistributedTestError(
                f"timed out after {timeout:.0f}s: ranks {missing} of {world_size} had not "
                "finished (a collective issued by some ranks and not others?)")
        try:
            rank, ok, payload = queue.get(timeout=min(remaining, 0.5))
        except queue_module.Empty:
            _check_dead(procs, results)
            continue
        if not ok:
            raise DistributedTestError(f"rank {rank} failed:\n{payload}")
        results[rank] = pickle.loads(payload)
    return [results[r] for r in range(world_size)]


def _check_dead(procs: list, results: dict[int, Any]) -> None:
    for rank, p in enumerate(procs):
        if rank not in results and not p.is_alive() and p.exitcode not in (0, None):
            raise DistributedTestError(f"rank {rank} died with exit code {p.exitcode}")


def _child(target: tuple[str, str], rank: int, world_size: int, port: int, args: tuple,
           kwargs: dict, queue: Any, timeout: float, backend: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    # Shortly before the parent gives up, print where this rank is stuck.
    faulthandler.dump_traceback_later(max(1.0, timeout - 3), exit=False)
    try:
        fn = _resolve(*target)
        if backend == "nccl":  # NCCL binds each rank to the device current at creation
            torch.cuda.set_device(rank)
        # The group's own timeout is longer than the parent's, so a hang is reported
        # by the parent, naming every rank that had not finished.
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout + 30))
        # Plain pickle: tensors travel by value, not as shared-memory handles that
        # would die with this process.
        queue.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    # A @distributed test is stored wrapped; the child runs the original body.
    return getattr(obj, _WRAPPED_BODY, obj)


def distributed(world_size: int, timeout: float = 120.0) -> Callable:
    """Decorator: the test body runs on ``world_size`` Gloo ranks (pytest parameters
    are passed through); the test fails if any rank fails or the run times out."""
    def decorate(body: Callable) -> Callable:
        @functools.wraps(body)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run_distributed(wrapper, world_size, args=args, kwargs=kwargs, timeout=timeout)
        setattr(wrapper, _WRAPPED_BODY, body)
        return wrapper
    return decorate

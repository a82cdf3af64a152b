"""Asynchronous parameter-server training on point-to-point messages.

Ranks ``0 .. S-1`` are servers, each owning a shard of whole parameters
(:func:`assign_shards`) and its optimizer state; the other ``W`` ranks are workers that
push gradients and pull parameters with no barrier between them. A push more than
``staleness_bound`` versions old is dropped, not applied. Control headers travel on a
CPU Gloo group (a server receives from any worker, which NCCL cannot), tensors on the
data group in posting order. The protocol, step by step: ``docs/strategies/sync-modes.md``.
"""

from __future__ import annotations

import inspect
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...comm.collectives import Communicator
from ...data.sampler import GlobalOrderSampler
from ...errors import nonfinite_what
from ...faults import maybe_slow_down
from ...monitor.record import MetricsRecord
from ...names import NONFINITE_STOP, SYNC_ASYNC
from ..interfaces import OwnLoopInputs, OwnLoopResult
from .modes import EveryStep
from .vectors import flatten, unflatten_into

HEADER = 5
PUSH, BYE, PARAMS, STOP = 1.0, 2.0, 3.0, 4.0

# (micro-batches of dataset indices) -> (summed loss, loss terms, gradient norm before
# clipping, positions the loss ran over); leaves the normalised, clipped gradient in
# each parameter's .grad
ComputeGradients = Callable[[list[list[int]]], tuple[float, int, float, int]]


def assign_shards(sizes: list[int], servers: int) -> list[list[int]]:
    """Parameter indices per server: largest parameter first, each to the server with
    the fewest elements so far; every list in model order."""
    load = [0] * servers
    shards: list[list[int]] = [[] for _ in range(servers)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        shards[s].append(i)
        load[s] += sizes[i]
    return [sorted(shard) for shard in shards]


@dataclass
class AsyncReport:
    """One rank's account of the loop (servers and workers fill different fields)."""

    role: str
    rank: int
    pushes: int = 0          # worker: gradients sent; server: pushes received
    applied: int = 0
    dropped: int = 0
    staleness_sum: int = 0   # over applied pushes
    staleness_max: int = 0
    terms: int = 0
    positions: int = 0
    samples: int = 0
    recent_losses: list[float] = field(default_factory=list)
    loop_s: float = 0.0
    ledger_bytes: int = 0
    wire_sent: int = 0
    nonfinite: int = 0       # server: non-finite pushes (skipped, or the one that stopped)
    diverged_step: int = 0   # server, on_nonfinite=stop: the step that went non-finite
    diverged_what: str = ""  # "loss", "gradients" or "loss and gradients"


@dataclass
class _ServerWindow:
    """Pushes between two metrics records at server 0."""

    loss_sum: float = 0.0
    terms: float = 0.0
    staleness: list[int] = field(default_factory=list)


class AsyncParameterServer(EveryStep):
    """Parameter servers and workers over ``comm`` (the world). :meth:`run_loop`
    replaces the trainer's step loop (:class:`~..interfaces.RunsOwnLoop`)."""

    name = SYNC_ASYNC

    def __init__(self, model: nn.Module, comm: Communicator, *, servers: int,
                 staleness_bound: int, accumulate: int = 0,
                 control: Communicator | None = None,
                 on_nonfinite: str = NONFINITE_STOP) -> None:
        if comm.size <= servers:
            raise ValueError(f"async training needs more than {servers} rank(s)")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm, self.servers, self.bound = comm, servers, staleness_bound
        self.stops_on_nonfinite = on_nonfinite == NONFINITE_STOP
        # every rank of the job builds this at the same point, so the group is created
        # collectively
        self.control = control or Communicator(
            dist.new_group(dist.get_process_group_ranks(comm.group), backend="gloo"),
            comm.ledger, f"{comm.name}-control", control=True)
        self.workers = comm.size - servers
        self.accumulate = accumulate or self.workers
        self.shards = [[self.params[i] for i in shard] for shard in
                       assign_shards([p.numel() for p in self.params], servers)]
        self.sizes = [sum(p.numel() for p in shard) for shard in self.shards]
        self.is_server = comm.rank < servers
        self.summary: dict[str, Any] = {}

    # ----------------------------------------------------------------- the loop
    def run_loop(self, inputs: OwnLoopInputs) -> OwnLoopResult:
        """:meth:`run` for the training loop: the run's figures as it reports them."""
        s = self.run(optimizer=inputs.optimizer, steps=inputs.steps, sampler=inputs.sampler,
                     per_worker=inputs.per_worker, micro_batch=inputs.micro_batch,
                     compute=inputs.compute, lr_at=inputs.lr_at, log=inputs.log,
                     log_every=inputs.log_every)
        return OwnLoopResult(samples=s["samples"], terms=s["terms"],
                             positions=s["positions"], loop_s=s["loop_s"],
                             train_loss=s["train_loss"],
                             nonfinite_skipped=s["nonfinite_skipped"],
                             diverged=tuple(s["diverged"]) if s["diverged"] else None)

    def run(self, *, optimizer: torch.optim.Optimizer, steps: int,
            sampler: GlobalOrderSampler, per_worker: int, micro_batch: int,
            compute: ComputeGradients, lr_at: Callable[[int], float],
            log: Callable[[MetricsRecord], None], log_every: int) -> dict[str, Any]:
        """Train for ``steps x W`` pushes per server; every rank returns the same
        summary (see :meth:`metrics`) and holds the final parameters."""
        ledger = self.comm.ledger
        start, bytes0, wire0 = time.perf_counter(), ledger.payload_bytes, ledger.wire_sent_bytes
        if self.is_server:
            report = self._serve(optimizer, steps * self.workers, lr_at, log, log_every,
                                 per_worker)
        else:
            report = self._work(sampler, per_worker, micro_batch, compute)
        report.loop_s = time.perf_counter() - start
        report.ledger_bytes = ledger.payload_bytes - bytes0
        report.wire_sent = ledger.wire_sent_bytes - wire0
        self._assemble()
        reports = self.comm.all_gather_object(asdict(report))
        self.summary = summarise([AsyncReport(**r) for r in reports], self.workers,
                                 self.bound)
        self.summary["ps_accumulate"] = self.accumulate
        return self.summary

    def metrics(self) -> dict[str, Any]:
        return self.summary

    def _assemble(self) -> None:
        """Every rank takes each server's shard (a broadcast from its server)."""
        for s, shard in enumerate(self.shards):
            flat = flatten(shard)
            self.comm.broadcast(flat, src=s)
            unflatten_into(flat, shard)

    # ----------------------------------------------------------------- server
    def _serve(self, optimizer: torch.optim.Optimizer, budget: int,
               lr_at: Callable[[int], float], log: Callable[[MetricsRecord], None],
               log_every: int, per_worker: int) -> AsyncReport:
        """Server ``s``: take each push (header ``[PUSH, version, loss_sum, terms,
        norm]``, then its gradient shard [shard numel]) from whichever worker sent it;
        accumulate it if at most ``bound`` versions stale, step on the mean of every
        ``accumulate`` accepted; reply ``PARAMS`` (with the shard) or ``STOP``."""
        s, data = self.comm.rank, self.comm
        shard = self.shards[s]
        opt = shard_optimizer(optimizer, shard)
        inbox = torch.empty(HEADER)  # control messages: CPU
        grad = data.empty(self.sizes[s])
        replies = {w: (torch.empty(HEADER), data.empty(self.sizes[s]))
                   for w in range(self.servers, data.size)}
        sending: dict[int, list[Any]] = {}
        report, window = AsyncReport(role="server", rank=s), _ServerWindow()
        finished: set[int] = set()
        version = 0
        acc, waiting = data.zeros(self.sizes[s]), 0  # accepted pushes not yet applied
        while len(finished) < self.workers:
            src = self.control.recv_any(inbox)
            if inbox[0].item() == BYE:
                finished.add(src)
                continue
            data.irecv(grad, src).wait()  # every push carries its gradient
            if report.pushes >= budget or report.diverged_step:
                self._reply(src, replies, sending, STOP, version, 0, 0, shard)
                finished.add(src)
                continue
            base, loss_sum, terms, norm = inbox[1:HEADER].tolist()
            staleness = version - int(base)
            lr = lr_at(report.pushes // self.workers)
            report.pushes += 1
            bad = nonfinite_what(not math.isfinite(loss_sum), not math.isfinite(norm),
                                 loss_scaled=False)
            if bad is not None:
                report.nonfinite += 1
                if self.stops_on_nonfinite:
                    report.diverged_step = (report.pushes - 1) // self.workers + 1
                    report.diverged_what = bad
                    self._reply(src, replies, sending, STOP, version, 0, 0, shard)
                    finished.add(src)
                    continue
                self._reply(src, replies, sending, PARAMS, version, 0, staleness, shard)
                continue
            if staleness <= self.bound:
                acc.add_(grad)
                waiting += 1
                if waiting == self.accumulate:
                    _apply(opt, shard, acc.div_(waiting), lr)
                    acc.zero_()
                    version, waiting = version + 1, 0
                report.applied += 1
                report.staleness_sum += staleness
                report.staleness_max = max(report.staleness_max, staleness)
                window.staleness.append(staleness)
            else:
                report.dropped += 1
            self._reply(src, replies, sending, PARAMS, version, staleness <= self.bound,
                        staleness, shard)
            window.loss_sum, window.terms = window.loss_sum + loss_sum, window.terms + terms
            if s == 0 and report.pushes % (log_every * self.workers) == 0:
                log(_record(report, window, lr, self.workers, per_worker))
                window = _ServerWindow()
        if waiting:  # the budget ended with a partial accumulation
            _apply(opt, shard, acc.div_(waiting), lr_at(max(report.pushes - 1, 0)
                                                         // self.workers))
        for works in sending.values():
            for work in works:
                work.wait()
        return report

    def _reply(self, dst: int, replies: dict[int, tuple[torch.Tensor, torch.Tensor]],
               sending: dict[int, list[Any]], kind: float, version: int,
               applied: bool | int, staleness: int, shard: list[nn.Parameter]) -> None:
        """Send worker ``dst`` the control message ``[kind, version, applied,
        staleness]`` and, with PARAMS, the shard's parameters; its previous reply has
        arrived (it pushed again), so the buffers are free."""
        for work in sending.pop(dst, []):
            work.wait()
        header, params = replies[dst]
        header.copy_(torch.tensor([kind, version, float(applied), staleness, 0.0]))
        works = [self.control.isend(header, dst)]
        if kind == PARAMS:
            params.copy_(flatten(shard))
            works.append(self.comm.isend(params, dst))
        sending[dst] = works

    # ----------------------------------------------------------------- worker
    def _work(self, sampler: GlobalOrderSampler, per_worker: int, micro_batch: int,
              compute: ComputeGradients) -> AsyncReport:
        """Worker ``w``: its ``k``-th batch is global-order positions ``[(k W + w) b,
        (k W + w + 1) b)``; push its gradient to every server, load each server's reply,
        and on any ``STOP`` say ``BYE`` to the others and leave."""
        data = self.comm
        w, rank = data.rank - self.servers, data.rank
        report = AsyncReport(role="worker", rank=rank)
        versions = [0] * self.servers
        headers = [torch.empty(HEADER) for _ in self.sizes]  # control messages: CPU
        pushes = [data.empty(n) for n in self.sizes]
        answers = [torch.empty(HEADER) for _ in self.sizes]
        params = [data.empty(n) for n in self.sizes]
        recent: deque[float] = deque(maxlen=10)
        while True:
            first = (report.pushes * self.workers + w) * per_worker
            indices = sampler.indices(first, per_worker)
            t0 = time.perf_counter()
            loss_sum, terms, norm, positions = compute(
                [indices[i:i + micro_batch] for i in range(0, per_worker, micro_batch)])
            maybe_slow_down(rank, time.perf_counter() - t0)
            works = []
            for s, shard in enumerate(self.shards):
                headers[s].copy_(torch.tensor([PUSH, versions[s], loss_sum, terms, norm]))
                pushes[s].copy_(flatten([_grad(p) for p in shard]))
                works += [self.control.isend(headers[s], s), data.isend(pushes[s], s)]
            stopped = []
            for s in range(self.servers):
                self.control.irecv(answers[s], s).wait()
                if answers[s][0].item() == STOP:
                    stopped.append(s)
                    continue
                data.irecv(params[s], s).wait()
                versions[s] = int(answers[s][1].item())
                unflatten_into(params[s], self.shards[s])
            for work in works:
                work.wait()
            report.pushes += 1
            report.samples += per_worker
            report.terms += terms
            report.positions += positions
            recent.append(loss_sum / max(terms, 1))
            if stopped:
                self._say_bye(headers, stopped)
                break
        report.recent_losses = list(recent)
        return report

    def _say_bye(self, headers: list[torch.Tensor], stopped: list[int]) -> None:
        for s in range(self.servers):
            if s not in stopped:
                headers[s][0] = BYE
                self.control.isend(headers[s], s).wait()


def shard_optimizer(optimizer: torch.optim.Optimizer,
                    shard: list[nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and settings over ``shard`` only (each
    parameter keeps its group's settings, e.g. no weight decay on biases)."""
    ids = {id(p) for p in shard}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [p for p in g["params"] if id(p) in ids]}
              for g in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)([g for g in groups if g["params"]], **defaults)


def _apply(opt: torch.optim.Optimizer, shard: list[nn.Parameter], grads: torch.Tensor,
           lr: float) -> None:
    """One optimizer step on ``shard`` with the flat gradient ``grads`` [numel]."""
    offset = 0
    for p in shard:
        p.grad = grads[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    for p in shard:
        p.grad = None


def _grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _record(report: AsyncReport, window: _ServerWindow, lr: float, workers: int,
            per_worker: int) -> MetricsRecord:
    """A metrics record written by server 0."""
    st = window.staleness
    return MetricsRecord(step=report.pushes // workers, lr=lr,
                         loss=window.loss_sum / max(window.terms, 1.0),
                         samples_seen=report.pushes * per_worker,
                         updates=report.applied, dropped=report.dropped,
                         staleness_mean=sum(st) / len(st) if st else 0.0,
                         staleness_max=max(st) if st else 0)


def summarise(reports: list[AsyncReport], workers: int, bound: int) -> dict[str, Any]:
    """The run's async figures from every rank's report."""
    servers = [r for r in reports if r.role == "server"]
    workers_ = [r for r in reports if r.role == "worker"]
    applied = sum(r.applied for r in servers)
    losses = [x for r in workers_ for x in r.recent_losses]
    steps = max(r.pushes for r in servers) / workers
    diverged = [r for r in servers if r.diverged_step]
    first = min(diverged, key=lambda r: r.diverged_step) if diverged else None
    return {
        "sync": SYNC_ASYNC, "ps_servers": len(servers), "workers": workers,
        "staleness_bound": bound,
        "staleness_mean": sum(r.staleness_sum for r in servers) / max(applied, 1),
        "staleness_max": max(r.staleness_max for r in servers),
        "updates": applied, "dropped": sum(r.dropped for r in servers),
        "worker_steps": [r.pushes for r in workers_],
        "samples": sum(r.samples for r in workers_),
        "terms": sum(r.terms for r in workers_),
        "positions": sum(r.positions for r in workers_),
        "loop_s": max(r.loop_s for r in reports),
        "train_loss": sum(losses) / len(losses) if losses else float("nan"),
        "equivalent_steps": steps,
        # every server sees the same loss and norm: the largest count is the push count
        "nonfinite_skipped": 0 if first else max(r.nonfinite for r in servers),
        "diverged": [first.diverged_step, first.diverged_what] if first else None,
        # each message is in the sender's and the receiver's ledger
        "comm_bytes_per_step": sum(r.ledger_bytes for r in reports) / 2
        / len(reports) / max(steps, 1e-9),
        "comm_wire_bytes_per_step": sum(r.wire_sent for r in reports) / len(reports)
        / max(steps, 1e-9),
    }

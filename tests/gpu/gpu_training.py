"""What the GPU set runs: a case trained through the Trainer on NCCL ranks (rank r on GPU
r), or with ``shared`` on one GPU in the shared-GPU test mode (every rank on the first
visible GPU, collectives through Gloo, staged through pinned host memory where Gloo takes
no CUDA tensors: disttrain/comm/staging.py), and its oracle, a plain single-process
PyTorch loop on the same device.

The oracle trains the same tiny GPT (4 blocks) from the same seed on the same global
batches (masked targets, so samples carry different numbers of loss terms): the global
batch cut into as many consecutive parts as the case has micro-batches in all (dp x
grad_accum), each part's forward under ``torch.autocast`` at the case's precision and
its backward on the summed token loss (times the loss scale: torch's ``GradScaler`` for
fp16), gradients summed over the parts and divided by the batch's token count, clipping,
AdamW. It is written without disttrain's step, precision or strategy code. Cutting the
batch as the case does keeps fp16's overflows (a part's activation gradients overflow or
not by its own size) and bf16's matmul shapes the same; what is left to differ is
summation order, and in tensor or pipeline parallelism the shapes of the sharded
matmuls.

``DISTTRAIN_GPU_SET_ON_CPU=1`` runs the set on the CPU with Gloo instead (fp16 cases
skipped: fp16 is GPU-only): a dry run of the tests' own logic for a machine without a
GPU. It says nothing about CUDA or NCCL. A shared case's dry run stages its CPU tensors
through host buffers (``DISTTRAIN_HOST_STAGING=1``), the staging path without the GPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support import SyntheticTokens

from disttrain.comm.staging import HOST_STAGING_ENV
from disttrain.config import load_config
from disttrain.data import GlobalOrderSampler, collate_token_batch
from disttrain.models import GPT, token_loss
from disttrain.names import SHARED_GPU_ENV
from disttrain.run_checks import resolve
from disttrain.testing import run_distributed
from disttrain.train.optim import build_optimizer, lr_at, set_lr

ON_CPU = os.environ.get("DISTTRAIN_GPU_SET_ON_CPU") == "1"
BACKEND = "gloo" if ON_CPU else "nccl"
DEVICE_TYPE = "cpu" if ON_CPU else "cuda"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

STEPS = 10
MODEL = {"vocab_size": 64, "seq_len": 16, "n_layer": 4, "n_head": 4, "d_model": 32}
# (elementwise atol, bound on each tensor's mean absolute difference) by precision.
# fp32: the same sums in other orders (micro-batches, shards, GPU kernels) drift by
# ~1e-7 per step (1.2e-7 after 10 steps on the CPU dry run), far below 1e-4, while a
# wrong gradient (a lost micro-batch, a shard reduced twice) moves weights by 1e-3 or
# more. bf16 / fp16: a sharded matmul (tensor parallelism) rounds differently, and AdamW
# turns the rounding noise of a near-zero gradient (a rare token's embedding row) into
# full-size steps, so single elements drift by up to ~1e-2 while each tensor's mean
# difference stays ~2e-4 (CPU dry run: tp=2 bf16 8.7e-3 and 1.9e-4; data parallel bf16
# 2.7e-4 and 1.8e-5); dropping one sample of eight per step moves every tensor's mean by
# 3e-3 or more. Hence the mean bound for them.
TOLERANCE: dict[str, tuple[float, float | None]] = {
    "fp32": (1e-4, None), "bf16": (2e-2, 1e-3), "fp16": (2e-2, 1e-3)}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


# the marks of every test in the set: `pytest -m gpu` selects it; without CUDA it skips
GPU_SET = [pytest.mark.gpu,
           pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()), reason="needs CUDA")]


@dataclass(frozen=True)
class Case:
    """One Trainer run: the layout (dp, pp, tp), ZeRO stage, precision, micro-batches
    per step, any further [train] / [parallel] / [comm] settings, and whether its ranks
    share one GPU (``shared``: the shared-GPU test mode) instead of one GPU each."""

    name: str
    layout: tuple[int, int, int] = (1, 1, 1)
    zero: int = 0
    precision: str = "fp32"
    grad_accum: int = 1
    train: dict[str, Any] = field(default_factory=dict)
    parallel: dict[str, Any] = field(default_factory=dict)
    comm: dict[str, Any] = field(default_factory=dict)
    shared: bool = False

    @property
    def world(self) -> int:
        dp, pp, tp = self.layout
        return dp * pp * tp

    @property
    def parts(self) -> int:
        """Micro-batches per step over all dp ranks: how the oracle cuts the batch."""
        return self.layout[0] * self.grad_accum

    def param(self) -> Any:
        """The pytest parameter, skipped where this machine lacks ``world`` GPUs (one
        for a shared case: GPU_SET's mark), and for fp16 on the CPU dry run (fp16 with
        loss scaling is GPU-only)."""
        marks = []
        if not ON_CPU and not self.shared and GPUS < self.world:
            marks.append(pytest.mark.skip(reason=f"needs {self.world} CUDA devices, "
                                                 f"found {GPUS}"))
        if ON_CPU and self.precision == "fp16":
            marks.append(pytest.mark.skip(reason="fp16 with loss scaling is GPU-only"))
        return pytest.param(self, id=self.name, marks=marks)


def case_config(case: Case) -> Any:
    dp, pp, tp = case.layout
    train = {"steps": STEPS, "global_batch": 8, "grad_accum": case.grad_accum, "lr": 3e-3,
             "warmup_steps": 2, "schedule": "constant", "eval_samples": 8, "log_every": 5,
             "precision": case.precision, **case.train}
    parallel = {"dp": dp, "pp": pp, "tp": tp, "zero": case.zero, **case.parallel}
    return load_config(values={"model": MODEL, "train": train, "parallel": parallel,
                               "comm": case.comm, "checkpoint": {"every": 0}})


def _train_on_rank(case: Case, run_dir: str) -> dict[str, Any]:
    """The body each rank runs: the case through the Trainer (device and backend left
    to it: train.device = auto); what the runtime picked, and the summary."""
    from disttrain import Trainer

    cfg = case_config(case)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(GPT(cfg.model), SyntheticTokens(mask=True), token_loss, cfg,
                      run_dir=run_dir, collate_fn=collate_token_batch, progress=False)
    summary = trainer.fit()
    return {"device": trainer.runtime.device.type, "backend": trainer.runtime.backend,
            "params_device": {p.device.type for p in trainer.model.parameters()},
            "staged": trainer.world.staged, "summary": summary}


@dataclass
class Trained:
    """A finished case: rank 0's report, the full final weights (CPU tensors, from the
    run's model.safetensors), and its metrics records."""

    rank0: dict[str, Any]
    weights: dict[str, torch.Tensor]
    records: list[dict[str, Any]]


def train_without_syncs(case: Case, run_dir: str) -> dict[str, Any]:
    """:func:`_train_on_rank`, with every step after the first under
    ``torch.cuda.set_sync_debug_mode("error")``: a host read of a device value inside a
    steady-state step raises (the first step may read: the tensor-parallel proof). The
    suite's NCCL message-order header, which each receiver reads back, is off: a real
    NCCL run has none."""
    from disttrain.train import step

    os.environ["DISTTRAIN_NCCL_RULES"] = "0"
    inner = step.train_step

    def strict(run: Any, index: int) -> Any:
        if index == 0 or run.device.type != "cuda":
            return inner(run, index)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return inner(run, index)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    step.train_step = strict
    try:
        return _train_on_rank(case, run_dir)
    finally:
        step.train_step = inner


def shared_env() -> dict[str, str]:
    """What a shared case's ranks start with: the shared-GPU test mode on the first
    visible GPU alone (the mode is refused where each rank could have a GPU of its own),
    or on the dry run the host-staging switch."""
    if ON_CPU:
        return {HOST_STAGING_ENV: "1"}
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return {SHARED_GPU_ENV: "1", "CUDA_VISIBLE_DEVICES": first}


def train_case(case: Case, run_dir: Path, backend: str = BACKEND,
               timeout: float = 300, body: Any = _train_on_rank) -> Trained:
    """Run ``case`` on ``case.world`` spawned ranks: NCCL (Gloo on the dry run), or
    ``backend="gloo"``, under which train.device = auto keeps the run on the CPU. A
    shared case's ranks start with :func:`shared_env` on Gloo (spawned on a GPU: a
    forked rank could not use CUDA once this process has asked the driver anything).
    ``body``: what each rank runs (:func:`_train_on_rank`, or
    :func:`train_without_syncs`)."""
    env, start = None, None
    if case.shared:
        backend, env, start = "gloo", shared_env(), None if ON_CPU else "spawn"
    ranks = run_distributed(body, case.world, args=(case, str(run_dir)),
                            timeout=timeout, backend=backend, env=env, start_method=start)
    records = [json.loads(line) for line in
               (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Trained(ranks[0], load_file(str(run_dir / "model.safetensors")), records)


def plain_loop(precision: str, parts: int, device: torch.device
               ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The oracle (see the module docstring), the global batch in ``parts`` pieces:
    final weights (on the CPU) and, for fp16, the loss scale at the end and the number
    of steps skipped on overflow."""
    cfg = case_config(Case("oracle", precision=precision))
    global_batch = resolve(cfg, 1).batch.global_batch
    data = SyntheticTokens(mask=True)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    opt = build_optimizer(model, cfg.train, cfg.train.lr)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 16, growth_interval=2000,
                                  enabled=precision == "fp16")
    sampler = GlobalOrderSampler(len(data), cfg.train.seed)
    skipped = 0
    for step in range(STEPS):
        set_lr(opt, lr_at(step, cfg.train, cfg.train.lr))
        indices = sampler.indices(step * global_batch, global_batch)
        size = global_batch // parts
        opt.zero_grad()
        count = 0
        for start in range(0, global_batch, size):
            b = collate_token_batch([data[i] for i in indices[start:start + size]])
            with torch.autocast(device.type, dtype=AUTOCAST.get(precision),
                                enabled=precision in AUTOCAST):
                loss_sum, n = token_loss(model(b["input_ids"].to(device)),
                                         b["targets"].to(device))
            scaler.scale(loss_sum).backward()
            count += n
        scaler.unscale_(opt)
        for p in model.parameters():
            p.grad.div_(count)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale
    return _stored_once(model), {"loss_scale": scaler.get_scale(), "skipped_steps": skipped}


def _stored_once(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors on the CPU, a tied one under its first name only (as the
    run's model.safetensors holds them)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t.detach().cpu().clone()
    return out


def assert_weights_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         precision: str, what: str) -> None:
    """Every tensor within the precision's :data:`TOLERANCE` of ``expected``'s."""
    atol, mean_bound = TOLERANCE[precision]
    assert actual.keys() == expected.keys(), what
    for name in expected:
        a, e = actual[name].float(), expected[name].float()
        torch.testing.assert_close(a, e, atol=atol, rtol=0,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")
        if mean_bound is not None:
            mean = (a - e).abs().mean().item()
            assert mean <= mean_bound, f"{what}: {name}: mean |difference| {mean:.2e}"


def assert_ran_on_the_device(got: Trained, shared: bool = False) -> None:
    """The run used the GPU through NCCL (the dry run: the CPU through Gloo), or a
    ``shared`` one through Gloo with its collectives staged, and named the source of its
    MFU peak."""
    r = got.rank0
    backend = "gloo" if shared else BACKEND
    assert (r["device"], r["backend"], r["params_device"]) == (
        DEVICE_TYPE, backend, {DEVICE_TYPE}), r
    assert r["staged"] == shared, r
    source = r["summary"]["peak_source"]
    assert (source == "measured:cpu" if ON_CPU
            else source.startswith(("published:", "measured:cuda:"))), source


def assert_follows_plain_loop(case: Case, got: Trained,
                              oracle: tuple[dict[str, torch.Tensor], dict[str, float]]
                              ) -> None:
    """``got`` ran on the device, ended on the plain loop's weights and, under fp16,
    skipped the loop's steps and ended at its loss scale."""
    assert_ran_on_the_device(got, case.shared)
    weights, scaling = oracle
    assert_weights_close(got.weights, weights, case.precision, case.name)
    if case.precision == "fp16":
        last = got.records[-1]
        assert last["skipped_steps"] == scaling["skipped_steps"], (last, scaling)
        assert last["loss_scale"] == scaling["loss_scale"], (last, scaling)

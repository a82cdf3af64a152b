"""Checks that span several fields, run before any process group exists.

:func:`resolve` turns a :class:`Config` plus the world size into a :class:`RunPlan`:
the layout and the batch triple with its third member derived. Everything a worker
needs to agree on with the others is decided here, deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..topology import Layout, resolve_layout
from .schema import Config, TrainConfig

BATCH_KEYS = ("global_batch", "micro_batch", "grad_accum")
# When the user gives fewer than two of the triple, defaults fill in this order.
_DEFAULT_PRIORITY = ("global_batch", "grad_accum", "micro_batch")


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """global_batch = micro_batch x grad_accum x dp, all three known and consistent."""

    global_batch: int
    micro_batch: int
    grad_accum: int
    dp: int
    given: tuple[str, ...] = ()  # the two members the third was derived from


    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.grad_accum


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    layout: Layout
    batch: BatchPlan
    lr: float


def resolve(config: Config, world_size: int) -> RunPlan:
    """Validate the whole config for a job of ``world_size`` ranks."""
    _check_model(config)
    _check_data(config)
    _check_device(config)
    _check_monitor(config)
    _check_zero(config)
    _check_codec(config)
    p = config.parallel
    layout = resolve_layout(dp=p.dp, pp=p.pp, tp=p.tp, zero=p.zero, world_size=world_size)
    _check_sync(config, layout)
    batch = resolve_batch(config.train, config.explicit, data_parallel_degree(config, layout))
    _check_model_parallel(config, layout, batch)
    return RunPlan(layout=layout, batch=batch, lr=scaled_lr(config.train, batch))


def resolve_batch(train: TrainConfig, explicit: frozenset[str], dp: int) -> BatchPlan:
    """Keep the triple members the user set; fill from defaults until two are known;
    derive the third and check divisibility."""
    given = {k: getattr(train, k) for k in BATCH_KEYS
             if f"train.{k}" in explicit and getattr(train, k) is not None}
    for key in _DEFAULT_PRIORITY:
        if len(given) >= 2:
            break
        if key not in given and getattr(train, key) is not None:
            given[key] = getattr(train, key)
    if len(given) < 2:
        raise ConfigError("train.global_batch", train.global_batch,
                          "two of global_batch, micro_batch, grad_accum are needed",
                          "set two of them")
    g, m, a = (given.get(k) for k in BATCH_KEYS)
    if g is None:
        g = m * a * dp
    elif m is None:
        m = _divide("train.global_batch", g, a * dp, f"grad_accum x dp = {a}x{dp}")
    elif a is None:
        a = _divide("train.global_batch", g, m * dp, f"micro_batch x dp = {m}x{dp}")
    if g != m * a * dp:
        raise ConfigError("train.global_batch", g,
                          f"must equal micro_batch x grad_accum x dp = {m}x{a}x{dp} = "
                          f"{m * a * dp}", "give only two of the three and let disttrain "
                          "derive the third")
    return BatchPlan(global_batch=g, micro_batch=m, grad_accum=a, dp=dp,
                     given=tuple(k for k in BATCH_KEYS if k in given))


def _divide(field: str, total: int, by: int, what: str) -> int:
    if total % by:
        lo, hi = total // by * by, (total // by + 1) * by
        raise ConfigError(field, total, f"is not divisible by {what} = {by}",
                          f"use a multiple of {by}, e.g. {lo or hi} or {hi}")
    return total // by


def scaled_lr(train: TrainConfig, batch: BatchPlan) -> float:
    if train.lr_scaling == "linear":
        return train.lr * batch.global_batch / train.base_batch
    return train.lr


def _check_model(config: Config) -> None:
    m = config.model
    if m.d_model % m.n_head:
        raise ConfigError("model.d_model", m.d_model,
                          f"is not divisible by model.n_head={m.n_head}",
                          f"use a multiple of {m.n_head}")


def _check_data(config: Config) -> None:
    d = config.data
    if d.path and not Path(d.path).expanduser().is_dir():
        raise ConfigError("data.path", d.path, "no such directory",
                          "point data.path at a directory of text files, or leave it "
                          "empty for the built-in corpus")


def _check_zero(config: Config) -> None:
    zero = config.parallel.zero
    if zero and config.parallel.balance == "dynamic":
        raise ConfigError("parallel.balance", "dynamic", "is not supported with ZeRO yet",
                          "use parallel.balance=static with parallel.zero")


def data_parallel_degree(config: Config, layout: Layout) -> int:
    """Ranks that each take a share of the global batch: the dp ranks, except under
    ``train.sync=async`` where the parameter servers take none."""
    if config.train.sync == "async":
        return layout.dp - config.train.ps_servers
    return layout.dp


def _check_sync(config: Config, layout: Layout) -> None:
    mode = config.train.sync
    if mode == "every_step":
        return
    p = config.parallel
    for key, value, off in (("zero", p.zero, 0), ("pp", p.pp, 1), ("tp", p.tp, 1)):
        if value != off:
            raise ConfigError(f"parallel.{key}", value,
                              f"is not supported with train.sync={mode} (replicas keep "
                              "whole, unsharded models)",
                              f"set parallel.{key}={off}, or train.sync=every_step")
    if p.balance == "dynamic":
        raise ConfigError("parallel.balance", "dynamic",
                          f"is not supported with train.sync={mode}",
                          "use parallel.balance=static")
    codec = getattr(getattr(config, "comm", None), "codec", "none")
    if codec != "none" and mode not in ("local_sgd", "diloco"):
        raise ConfigError("comm.codec", codec,
                          f"compresses the every_step gradients and the local_sgd / "
                          f"diloco updates; train.sync={mode} sends parameters, "
                          "uncompressed", "set comm.codec=none, or train.sync=every_step, "
                          "local_sgd or diloco")
    if mode == "async":
        _check_async(config, layout)


def _check_async(config: Config, layout: Layout) -> None:
    t = config.train
    if layout.dp <= t.ps_servers:
        raise ConfigError("train.ps_servers", t.ps_servers,
                          f"leaves no worker among {layout.dp} rank(s)",
                          f"use at least {t.ps_servers + 1} ranks, or fewer servers")
    every = config.checkpoint.every
    if every and "checkpoint.every" in config.explicit:
        raise ConfigError("checkpoint.every", every,
                          "async training writes no checkpoints (the servers' optimizer "
                          "state and the workers' progress are not captured)",
                          "set checkpoint.every=0, or use another train.sync mode")


def _check_codec(config: Config) -> None:
    """Gradient codecs and layer-wise optimizers work on whole per-parameter gradients,
    which ZeRO's flat shards are not."""
    codec, p, opt = config.comm.codec, config.parallel, config.train.optimizer
    if codec not in ("none", "fp16", "bf16") and p.zero:
        raise ConfigError("comm.codec", codec, f"is not supported with parallel.zero="
                          f"{p.zero} (ZeRO reduce-scatters flat shards; only the fp16/bf16 "
                          "casts apply to a reduce-scatter)",
                          "use comm.codec=fp16 or bf16 with ZeRO, or parallel.zero=0 for "
                          f"{codec}")
    if codec != "none" and p.grad_reduce_dtype != "fp32":
        raise ConfigError("parallel.grad_reduce_dtype", p.grad_reduce_dtype,
                          f"conflicts with comm.codec={codec} (both set the gradient wire "
                          "format)", "leave parallel.grad_reduce_dtype=fp32 and let the "
                          "codec decide (comm.codec=bf16 halves the bytes)")
    if opt in ("lars", "lamb") and p.zero:
        raise ConfigError("train.optimizer", opt, f"is not supported with parallel.zero="
                          f"{p.zero} (the trust ratio needs each layer's whole weight, ZeRO "
                          "holds flat shards)", "use parallel.zero=0 with lars/lamb, or "
                          "train.optimizer=adamw/sgd with ZeRO")


def _check_monitor(config: Config) -> None:
    hang, timeout = config.monitor.hang_timeout, config.parallel.timeout_s
    if hang and hang >= timeout:
        raise ConfigError("monitor.hang_timeout", hang,
                          f"must be below parallel.timeout_s={timeout:g}, or the "
                          "collective fails before the hang is diagnosed",
                          f"set monitor.hang_timeout below {timeout:g}, or raise "
                          "parallel.timeout_s")


def _check_device(config: Config) -> None:
    import torch

    dev, backend = config.train.device, config.parallel.backend
    has_cuda = torch.cuda.is_available()
    if dev == "cuda" and not has_cuda:
        raise ConfigError("train.device", dev, "no CUDA device is available",
                          "use train.device=cpu or auto")
    on_gpu = dev == "cuda" or (dev == "auto" and has_cuda)
    if config.train.precision == "fp16" and not on_gpu:
        raise ConfigError("train.precision", "fp16", "fp16 with loss scaling needs a GPU",
                          "use train.precision=bf16 on CPU")
    if backend == "nccl" and not on_gpu:
        raise ConfigError("parallel.backend", backend, "NCCL needs CUDA devices",
                          "use parallel.backend=gloo or auto on CPU")


def _check_model_parallel(config: Config, layout: Layout, batch: BatchPlan) -> None:
    """Tensor and pipeline layouts that cannot work are refused here, with the fix,
    before any process group exists (nothing can hang on a bad split)."""
    p, m = config.parallel, config.model
    if layout.tp > 1:
        for field, value in (("model.n_head", m.n_head), ("model.vocab_size", m.vocab_size),
                             ("model.d_model", 4 * m.d_model)):
            if value % layout.tp:
                what = "4 x d_model" if field == "model.d_model" else field
                raise ConfigError(field, value if field != "model.d_model" else m.d_model,
                                  f"{what} = {value} is not divisible by parallel.tp="
                                  f"{layout.tp}", "choose a tp that divides n_head, "
                                  "vocab_size and 4 x d_model")
    if layout.tp > 1 and p.sequence_parallel and layout.zero > 1:
        raise ConfigError("parallel.zero", layout.zero, "stages 2 and 3 reduce gradients "
                          "during backward, before sequence parallelism's partial norm "
                          "gradients are summed over tp", "use parallel.zero=1 (or 0) with "
                          "parallel.sequence_parallel")
    if layout.pp > 1 or layout.tp > 1:
        if p.balance == "dynamic":
            raise ConfigError("parallel.balance", "dynamic", "is not supported with pp or "
                              "tp > 1 (every pipeline needs the same micro-batches)",
                              "use parallel.balance=static")
        if layout.zero and config.checkpoint.every:
            raise ConfigError("checkpoint.every", config.checkpoint.every,
                              "checkpoints of ZeRO shards under pp or tp > 1 are not "
                              "supported yet", "set checkpoint.every=0, or parallel.zero=0")
    if layout.pp > 1:
        _check_pipeline(config, layout, batch)


def _check_pipeline(config: Config, layout: Layout, batch: BatchPlan) -> None:
    from ..parallel.pipeline.schedules import validate_schedule

    p = config.parallel
    if layout.zero > 1:
        raise ConfigError("parallel.zero", layout.zero, "stages 2 and 3 reduce and gather "
                          "per micro-batch, which a pipeline schedule interleaves",
                          "use parallel.zero=1 (or 0) with parallel.pp > 1")
    v = p.pp_virtual if p.pp_schedule == "interleaved" else 1
    try:
        validate_schedule(p.pp_schedule, layout.pp, batch.grad_accum, v,
                          config.model.n_layer)
    except ValueError as exc:
        field, value = "parallel.pp_schedule", p.pp_schedule
        if "micro-batches" in str(exc):
            field, value = "train.grad_accum", batch.grad_accum
        elif "v >=" in str(exc):
            field, value = "parallel.pp_virtual", p.pp_virtual
        problem, _, fix = str(exc).partition("; ")
        raise ConfigError(field, value, problem, f"{fix or 'see the schedule'}; the "
                          "micro-batches per step are train.grad_accum, v is "
                          "parallel.pp_virtual") from None
    pipeline_starts(p.pp_split, layout.pp * v, config.model.n_layer)


def pipeline_starts(split: str, chunks: int, n_layer: int) -> list[int] | None:
    """``parallel.pp_split`` as the first block of each chunk, or None for auto."""
    if split.strip() == "auto":
        return None
    try:
        starts = [int(x) for x in split.split(",")]
    except ValueError:
        raise ConfigError("parallel.pp_split", split, "is neither 'auto' nor a list of "
                          "block indices", "write e.g. '0,2' or 'auto'") from None
    ok = (len(starts) == chunks and starts[0] == 0 and all(a < b for a, b in
          zip(starts, starts[1:])) and starts[-1] < n_layer)
    if not ok:
        even = ",".join(str(i * n_layer // chunks) for i in range(chunks))
        raise ConfigError("parallel.pp_split", split, f"needs {chunks} increasing block "
                          f"indices starting at 0 and below n_layer={n_layer}",
                          f"e.g. '{even}', or 'auto'")
    return starts

"""Checks within the config's own sections, and the batch triple.

The whole-config validation that also asks each strategy (:func:`disttrain.run_checks.resolve`)
builds on these: :func:`check_sections` (model shape, data path, device, monitor, wire
format) and :func:`resolve_batch` (the batch triple with its third member derived).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..dimensions import Role, joined, with_role
from ..errors import ConfigError, ErrorCollector
from ..names import CODEC_NONE, DATA_JSONL, LOGGER_PACKAGES, SHARED_GPU_ENV, SYNC_ASYNC
from .layout import Layout
from .schema import Config, DataConfig, ModelConfig, TrainConfig

BATCH_KEYS = ("global_batch", "micro_batch", "grad_accum")
# When the user gives fewer than two of the triple, defaults fill in this order.
_DEFAULT_PRIORITY = ("global_batch", "grad_accum", "micro_batch")


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """global_batch = micro_batch x grad_accum x shares, all three known and consistent;
    ``shares``: the ranks that each take a share of the global batch (the data-parallel
    ranks: :func:`data_parallel_degree`)."""

    global_batch: int
    micro_batch: int
    grad_accum: int
    shares: int
    given: tuple[str, ...] = ()  # the two members the third was derived from


    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.grad_accum


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    layout: Layout
    batch: BatchPlan
    lr: float


def check_sections(config: Config) -> None:
    """The checks that need no layout: model shape, data path, device, monitor, and the
    gradient wire format. Each is independent of the others: all their errors are
    reported together."""
    errors = ErrorCollector()
    for check in (_check_model, _check_data, _check_device, _check_monitor, _check_wire):
        with errors.check():
            check(config)
    errors.raise_any()


def resolve_batch(train: TrainConfig, explicit: frozenset[str], shares: int) -> BatchPlan:
    """Keep the triple members the user set; fill from defaults until two are known;
    derive the third and check divisibility; ``shares``: the ranks that split the batch
    (named in messages by the dimensions that split it)."""
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
    n, split = shares, joined(with_role(Role.SAMPLES))
    if g is None and m is not None and a is not None:
        g = m * a * n
    elif m is None and g is not None and a is not None:
        m = _divide("train.global_batch", g, a * n, f"grad_accum x {split} = {a}x{n}")
    elif a is None and g is not None and m is not None:
        a = _divide("train.global_batch", g, m * n, f"micro_batch x {split} = {m}x{n}")
    if g is None or m is None or a is None:  # never: two of them are known (above)
        raise ConfigError("train.global_batch", train.global_batch,
                          "two of global_batch, micro_batch, grad_accum are needed",
                          "set two of them")
    if g != m * a * n:
        raise ConfigError("train.global_batch", g,
                          f"must equal micro_batch x grad_accum x {split} = {m}x{a}x{n} = "
                          f"{m * a * n}", "give only two of the three and let disttrain "
                          "derive the third")
    return BatchPlan(global_batch=g, micro_batch=m, grad_accum=a, shares=n,
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
    if m.n_kv_head and m.n_head % m.n_kv_head:
        raise ConfigError("model.n_kv_head", m.n_kv_head,
                          f"does not divide model.n_head={m.n_head}",
                          "use a divisor of n_head, or 0 for n_head")
    hf = m.name != "gpt" or m.hf_config
    if hf and importlib.util.find_spec("transformers") is None:
        field, value = ("model.hf_config", m.hf_config) if m.hf_config else ("model.name",
                                                                            m.name)
        raise ConfigError(field, value, "needs the transformers package",
                          "pip install transformers (from a disttrain checkout: pip install -e "
                          "'.[hf]'), or model.name=gpt")
    if m.pretrained:
        _check_pretrained_beside(config)
    if m.hf_config and not Path(m.hf_config).expanduser().is_file():
        raise ConfigError("model.hf_config", m.hf_config, "no such file",
                          "point it at a transformers config.json")


# what a pretrained directory's config.json decides, so nothing may set it beside it
_PRETRAINED_DECIDES = ("name", "n_layer", "d_model", "n_head", "n_kv_head", "vocab_size")


def _check_pretrained_beside(config: Config) -> None:
    m, defaults = config.model, ModelConfig()
    root = Path(m.pretrained).expanduser()
    if not root.is_dir():
        raise ConfigError("model.pretrained", m.pretrained, "no such directory",
                          "point it at a transformers model directory (config.json and "
                          "model.safetensors)")
    own = str(root / "config.json")
    if m.hf_config and Path(m.hf_config).expanduser() != Path(own):
        raise ConfigError("model.hf_config", m.hf_config, "is set beside model.pretrained, "
                          "whose config.json decides the model", "leave model.hf_config out")
    for key in _PRETRAINED_DECIDES:
        if f"model.{key}" in config.explicit and getattr(m, key) != getattr(defaults, key):
            raise ConfigError(f"model.{key}", getattr(m, key), "is set beside "
                              "model.pretrained, whose config.json decides the model",
                              f"leave model.{key} out")
    if not Path(own).is_file():
        raise ConfigError("model.pretrained", m.pretrained, "has no config.json",
                          "point it at a directory written by save_pretrained")


def _check_data(config: Config) -> None:
    d, defaults = config.data, DataConfig()
    for key in ("truncate", "on_bad_example"):  # a snapshot holds every key: by value
        if d.format != DATA_JSONL and getattr(d, key) != getattr(defaults, key):
            raise ConfigError(f"data.{key}", getattr(d, key), "applies to "
                              "data.format=jsonl only", f"leave data.{key} out, or set "
                              "data.format=jsonl")
    if d.format == DATA_JSONL:
        _check_examples(config)
        return
    if d.path and not Path(d.path).expanduser().is_dir():
        raise ConfigError("data.path", d.path, "no such directory",
                          "point data.path at a directory of text files, or leave it "
                          "empty for the built-in corpus")
    if d.format == "tokens" and d.tokenizer != TOKENIZER_BYTES:
        raise ConfigError("data.tokenizer", d.tokenizer, "applies to text; "
                          "data.format=tokens reads ids already tokenized",
                          "leave data.tokenizer=bytes, or set data.format=text")
    check_tokenizer(d.tokenizer)


def _check_examples(config: Config) -> None:
    """``data.format = jsonl``: a path to read and a transformers tokenizer directory
    (``data.tokenizer``, or ``model.pretrained``'s own)."""
    d = config.data
    if not d.path or not Path(d.path).expanduser().exists():
        raise ConfigError("data.path", d.path, "no such file or directory",
                          "point data.path at a .jsonl file, a directory of them, or a "
                          "datasets dataset saved with save_to_disk")
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("data.format", d.format, "needs the transformers package",
                          "pip install -e '.[hf]' from a checkout")
    if d.tokenizer == TOKENIZER_BYTES and not config.model.pretrained:
        raise ConfigError("data.tokenizer", d.tokenizer, "data.format=jsonl needs a "
                          "transformers tokenizer", "set model.pretrained to a model "
                          "directory holding its tokenizer, or data.tokenizer to a "
                          "tokenizer directory")
    if d.tokenizer != TOKENIZER_BYTES and not Path(d.tokenizer).expanduser().is_dir():
        raise ConfigError("data.tokenizer", d.tokenizer, "is not a directory",
                          "give a transformers tokenizer directory (tokenizer.json and "
                          "tokenizer_config.json, as save_pretrained writes them), or "
                          "leave data.tokenizer out for model.pretrained's own")


def data_parallel_degree(config: Config, layout: Layout) -> int:
    """Ranks that each take a share of the global batch: those its sample-splitting
    dimensions span, except under ``train.sync=async`` where the parameter servers take
    none."""
    ranks = layout.role(Role.SAMPLES)
    if config.train.sync == SYNC_ASYNC:
        return ranks - config.train.ps_servers
    return ranks


def _check_wire(config: Config) -> None:
    codec, p = config.comm.codec, config.parallel
    if codec != CODEC_NONE and p.grad_reduce_dtype != "fp32":
        raise ConfigError("parallel.grad_reduce_dtype", p.grad_reduce_dtype,
                          f"conflicts with comm.codec={codec} (both set the gradient wire "
                          "format)", "leave parallel.grad_reduce_dtype=fp32 and let the "
                          "codec decide (comm.codec=bf16 halves the bytes)")


def _check_monitor(config: Config) -> None:
    hang, timeout = config.monitor.hang_timeout, config.parallel.timeout_s
    if hang and hang >= timeout:
        raise ConfigError("monitor.hang_timeout", hang,
                          f"must be below parallel.timeout_s={timeout:g}, or the "
                          "collective fails before the hang is diagnosed",
                          f"set monitor.hang_timeout below {timeout:g}, or raise "
                          "parallel.timeout_s")
    for name in config.monitor.loggers:
        module, extra = LOGGER_PACKAGES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError("monitor.loggers", name, f"needs the {module} package",
                              f'pip install -e ".[{extra}]" from a checkout (or '
                              f"pip install 'disttrain[{extra}]'), or drop {name!r}")


def on_gpu(train: TrainConfig) -> bool:
    """Whether ``train.device`` resolves to CUDA (``auto``: when one is available)."""
    import torch

    return train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available())


def _check_device(config: Config) -> None:
    import torch

    dev, backend = config.train.device, config.parallel.backend
    if dev == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", dev, "no CUDA device is available",
                          "use train.device=cpu or auto")
    gpu = on_gpu(config.train)
    if config.train.precision == "fp16" and not gpu:
        raise ConfigError("train.precision", "fp16", "fp16 with loss scaling needs a GPU",
                          "use train.precision=bf16 on CPU")
    if backend == "nccl" and not gpu:
        raise ConfigError("parallel.backend", backend, "NCCL needs CUDA devices",
                          "use parallel.backend=gloo or auto on CPU")


def check_shared_gpu(config: Config, world_size: int) -> None:
    """The shared-GPU test mode (``DISTTRAIN_SHARED_GPU=1``: every rank of the job on
    one GPU, collectives through Gloo) only where it tests something: a visible GPU,
    the run on it, Gloo, and more ranks on this host (``LOCAL_WORLD_SIZE``, else the
    whole world) than GPUs; where each rank could have its own GPU it would only train
    slower than NCCL, so it is refused."""
    import torch

    if os.environ.get(SHARED_GPU_ENV, "") in ("", "0"):
        return
    mode = f"{SHARED_GPU_ENV}=1 (the shared-GPU test mode)"
    if not torch.cuda.is_available():
        raise ConfigError(SHARED_GPU_ENV, os.environ[SHARED_GPU_ENV],
                          "the shared-GPU test mode needs a CUDA device; none is visible",
                          f"unset {SHARED_GPU_ENV}: on the CPU every layout runs on Gloo")
    if config.train.device == "cpu":
        raise ConfigError("train.device", "cpu", f"{mode} puts every rank on the GPU",
                          f"use train.device=auto or cuda, or unset {SHARED_GPU_ENV}")
    if config.parallel.backend == "nccl":
        raise ConfigError("parallel.backend", "nccl", f"NCCL refuses two ranks on one "
                          f"GPU; {mode} runs the collectives through Gloo",
                          "use parallel.backend=auto or gloo")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count()
    if local <= gpus:
        raise ConfigError(SHARED_GPU_ENV, os.environ[SHARED_GPU_ENV],
                          f"{local} rank(s) on this host and {gpus} GPU(s): each rank can "
                          "have its own GPU, where the shared-GPU test mode would only "
                          "train slower", f"unset {SHARED_GPU_ENV} to train with NCCL, or "
                          "make one GPU visible (CUDA_VISIBLE_DEVICES=0) to test the mode")


TOKENIZER_BYTES = "bytes"
BPE_PATTERN = re.compile(r"bpe:(\d+)$")
MIN_BPE, MAX_BPE = 260, 1 << 20  # the 256 byte symbols and a few merges; a sane bound


def check_tokenizer(value: str) -> None:
    """Refuse a ``data.tokenizer`` that names nothing usable (one line, the fix)."""
    if value == TOKENIZER_BYTES:
        return
    match = BPE_PATTERN.match(value)
    if match:
        n = int(match.group(1))
        if not MIN_BPE <= n <= MAX_BPE:
            raise ConfigError("data.tokenizer", value, f"trains a BPE of {n} tokens",
                              f"use bpe:N with N from {MIN_BPE} to {MAX_BPE}")
        _need_tokenizers(value)
        return
    if value.startswith("bpe:"):
        raise ConfigError("data.tokenizer", value, "is not bpe:N", "e.g. bpe:8192")
    if not Path(value).expanduser().is_file():
        raise ConfigError("data.tokenizer", value, "is neither bytes, bpe:N nor a file",
                          "give the path of a Hugging Face tokenizer.json")
    _need_tokenizers(value)


def _need_tokenizers(value: str) -> None:
    if importlib.util.find_spec("tokenizers") is None:
        raise ConfigError("data.tokenizer", value, "needs the tokenizers package",
                          "pip install tokenizers (it comes with transformers: "
                          "pip install -e '.[hf]' from a checkout)")

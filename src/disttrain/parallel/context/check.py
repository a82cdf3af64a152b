"""Context parallelism's compatibility check (run by validation before any process
group): what a cp degree needs of the sequence, the model's attention and the other
settings. The apart sync modes and dynamic balancing refuse it in their own checks (it
takes a role beyond splitting the samples)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...config.layout import Layout
from ...config.schema import Config
from ...dimensions import Role, dimension
from ...errors import ConfigError
from ...spec import ModelSpec
from .attention import ring_attention_refusal
from .sequence import chunk_length

ENTRY = dimension("cp")


def check_context(config: Config, layout: Layout, spec: ModelSpec, micro_batches: int,
                  model: Callable[[], nn.Module]) -> None:
    """Refuse, one line with the fix, a cp degree whose chunks do not divide the
    sequence (``model.seq_len``: 2 x cp equal chunks), a model whose attention cannot
    run as a ring (``model()``: the model, or one built on the meta device from the
    config; :func:`.attention.ring_attention_refusal` names the module), sequence
    parallelism whose tp shards do not divide a rank's positions, and
    ``train.compile`` beside it (``spec``, ``micro_batches``: unused, every dimension's
    check takes them)."""
    cp = layout.degree(ENTRY.key)
    if cp == 1:
        return
    seq = config.model.seq_len
    c = chunk_length(seq, cp, field="model.seq_len")
    refusal = ring_attention_refusal(model(), seq)
    if refusal is not None:
        raise ConfigError(ENTRY.config_key, cp, refusal)
    tp = layout.role(Role.TENSORS)
    if config.parallel.sequence_parallel and tp > 1 and (2 * c) % tp:
        raise ConfigError("parallel.sequence_parallel", True,
                          f"splits each cp rank's {2 * c} positions (model.seq_len / cp = "
                          f"{seq} / {cp}) over tp={tp}, which does not divide them",
                          "set parallel.sequence_parallel=false, or a model.seq_len that "
                          f"is a multiple of 2 x cp x tp = {2 * cp * tp}")
    if config.train.compile:
        raise ConfigError("train.compile", True, f"does not apply with "
                          f"{ENTRY.config_key}={cp} (ring attention passes keys and "
                          "values between ranks inside every block: torch.compile would "
                          "split each block at each message)",
                          f"set train.compile=false, or {ENTRY.config_key}=1")

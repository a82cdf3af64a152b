"""What an estimate assumes beyond the model, the cluster and the layout: the
precision, how model states are counted, the gradient buckets, the logging period."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import TrainConfig
from .costs import ACT_BYTES

ACCOUNTING = ("disttrain", "mixed")


@dataclass(frozen=True, kw_only=True)
class Options:
    """``accounting``: ``disttrain`` (fp32 parameters, gradients and optimizer state,
    autocast: norm inputs stay fp32 and the cast weights are kept for backward) or
    ``mixed`` (the ZeRO paper's 2 + 2 + 12 bytes, every activation in 16 bits);
    ``grad_bytes``: bytes per gradient element on the wire (and per parameter in
    ZeRO's gathers). Overlaps a framework has and disttrain has not (both off for
    disttrain's own runs): ``layer_comm_overlap``, tensor parallelism's collectives
    pipelined with the layer's matmuls (Megatron-LM's ``--tp-comm-overlap``), so only
    what exceeds a pass's matmul time shows; ``param_gather_overlap``, ZeRO-1/2's
    all-gather of the updated parameters behind the next step's first forward
    (``--overlap-param-gather``). ``fused_loss``: the loss is disttrain's fused linear +
    cross-entropy (``train.fused_loss``, on by default), which keeps two gradients
    instead of the [tokens, V] logits (:func:`~.memory.fused_loss_bytes`); off, the
    full fp32 logits are priced (``train.fused_loss=false``, a ``loss_fn`` of one's own,
    a model whose head the fused loss cannot stand in for)."""

    precision: str = "bf16"
    accounting: str = "disttrain"
    bucket_mb: float = 25.0
    log_every: int = 10  # steps between logged records (telemetry is gathered on those)
    layer_comm_overlap: bool = False
    param_gather_overlap: bool = False
    fused_loss: bool = TrainConfig.fused_loss  # the config's default

    @property
    def act_bytes(self) -> int:
        return ACT_BYTES[self.precision]

    @property
    def grad_bytes(self) -> int:
        return 2 if self.accounting == "mixed" else 4

    @property
    def master_copy(self) -> bool:
        """Model states counted as the ZeRO paper's mixed precision: 16-bit parameters
        and gradients, fp32 master weights with the optimizer state
        (:func:`~.memory.model_state_bytes`)."""
        return self.accounting == "mixed"


# the default of every planner function's ``options`` (frozen: one shared instance)
DEFAULT_OPTIONS = Options()

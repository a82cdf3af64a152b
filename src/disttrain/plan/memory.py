"""Per-rank memory of a training step, estimated from the model and layout alone.

Model states on one rank (Ψ parameters, N = the replicas ZeRO shards over: the
data-parallel ranks, S = ceil(Ψ/N) the padded ZeRO shard):

    ZeRO stage          params  grads  optimizer   AdamW total
    0  replica          4Ψ      4Ψ     8Ψ          16Ψ
    1  + opt. state     4Ψ      4Ψ     8S          4Ψ + 4Ψ + 8Ψ/N
    2  + gradients      4Ψ      4S     8S          4Ψ + 12Ψ/N
    3  + parameters     4S      4S     8S          16Ψ/N

disttrain keeps parameters, gradients and optimizer state in fp32 whatever
``train.precision`` is (autocast lowers the forward only). Optimizer state per
parameter: AdamW 8 bytes (m, v); SGD 4 with momentum, 0 without.

``master_copy=True`` gives the ZeRO paper's mixed-precision accounting instead, for
comparison with systems that keep fp16 weights: params 2, grads 2, optimizer 4 (fp32
master weights) + the state above, so AdamW is 2Ψ + 2Ψ + 12Ψ at stage 0, 2Ψ + 2Ψ +
12Ψ/N at 1, 2Ψ + 14Ψ/N at 2 and 16Ψ/N at 3.

Activations: see :func:`gpt_activation_bytes`. Left out everywhere: transient buffers
(gradient buckets, ZeRO-3's gathered parameters, autocast's cache of cast weights
during the forward, the gradient of the logits at the start of backward), allocator
fragmentation and the CUDA context.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config.schema import ModelConfig
from ..models import num_params as gpt_num_params

# per parameter, sharded by ZeRO; SGD's is its momentum buffer; 1-bit Adam keeps
# AdamW's and adds (below) a worker residual held whole, a server residual of 4 / dp and,
# under ZeRO, a whole copy of the frozen step sizes
_STATE_BYTES = {"adamw": 8, "sgd": 4, "onebit_adam": 8}
_ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_CHECKPOINTING = ("none", "full", "every_k")
_FP32, _INT64 = 4, 8


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one rank holds: its (shard of) parameters, gradients and optimizer state,
    and the peak activations of one micro-batch (whole numbers for a whole parameter
    count; the planner's per-rank averages may be fractional)."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0

    @property
    def model_states(self) -> float:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations


def model_state_bytes(num_params: float, *, replicas: int, zero: int,
                      optimizer: str = "adamw", momentum: bool = True,
                      master_copy: bool = False) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and optimizer state (activations = 0)
    for ``num_params`` parameters under ZeRO stage ``zero`` over ``replicas`` ranks."""
    _check("num_params", num_params, num_params >= 0, "a parameter count >= 0")
    _check("replicas", replicas, replicas >= 1, "a data-parallel degree >= 1")
    _check("zero", zero, zero in (0, 1, 2, 3), "a ZeRO stage: 0, 1, 2 or 3")
    _check("optimizer", optimizer, optimizer in _STATE_BYTES, f"one of {tuple(_STATE_BYTES)}")
    shard = -(-num_params // replicas)

    def held(sharded_from_stage: int) -> float:
        return shard if zero >= sharded_from_stage else num_params

    state = 0 if optimizer == "sgd" and not momentum else _STATE_BYTES[optimizer]
    weight = 2 if master_copy else _FP32
    if master_copy:
        state += _FP32  # the fp32 master weights live with the optimizer state
    extra: float = 0
    if optimizer == "onebit_adam":
        extra = _FP32 * num_params * (2 if zero else 1) + -(-_FP32 * num_params // replicas)
    return MemoryEstimate(params=weight * held(3), grads=weight * held(2),
                          optimizer=state * held(1) + extra)


def gpt_activation_bytes(model: ModelConfig, *, micro_batch: int, precision: str = "fp32",
                         activation_checkpointing: str = "none", every_k: int = 2) -> int:
    """Peak bytes autograd keeps for backward in one micro-batch of GPT(model).

    b = micro_batch, T = seq_len, d = d_model, h = n_head, V = vocab_size, and a = 4
    (fp32) or 2 (bf16/fp16 autocast), read off ``models/gpt.py``:

    per block   2·bTd·4    both layer norms' inputs (the residual stream stays fp32)
                4·bT·4     their mean and rstd
                14·bTd·a   ln1 output (qkv's input) 1, qkv output 3 (SDPA's q, k, v are
                           views of it), SDPA output 1 (out-proj's input is a view),
                           ln2 output (up's input) 1, 4d hidden before GELU 4, after 4
                h·bT·4     SDPA's logsumexp
                12·d²·a    autocast only: the four weight matrices' cast copies
    embedding   8·(bT + T) token ids and positions
    head        bTd·4 + 2·bT·4 + bTd·a   final layer norm (input, statistics, output)
                V·d·a      autocast only: the tied head weight's cast copy
                bTV·4      log-softmax output (the loss casts logits to fp32)
                8·bT       targets

    A checkpointed block (``full``: all; ``every_k``: blocks 0, k, 2k, ...) keeps only
    its input, bTd·4. The peak is the larger of the end of the forward (everything
    above) and the recompute of the last checkpointed block i in backward (embedding,
    what blocks before i keep, block i in full; the head is freed by then). Assumes
    dropout = 0 and a fused attention kernel (flash, memory-efficient or CPU flash);
    the math kernel also saves h·T·T scores per sample.
    """
    _check("micro_batch", micro_batch, micro_batch >= 1, "an integer >= 1")
    _check("precision", precision, precision in _ACTIVATION_BYTES,
           f"one of {tuple(_ACTIVATION_BYTES)}")
    _check("activation_checkpointing", activation_checkpointing,
           activation_checkpointing in _CHECKPOINTING, f"one of {_CHECKPOINTING}")
    _check("every_k", every_k, every_k >= 1, "an integer >= 1")
    a = _ACTIVATION_BYTES[precision]
    b, t = micro_batch, model.seq_len
    block = _block_bytes(model, b, a)
    step = {"none": 0, "full": 1, "every_k": every_k}[activation_checkpointing]
    n, kept_input = model.n_layer, b * t * model.d_model * _FP32
    # Blocks 0, step, 2·step, ... are checkpointed; the sums are in closed form so the
    # estimate costs the same for any n_layer (it screens absurd configs before launch).
    checkpointed = -(-n // step) if step else 0
    embedding = _INT64 * (b * t + t)
    end_of_forward = (embedding + checkpointed * kept_input + (n - checkpointed) * block
                      + _head_bytes(model, b, a))
    if not checkpointed:
        return end_of_forward
    last = (checkpointed - 1) * step  # recomputing it holds the most: all before it kept
    before_last = (checkpointed - 1) * kept_input + (last - (checkpointed - 1)) * block
    return max(end_of_forward, embedding + before_last + block)


def estimate_gpt(model: ModelConfig, *, micro_batch: int, replicas: int, zero: int,
                 precision: str = "fp32", optimizer: str = "adamw", momentum: bool = True,
                 activation_checkpointing: str = "none", every_k: int = 2) -> MemoryEstimate:
    """Per-rank memory of training GPT(model): disttrain's fp32 model states (see
    :func:`model_state_bytes`) and one micro-batch's peak activations (gradient
    accumulation adds none; ``replicas``: the ranks ZeRO shards over). Activations do
    not depend on the replicas or the ZeRO stage."""
    states = model_state_bytes(gpt_num_params(model), replicas=replicas, zero=zero,
                               optimizer=optimizer, momentum=momentum)
    return replace(states, activations=gpt_activation_bytes(
        model, micro_batch=micro_batch, precision=precision,
        activation_checkpointing=activation_checkpointing, every_k=every_k))


def _block_bytes(model: ModelConfig, b: int, a: int) -> int:
    bt, d = b * model.seq_len, model.d_model
    weight_copies = 12 * d * d * a if a < _FP32 else 0
    return (2 * bt * d * _FP32 + 4 * bt * _FP32 + 14 * bt * d * a
            + model.n_head * bt * _FP32 + weight_copies)


def _head_bytes(model: ModelConfig, b: int, a: int) -> int:
    bt, d = b * model.seq_len, model.d_model
    weight_copy = model.vocab_size * d * a if a < _FP32 else 0
    final_norm = bt * d * _FP32 + 2 * bt * _FP32 + bt * d * a
    return final_norm + weight_copy + bt * model.vocab_size * _FP32 + _INT64 * bt


def _check(name: str, value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: expected {expected}")

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

Activations: see :func:`gpt_activation_bytes`. With the fused linear + cross-entropy
(``train.fused_loss``, :func:`fused_loss_bytes`) the loss's chunk is the one transient
counted: it exists at the end of the forward, on top of everything kept. Left out
everywhere else: transient buffers (gradient buckets, ZeRO-3's gathered parameters,
autocast's cache of cast weights during the forward, without the fused loss the logits
before their fp32 cast and their gradient at the start of backward), kernels' own
workspaces, allocator fragmentation and the CUDA context.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..config.schema import ModelConfig
from ..models import num_params as gpt_num_params
from ..parallel.fused_loss.functions import default_chunk_tokens
from ..shape import ModelShape, gpt_shape
from .costs import ACT_BYTES
from .layout import PlannedLayout
from .options import Options

# per parameter, sharded by ZeRO; SGD's is its momentum buffer; 1-bit Adam keeps
# AdamW's and adds (below) a worker residual held whole, a server residual of 4 / dp and,
# under ZeRO, a whole copy of the frozen step sizes
_STATE_BYTES = {"adamw": 8, "sgd": 4, "onebit_adam": 8}
_ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_CHECKPOINTING = ("none", "full", "every_k")
_FP32, _INT64 = 4, 8
# per token of a fused-loss chunk, its small vectors (the CPU path's _chunk_loss): the
# counted and here masks 1 + 1, local ids and the clamped column 8 + 8, row max 4,
# target logit 4, the [2, c] sums 8, the per-token loss 4
_CHUNK_TOKEN_BYTES = 38


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


# the activation model (Korthikanti et al. 2022): the planner's and the GPT's -------

def layer_activation_bytes(shape: ModelShape, *, b: int, shards: int = 1, sp: bool = False,
                           recompute: str = "none", precision: str = "bf16",
                           accounting: str = "mixed") -> float:
    """Bytes one layer keeps for backward for one micro-batch of ``b`` sequences, on
    one of ``shards`` tensor shards (Korthikanti et al. 2022, Section 4, generalised;
    ``sp``: sequence parallelism over the shards).

    With s = seq, h = hidden, a = heads, t = shards and 16-bit activations, the paper's
    layer (dropout, GELU MLP of 4h, no fused attention) keeps sbh(34 + 5as/h):

    - replicated across tp unless sp: the two norms' inputs 4sbh, the inputs of the
      qkv and first MLP matmuls 4sbh, two dropout masks 2sbh (10sbh);
    - split by tp: q and k 4sbh, v 2sbh, the out-projection's input 2sbh, the MLP's
      activation input and output 2 x 8sbh (24sbh); gated MLPs keep gate, up, their
      activation and product (4 x 2sbF); grouped-query attention keeps k and v at
      the kv width;
    - split by tp, attention scores: softmax output 2as^2b, its dropout mask as^2b and
      output 2as^2b (5as^2b); none with fused attention (its log-sum-exp, 4asb, is
      kept instead), 2as^2b without attention dropout.

    ``selective`` drops the scores part (recomputed); ``full`` keeps only the layer's
    input (2sbh, /t with sp). ``accounting='disttrain'`` also counts what autocast
    over fp32 weights keeps: the residual stream and norm inputs in fp32, the norms'
    statistics, and the cast weight copies; and, with sp, it keeps the inputs of the
    qkv and first MLP matmuls whole (4sbh, not /t): disttrain's column-parallel layer
    saves the sequence it all-gathered, where Megatron-LM saves its own shard and
    gathers it again in backward.
    """
    s, h, f = shape.seq, shape.hidden, shape.ffn_width
    a = ACT_BYTES[precision]
    sbh = s * b * h
    disttrain = accounting == "disttrain"
    norm_in = (4 if disttrain else a) * sbh  # each of the two norms' input
    if recompute == "full":
        return (4 if disttrain else a) * sbh / (shards if sp else 1)
    dropout_masks = 2 * sbh if shape.dropout else 0
    matmul_inputs = 2 * a * sbh  # of the qkv and first MLP matmuls
    replicated = 2 * norm_in + dropout_masks
    whole = 0.0  # kept at full length on every tp rank, sp or not
    if disttrain:
        replicated += 2 * 2 * 4 * s * b  # the norms' mean and rstd (or rstd and a pad)
        whole = matmul_inputs
    else:
        replicated += matmul_inputs
    kv = shape.kv_width
    split = a * s * b * (h + 2 * kv) + a * sbh  # q, k, v; the out-projection's input
    split += a * s * b * f * (4 if shape.gated else 2)
    heads = shape.heads
    if shape.flash:
        scores = 4 * heads * s * b
    else:
        scores = (5 if shape.dropout else 2) * heads * s * s * b
    if recompute == "selective":
        scores = 0
    weights = layer_cast_bytes(shape, precision, accounting)
    return replicated / (shards if sp else 1) + whole + (split + scores + weights) / shards


@functools.lru_cache(maxsize=4096)
def layer_cast_bytes(shape: ModelShape, precision: str, accounting: str) -> float:
    """autocast's 16-bit copies of one layer's weight matrices (all tp ranks'), which
    ``disttrain`` accounting counts: autocast keeps one per weight for its whole region,
    a micro-batch's forward, or a pipeline's step, where every micro-batch in flight
    shares it."""
    a = ACT_BYTES[precision]
    if accounting != "disttrain" or a == 4:
        return 0.0
    return a * sum(i * o for _, i, o in shape.matmul_shapes())


def end_activations(shape: ModelShape, planned: PlannedLayout, o: Options, shards: int,
                     sp: bool) -> tuple[float, float, float]:
    """Per micro-batch, the embedding's activations (first chunk) and the final norm's,
    the head's and the loss's (last chunk); and what the last stage keeps once per
    step (autocast's cast of the head weight, without the fused loss). The fused
    loss's transient: :func:`loss_transient_bytes`."""
    s, b, h, a = shape.seq, planned.mbs, shape.hidden, o.act_bytes
    split = shards if sp else 1
    embedding = 8 * s * b + (s * b * h / split if shape.dropout else 0)  # ids, mask
    if o.accounting == "disttrain":
        return _disttrain_ends(shape, planned, o, embedding, shards, sp)
    if o.fused_loss:  # final norm's input; the loss's gradients
        kept, _ = fused_loss_bytes(s * b, shape.vocab / shards, h, compute=a, hidden_bytes=a)
        return embedding, a * s * b * h / split + kept, 0.0
    head = (2 * a * s * b * h / split  # final norm's input, head's input
            + 4 * s * b * shape.vocab / shards)  # fp32 logits for the loss
    return embedding, head, 0.0


def _disttrain_ends(shape: ModelShape, planned: PlannedLayout, o: Options, embedding: float,
                    shards: int, sp: bool) -> tuple[float, float, float]:
    """:func:`end_activations` of disttrain's own embedding, head and loss: beyond
    the token ids, the position ids [s] (a learned table) and the
    vocabulary-parallel lookup's mask of ids outside the shard (sharded); the final
    norm's fp32 input and statistics; then, with the fused loss, its two gradients
    (:func:`fused_loss_bytes`, the hidden states' in fp32: the norm's output), else the
    head's input (whole under sp, as for the layers), the loss's fp32 softmax
    [sb, V / shards] and targets (sharded: local ids and two masks) and the cast head
    weight (16-bit)."""
    s, b, h, a = shape.seq, planned.mbs, shape.hidden, o.act_bytes
    split = shards if sp else 1
    embedding += (8 * s if shape.positions else 0) + (s * b if shards > 1 else 0)
    norm = (4 * h + 2 * 4) * s * b / split
    if o.fused_loss:
        kept, _ = fused_loss_bytes(s * b, shape.vocab / shards, h, compute=a)
        return embedding, norm + kept, 0.0
    head = (norm + a * s * b * h + 4 * s * b * shape.vocab / shards + 8 * s * b
            + (2 * s * b if shards > 1 else 0))
    return embedding, head, a * shape.vocab * h / shards if a < 4 else 0.0


def loss_transient_bytes(shape: ModelShape, planned: PlannedLayout, o: Options, shards: int,
                         sp: bool) -> float:
    """What the last stage holds only while the fused loss's forward runs, on top of
    what it keeps (0 without the fused loss, whose transients are left out): the
    hidden states it is given (the final norm's output [sb / shards under sp, d], and
    under sp their all-gathered copy [sb, d]), and :func:`fused_loss_bytes`' transient
    over this rank's V / shards rows of the vocabulary."""
    if not o.fused_loss:
        return 0.0
    s, b, h, a = shape.seq, planned.mbs, shape.hidden, o.act_bytes
    hidden_bytes = _FP32 if o.accounting == "disttrain" else a
    given = hidden_bytes * s * b * h * ((1 / shards + 1) if sp and shards > 1 else 1)
    _, transient = fused_loss_bytes(s * b, shape.vocab / shards, h, compute=a,
                                    hidden_bytes=hidden_bytes)
    return given + transient


def fused_loss_bytes(tokens: int, rows: float, hidden: int, *, compute: int,
                     hidden_bytes: int = _FP32, chunk: int | None = None
                     ) -> tuple[float, float]:
    """(kept, transient) bytes of one fused linear + cross-entropy
    (:func:`disttrain.parallel.fused_loss.linear_cross_entropy`) over N = ``tokens``
    hidden states [N, d] of ``hidden_bytes`` each and this rank's ``rows`` of the head's
    vocabulary (its weight [V / tp, d], fp32), matmuls in ``compute`` bytes,
    ``chunk`` tokens at a time (default: the loss's own, at most
    ``CHUNK_LOGIT_BYTES`` of fp32 logits).

    kept, from forward to backward: d loss / d hidden [N, d] in the hidden states'
    dtype and d loss / d W [V / tp, d] in fp32 (no logits, no targets).

    transient, the peak of its forward on top of those, on the CPU path: with 16-bit
    matmuls the cast copies of the hidden states [N, d] (where their dtype differs) and
    of the weight [V / tp, d]; then per chunk of c tokens its logits z [c, V / tp]
    (fp32: reworked in place), or in 16 bits z, its fp32 copy and the 16-bit
    gradient, then z, that gradient and the larger of the hidden states' gradient
    product [c, d] and the weight's [V / tp, d] (with its fp32 copy for the fp32 sum);
    and the chunk's per-token vectors. The CUDA path keeps no fp32 copy (less)."""
    n, r, d, a = tokens, rows, hidden, compute
    c = chunk or default_chunk_tokens(n, max(1, round(r)))
    kept = hidden_bytes * n * d + _FP32 * r * d
    if a == _FP32:
        return kept, _FP32 * c * r + _CHUNK_TOKEN_BYTES * c
    casts = (a * n * d if a != hidden_bytes else 0) + a * r * d
    logits = 2 * a * c * r + max(_FP32 * c * r, a * c * d, (a + _FP32) * r * d)
    return kept, casts + logits + _CHUNK_TOKEN_BYTES * c


def gpt_activation_bytes(model: ModelConfig, *, micro_batch: int, precision: str = "fp32",
                         activation_checkpointing: str = "none", every_k: int = 2,
                         fused_loss: bool = True) -> int:
    """Peak bytes autograd keeps for backward in one micro-batch of GPT(model), and,
    with ``fused_loss`` (``train.fused_loss``), the fused loss's transient on top.

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
    head        bTd·4 + 2·bT·4   final layer norm (input, statistics)
      unfused   bTd·a      its output (the head's input)
                V·d·a      autocast only: the tied head weight's cast copy
                bTV·4      log-softmax output (the loss casts logits to fp32)
                8·bT       targets
      fused     bTd·4 + Vd·4   the gradients of the hidden states and of the head
                           weight, computed in forward (:func:`fused_loss_bytes`)
                + transient: the norm's output bTd·4 and one chunk's logits and
                           arithmetic (:func:`fused_loss_bytes`)

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
    b, t = micro_batch, model.seq_len
    block = _block_bytes(model, b, precision)
    step = {"none": 0, "full": 1, "every_k": every_k}[activation_checkpointing]
    n, kept_input = model.n_layer, b * t * model.d_model * _FP32
    # Blocks 0, step, 2·step, ... are checkpointed; the sums are in closed form so the
    # estimate costs the same for any n_layer (it screens absurd configs before launch).
    checkpointed = -(-n // step) if step else 0
    embedding = _INT64 * (b * t + t)
    end_of_forward = (embedding + checkpointed * kept_input + (n - checkpointed) * block
                      + _head_bytes(model, b, precision, fused_loss))
    if not checkpointed:
        return round(end_of_forward)
    last = (checkpointed - 1) * step  # recomputing it holds the most: all before it kept
    before_last = (checkpointed - 1) * kept_input + (last - (checkpointed - 1)) * block
    return round(max(end_of_forward, embedding + before_last + block))


def estimate_gpt(model: ModelConfig, *, micro_batch: int, replicas: int, zero: int,
                 precision: str = "fp32", optimizer: str = "adamw", momentum: bool = True,
                 activation_checkpointing: str = "none", every_k: int = 2,
                 fused_loss: bool = True) -> MemoryEstimate:
    """Per-rank memory of training GPT(model): disttrain's fp32 model states (see
    :func:`model_state_bytes`) and one micro-batch's peak activations (gradient
    accumulation adds none; ``replicas``: the ranks ZeRO shards over). Activations do
    not depend on the replicas or the ZeRO stage."""
    states = model_state_bytes(gpt_num_params(model), replicas=replicas, zero=zero,
                               optimizer=optimizer, momentum=momentum)
    return replace(states, activations=gpt_activation_bytes(
        model, micro_batch=micro_batch, precision=precision,
        activation_checkpointing=activation_checkpointing, every_k=every_k,
        fused_loss=fused_loss))


def _block_bytes(model: ModelConfig, b: int, precision: str) -> float:
    """One block of GPT(model): :func:`layer_activation_bytes`, disttrain's accounting
    (dropout left out, as the docstring of :func:`gpt_activation_bytes` says)."""
    return layer_activation_bytes(_no_dropout(model), b=b, precision=precision,
                                  accounting="disttrain")


def _head_bytes(model: ModelConfig, b: int, precision: str, fused_loss: bool) -> float:
    """The head of GPT(model): :func:`end_activations`' last-chunk bytes, its
    once-per-step cast weight and the fused loss's transient."""
    options = Options(precision=precision, accounting="disttrain", fused_loss=fused_loss)
    shape, planned = _no_dropout(model), PlannedLayout(mbs=b)
    _, head, once = end_activations(shape, planned, options, 1, False)
    return head + once + loss_transient_bytes(shape, planned, options, 1, False)


def _no_dropout(model: ModelConfig) -> ModelShape:
    return replace(gpt_shape(model), dropout=False)


def _check(name: str, value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: expected {expected}")

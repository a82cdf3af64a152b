"""What one transformer layer and the model's head cost on one device, by kind of
work: matmuls (each timed from its shape, forward, input gradient and weight
gradient apart), fused attention, memory-bound kernels (norms, residual adds, the
activation, dropout, the loss over the vocabulary), the kernels' launch overheads, and
the framework's host time beside them. :mod:`.steptime` assembles a step from these;
``plan calibrate`` fits the cluster's figures through the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from ..shape import ModelShape
from .cluster import Cluster
from .costs import ACT_BYTES, attention_time, elementwise_time, matmul_parts

SPLIT_KEYS = ("matmul", "attention", "memory_bound", "overhead")


@dataclass(frozen=True)
class Work:
    """Seconds of one piece of work: kernels by kind (``launch``: their per-kernel
    overheads) and the framework's ``host`` time."""

    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    launch: float = 0.0
    host: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, factor: float) -> Work:
        return Work(*(getattr(self, f.name) * factor for f in fields(self)))

    @property
    def device(self) -> float:
        return self.matmul + self.attention + self.memory + self.launch

    def seconds(self, async_dispatch: bool) -> float:
        """The longer of kernels and host time when the host runs ahead of the device
        (a GPU), else both."""
        return max(self.device, self.host) if async_dispatch else self.device + self.host

    def split(self, async_dispatch: bool) -> dict[str, float]:
        """:meth:`seconds` as matmul, attention, memory-bound and overhead (launches,
        and the host time the device does not hide); the parts sum to it."""
        exposed = max(0.0, self.host - self.device) if async_dispatch else self.host
        return {"matmul": self.matmul, "attention": self.attention,
                "memory_bound": self.memory, "overhead": self.launch + exposed}


def _matmuls(cluster: Cluster, shapes: Sequence[tuple[float, float, float]],
             precision: str) -> Work:
    kernel = overhead = 0.0
    for m, n, k in shapes:
        t, o = matmul_parts(cluster, m, n, k, precision, ACT_BYTES[precision])
        kernel, overhead = kernel + t, overhead + o
    return Work(matmul=kernel, launch=overhead)


def layer_elementwise(shape: ModelShape, shards: int, sp: bool, tokens: int, a: int
                      ) -> tuple[float, int]:
    """(bytes, kernels) of one layer's memory-bound forward on one of ``shards`` tensor
    shards: the two
    norms (read, write), the two residual adds (two reads, a write), the attention
    output's copy back to [tokens, hidden], the activation of the MLP (gated: the
    gate's activation and the product), and with dropout two dropouts (read, write, a
    byte of mask); sequence parallelism splits the hidden-wide ones over the shards."""
    h, f = shape.hidden, shape.ffn_width / shards
    split = shards if sp else 1
    nbytes = (2 * 2 * h + 2 * 3 * h + 2 * h) * a / split
    nbytes += (4 if shape.gated else 2) * f * a
    kernels = 5 + int(shape.gated)
    if shape.dropout:
        nbytes += 2 * (2 * a + 1) * h / split
        kernels += 2
    return nbytes * tokens, kernels


def layer_work(shape: ModelShape, cluster: Cluster, shards: int, b: int, precision: str,
               sp: bool = False, token_split: int = 1) -> tuple[Work, Work, Work]:
    """(forward, backward, attention's forward) of one layer on one of ``shards``
    tensor shards for a micro-batch of ``b`` sequences, of which this rank holds
    ``shape.seq`` positions each: one of ``token_split`` parts of each sample (the
    shape :func:`~.shape.token_part` gives). Its attention runs the queries held
    against every part's keys, balanced: 1 / ``token_split`` of the whole sequence's
    attention, which is ``token_split`` times the attention of its own part, block by
    block (what ``b x token_split`` sequences of ``shape.seq`` cost). Weight [in, out]
    split by columns (qkv, gate, up) or rows (out, down); forward [tokens, in/t or in]
    x [.., out/t or out] (t = shards); the backward's input gradient and weight
    gradient are their own shapes. Attention:
    fused (:func:`~.costs.attention_time`; its backward takes
    ``attention_backward_ratio`` times its forward) or not
    (:func:`unfused_attention`, backward twice the forward);
    memory-bound work twice the forward's bytes and kernels (each reads the forward's
    input and the gradient and writes a gradient, and the norms reduce their weights'
    gradients). Host time: ``layer_overhead_s``, a third forward."""
    tokens, a = b * shape.seq, ACT_BYTES[precision]
    forward, backward = [], []
    for name, i, out in shape.matmul_shapes():
        n, k = (out / shards, i) if name in ("qkv", "gate", "up") else (out, i / shards)
        forward.append((tokens, n, k))
        backward += [(tokens, k, n), (k, n, tokens)]  # input grad, weight grad
    blocks = b * token_split  # query-part x key-part blocks of attention, per sample
    if shape.flash:
        attn = Work(attention=attention_time(cluster, blocks, shape.seq,
                                             shape.hidden / shards, precision),
                    launch=cluster.elementwise_overhead_s * token_split)
    else:
        attn = unfused_attention(shape, cluster, shards, blocks, precision)
    nbytes, kernels = layer_elementwise(shape, shards, sp, tokens, a)
    memory = elementwise_time(cluster, nbytes, kernels)
    host = cluster.layer_overhead_s
    launch = kernels * cluster.elementwise_overhead_s
    ratio = attention_backward_ratio(shape, cluster)
    fwd = _matmuls(cluster, forward, precision) + attn + Work(
        memory=memory - launch, launch=launch, host=host / 3)
    bwd = _matmuls(cluster, backward, precision) + attn.scaled(ratio) + Work(
        memory=2 * (memory - launch), launch=2 * launch, host=host * 2 / 3)
    return fwd, bwd, attn


def attention_backward_ratio(shape: ModelShape, cluster: Cluster) -> float:
    """Attention's backward time over its forward's: the cluster's figure for a fused
    kernel, twice for the unfused matmuls."""
    return cluster.attention_backward_ratio if shape.flash else 2.0


def unfused_attention(shape: ModelShape, cluster: Cluster, shards: int, b: int,
                      precision: str) -> Work:
    """Attention without a fused kernel, forward, on one tensor shard: per sequence and
    head, the scores [s, d] x [d, s] and the weighted sum [s, s] x [s, d] as batched
    matmuls, and between them the memory-bound passes over the s x s scores: the
    scores' write, the softmax's read and write, and with dropout its read, write and
    byte of mask."""
    s, d, a = shape.seq, shape.head_dim, ACT_BYTES[precision]
    batch = b * shape.heads / shards
    mm = _matmuls(cluster, [(s, s, d), (s, d, s)], precision).scaled(batch)
    passes = 3 * a + (2 * a + 1 if shape.dropout else 0)
    kernels = 2 + int(shape.dropout)
    memory = elementwise_time(cluster, passes * batch * s * s, kernels)
    launch = kernels * cluster.elementwise_overhead_s
    return Work(attention=mm.matmul + memory - launch, launch=mm.launch + launch)


def head_work(shape: ModelShape, cluster: Cluster, b: int, precision: str, shards: int = 1,
              fused: bool = False) -> Work:
    """Kernels of the head and loss, forward and backward, for a micro-batch of ``b``
    on one of ``shards`` tensor shards: the logits' matmul, its input and weight
    gradients, and the loss's passes over the [tokens, vocab / shards] logits.

    On the full logits: three passes in fp32 (softmax's forward, its gradient), and with
    16-bit activations the logits' cast up and their gradient's cast down. With the fused
    loss (``fused``, :mod:`disttrain.parallel.fused_loss`), chunk by chunk: on a GPU
    (``async_dispatch``) its compiled kernels, three passes over the logits in the
    matmul's dtype (the row max, the sums of exps, the gradient read and written); on a
    CPU its in-place path over fp32 logits, six passes (max; shift, exp, divide, mask,
    each read and written; a sum), with 16-bit activations the cast up and down too."""
    tokens, v, h = b * shape.seq, shape.vocab / shards, shape.hidden
    a = ACT_BYTES[precision]
    work = _matmuls(cluster, [(tokens, v, h), (tokens, h, v), (h, v, tokens)], precision)
    casts = 2 * (a + 4) if a < 4 else 0
    if fused and cluster.async_dispatch:
        per_logit, passes = 4 * a, 3
    elif fused:
        per_logit, passes = 10 * 4 + casts, 6 + (2 if a < 4 else 0)
    else:
        per_logit, passes = 3 * 4 + casts, 3 + (2 if a < 4 else 0)
    loss = elementwise_time(cluster, per_logit * tokens * v, passes)
    overheads = passes * cluster.elementwise_overhead_s
    return work + Work(memory=loss - overheads, launch=overheads)


def head_kernel_time(shape: ModelShape, cluster: Cluster, b: int, precision: str,
                     shards: int = 1) -> float:
    """Kernel seconds of :func:`head_work`."""
    return head_work(shape, cluster, b, precision, shards).device


def kernel_time_of_layer(shape: ModelShape, cluster: Cluster, b: int,
                         precision: str) -> float:
    """Kernel seconds of one layer's forward and backward on one device, without
    framework time."""
    fwd, bwd, _ = layer_work(shape, cluster, 1, b, precision)
    return fwd.device + bwd.device

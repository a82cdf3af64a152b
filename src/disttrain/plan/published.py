"""Published training throughput the planner is checked against (never fitted to).

**llm-foundry's MPT benchmark table, A100 80GB** (github.com/mosaicml/llm-foundry,
``scripts/train/benchmarking/README.md``, section "A100 80GB with 1600 Gbps node-node
interconnect (RoCE)", read at commit 8c8dd48f, 2025-07-21): every row with a sequence
of at most 8192 tokens. MPT models trained with Composer's FSDP (FULL_SHARD: ZeRO-3),
bf16, ``attn_impl: flash``, activation checkpointing per row (whole blocks). The
table's A100 rows first appeared in May 2023 (commit 1ef7b4d2), measured with the
image ``mosaicml/pytorch:1.13.1_cu117``, before FlashAttention-2 existed, so their
attention is FlashAttention 1 (:data:`FLASH_ATTENTION_1`). Each row gives the micro-
batch, the accumulation, the GPUs and the throughput in tokens per second per GPU.

**llm-foundry's H100 tables** (the same file and commit, sections "H100 80GB BF16
(Large Scale, >= 128 GPUs)" and "H100 80GB BF16"; first added in commit b2a43a14,
2023-10-19, and 5e85bd62, 2024-01-06): the same models and columns, sharding
FULL_SHARD (ZeRO-3) or SHARD_GRAD_OP (ZeRO-2) per row; FlashAttention 2 is assumed
(llm-foundry's images of that time installed flash-attn 2; the table does not say), so
the H100 preset's attention figures apply. Rows of sequences over 8192 are left out as
for the A100.

Megatron-LM's and torchtitan's tables, which publish tensor, pipeline and context
layouts, are in :mod:`.published_layouts`; :mod:`.published_check` checks the planner
against every table (error, the rank of the published layout, the recomputation
choice).

The MPT models (the table's yamls, ``scripts/train/yamls/pretrain/mpt-*.yaml``):
vocabulary 50368, MLP 4 x d_model (GELU), learned positions, LayerNorm and linear
layers with biases, tied embedding, no dropout; the parameter counts equal the table's
(``NumParams``) for every row.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..shape import ModelShape
from .layout import OPTIONS, PlannedLayout
from .options import Options

_OPTION_NAMES = {o.name for o in OPTIONS}
# the published frameworks' loss ran on the full logits (no disttrain fused loss)
MIXED = Options(accounting="mixed", fused_loss=False)

LLM_FOUNDRY_SOURCE = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md @ "
                      "8c8dd48f, 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'")

# d_model, heads, layers of each MPT size (scripts/train/yamls/pretrain/mpt-<name>.yaml)
MPT_DIMS = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24),
            "1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32),
            "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
MPT_VOCAB = 50368

# FlashAttention 1 on an A100: "reaching only 25-40% of the theoretical maximum
# FLOPs/s" (FlashAttention-2 paper, Dao 2023, arXiv 2307.08691, abstract); the middle
# of that range, on the FLOPs it executes (it skips a causal mask's blocks too)
FLASH_ATTENTION_1 = {"attention_efficiency": 0.325}


@dataclass(frozen=True)
class TableRow:
    """One published run as the planner checks it: the model, the cluster
    (``--cluster``), the published layout (``fixed``: its keys the source states; the
    rest are the planner's own choices, e.g. a micro-batch the source does not give),
    the global batch, the published figure (``metric``: tokens/s per GPU, or TFLOP/s
    per GPU counted as the source counts them: model FLOPs, or with ``hardware``
    FLOPs the recomputation's too) and the recomputation modes the framework offered
    (empty: the row's choice is not checked)."""

    label: str
    shape: ModelShape
    cluster: str
    layout: PlannedLayout
    global_batch: int
    published: float
    metric: str = "tokens_per_s_per_gpu"  # or tflops_per_gpu
    hardware: bool = False
    recompute_choices: tuple[str, ...] = ()
    # the source gives the degrees only: the planner picks the rest (micro-batch,
    # schedule, ZeRO stage, sequence parallelism; recomputation unless it is "full")
    degrees_only: bool = False
    # the ZeRO stages the framework offers (Megatron-LM: none or its distributed
    # optimizer; FSDP: all): the rank is among layouts the authors could have run
    zero_choices: tuple[int, ...] = (0, 1, 2, 3)
    # the dimensions and options the framework did not have, held at what it ran
    # (Megatron-LM in 2021: no sequence or context parallelism): the rank is among
    # layouts it could have run (the search's ``held``)
    held: tuple[tuple[str, int], ...] = ()
    # the estimate's assumptions: 16-bit weights and gradients with an fp32 master
    # copy, and the overlaps the framework had
    options: Options = MIXED


@dataclass(frozen=True)
class PublishedTable:
    """A published table: its name (a bench JSON key), its source in the standard of
    this module's docstring, its rows, and what of it was left out and why."""

    name: str
    source: str
    rows: tuple[TableRow, ...]
    left_out: str = ""


@dataclass(frozen=True)
class PublishedRun:
    """One llm-foundry row: model size, sequence, GPUs, micro-batch, accumulation,
    activation checkpointing, the published tokens per second per GPU, the
    parameters, the GPU and the sharding (FULL_SHARD: ZeRO-3, SHARD_GRAD_OP: 2)."""

    model: str
    seq: int
    gpus: int
    mbs: int
    accumulation: int
    checkpointing: bool
    tokens_per_s_per_gpu: float
    num_params: int
    gpu: str = "a100-80gb"
    zero: int = 3

    @property
    def label(self) -> str:
        return f"mpt-{self.model} seq {self.seq} x{self.gpus} mbs {self.mbs}"

    @property
    def global_batch(self) -> int:
        return self.mbs * self.accumulation * self.gpus

    def shape(self) -> ModelShape:
        h, heads, layers = MPT_DIMS[self.model]
        return ModelShape(name=f"mpt-{self.model}", layers=layers, hidden=h, heads=heads,
                          seq=self.seq, vocab=MPT_VOCAB, positions=self.seq, bias=True,
                          qkv_bias=True, tied=True, dropout=False, flash=True)

    def layout(self) -> PlannedLayout:
        """The published layout: FSDP over every GPU (ZeRO-3 or 2), whole-block
        recomputation when checkpointing."""
        return PlannedLayout.whole(self.gpus, mbs=self.mbs, zero=self.zero,
                                   recompute="full" if self.checkpointing else "none")

    def cluster_spec(self) -> str:
        """``--cluster``: nodes of 8 (A100: 1600 Gb/s per node, 8 x 200 Gb/s, the
        preset's NIC per GPU; FlashAttention 1); H100: the preset (FlashAttention 2)."""
        nodes = f"gpu={self.gpu},gpus_per_node=8,nodes={max(1, self.gpus // 8)}"
        if self.gpu != "a100-80gb":
            return nodes
        return nodes + "," + ",".join(f"{k}={v}" for k, v in FLASH_ATTENTION_1.items())

    def layout_spec(self) -> str:
        """``--layout`` as ``disttrain plan`` takes it."""
        return ",".join(f"{k}={v}" for k, v in self.layout().items(shown=True)
                        if k not in _OPTION_NAMES)

    def row(self) -> TableRow:
        """The row as :mod:`.published_check` takes it: Composer checkpoints whole
        blocks or nothing (its choices: none, full)."""
        return TableRow(self.label, self.shape(), self.cluster_spec(), self.layout(),
                        self.global_batch, self.tokens_per_s_per_gpu,
                        recompute_choices=("none", "full"))


LLM_FOUNDRY_A100 = (
    PublishedRun("70b", 2048, 64, 8, 4, True, 410, 64862437376),
    PublishedRun("70b", 2048, 32, 2, 16, True, 373, 64862437376),
    PublishedRun("30b", 8192, 8, 1, 21, True, 574, 30019254272),
    PublishedRun("30b", 4096, 8, 1, 21, True, 814, 29989894144),
    PublishedRun("30b", 2048, 8, 3, 21, True, 916, 29975214080),
    PublishedRun("30b", 1024, 8, 6, 21, True, 946, 29967874048),
    PublishedRun("30b", 512, 8, 12, 21, True, 967, 29964204032),
    PublishedRun("13b", 8192, 8, 5, 3, True, 1795, 12885411840),
    PublishedRun("13b", 4096, 8, 10, 3, True, 2060, 12864440320),
    PublishedRun("13b", 2048, 8, 2, 3, False, 2262, 12853954560),
    PublishedRun("13b", 1024, 8, 40, 3, True, 2330, 12848711680),
    PublishedRun("7b", 8192, 8, 8, 2, True, 3206, 6684024832),
    PublishedRun("7b", 4096, 8, 16, 2, True, 3684, 6667247616),
    PublishedRun("7b", 2048, 8, 6, 2, False, 4641, 6658859008),
    PublishedRun("7b", 1024, 8, 64, 2, True, 4357, 6654664704),
    PublishedRun("3b", 8192, 8, 3, 6, False, 7695, 2667566080),
    PublishedRun("3b", 4096, 8, 5, 6, False, 9457, 2657080320),
    PublishedRun("3b", 2048, 8, 10, 2, False, 10811, 2651837440),
    PublishedRun("3b", 1024, 8, 20, 6, False, 11580, 2649216000),
    PublishedRun("3b", 512, 8, 40, 6, False, 12127, 2647905280),
    PublishedRun("1b", 8192, 8, 3, 4, False, 13814, 1328533504),
    PublishedRun("1b", 4096, 8, 7, 4, False, 17807, 1320144896),
    PublishedRun("1b", 2048, 8, 14, 4, False, 20513, 1315950592),
    PublishedRun("1b", 1024, 8, 18, 4, False, 22112, 1313853440),
    PublishedRun("1b", 512, 8, 56, 4, False, 23148, 1312804864),
    PublishedRun("760m", 8192, 8, 6, 2, False, 20933, 769907712),
    PublishedRun("760m", 4096, 8, 12, 2, False, 27351, 763616256),
    PublishedRun("760m", 2048, 8, 24, 2, False, 32434, 760470528),
    PublishedRun("760m", 1024, 8, 48, 2, False, 29765, 758897664),
    PublishedRun("760m", 512, 8, 96, 2, False, 29446, 758111232),
    PublishedRun("350m", 8192, 8, 8, 2, False, 36569, 362276864),
    PublishedRun("350m", 4096, 8, 16, 2, False, 49555, 358082560),
    PublishedRun("350m", 2048, 8, 32, 2, False, 58782, 355985408),
    PublishedRun("350m", 1024, 8, 64, 2, False, 64813, 354936832),
    PublishedRun("350m", 512, 8, 128, 2, False, 69330, 354412544),
    PublishedRun("125m", 8192, 8, 8, 2, False, 90392, 130030080),
    PublishedRun("125m", 4096, 8, 16, 2, False, 118396, 126884352),
    PublishedRun("125m", 2048, 8, 40, 2, False, 142830, 125311488),
    PublishedRun("125m", 2048, 8, 32, 2, False, 141737, 125311488),
    PublishedRun("125m", 1024, 8, 64, 2, False, 156468, 124525056),
    PublishedRun("125m", 512, 8, 128, 2, False, 165681, 124131840),
)

_H = "h100-80gb"
# "H100 80GB BF16 (Large Scale, >= 128 GPUs)" then "H100 80GB BF16", every row with a
# sequence of at most 8192 (the A100 table's bound)
LLM_FOUNDRY_H100 = (
    PublishedRun("70b", 2048, 512, 8, 1, True, 1007, 64862437376, _H),
    PublishedRun("70b", 2048, 256, 8, 1, True, 1035, 64862437376, _H),
    PublishedRun("70b", 2048, 128, 8, 1, True, 1058, 64862437376, _H),
    PublishedRun("30b", 2048, 512, 8, 1, True, 2115, 29975214080, _H),
    PublishedRun("30b", 2048, 256, 8, 1, True, 2148, 29975214080, _H),
    PublishedRun("30b", 2048, 128, 8, 1, True, 2199, 29975214080, _H),
    PublishedRun("13b", 2048, 512, 16, 1, True, 4952, 12853954560, _H),
    PublishedRun("13b", 2048, 256, 16, 1, True, 4989, 12853954560, _H),
    PublishedRun("13b", 2048, 128, 16, 1, True, 5080, 12853954560, _H),
    PublishedRun("7b", 2048, 512, 6, 1, False, 9670, 6658859008, _H),
    PublishedRun("7b", 2048, 256, 6, 1, False, 10119, 6658859008, _H),
    PublishedRun("7b", 2048, 128, 6, 1, False, 10475, 6658859008, _H),
    PublishedRun("3b", 2048, 512, 8, 1, False, 21664, 2651837440, _H, zero=2),
    PublishedRun("3b", 2048, 256, 8, 1, False, 22772, 2651837440, _H, zero=2),
    PublishedRun("3b", 2048, 128, 8, 1, False, 23422, 2651837440, _H, zero=2),
    PublishedRun("1b", 2048, 512, 12, 1, False, 39837, 1315950592, _H, zero=2),
    PublishedRun("1b", 2048, 256, 12, 1, False, 42555, 1315950592, _H, zero=2),
    PublishedRun("1b", 2048, 128, 12, 1, False, 44123, 1315950592, _H, zero=2),
    PublishedRun("70b", 2048, 64, 8, 4, True, 1039, 64862437376, _H),
    PublishedRun("70b", 2048, 32, 2, 16, True, 882, 64862437376, _H),
    PublishedRun("30b", 8192, 8, 1, 21, True, 1384, 30019254272, _H),
    PublishedRun("30b", 4096, 8, 1, 21, True, 1802, 29989894144, _H),
    PublishedRun("30b", 2048, 32, 14, 3, True, 2308, 29975214080, _H),
    PublishedRun("30b", 2048, 16, 10, 3, True, 2263, 29975214080, _H),
    PublishedRun("30b", 2048, 8, 3, 21, True, 2002, 29975214080, _H),
    PublishedRun("30b", 1024, 8, 6, 21, True, 2084, 29967874048, _H),
    PublishedRun("13b", 4096, 8, 10, 3, True, 4717, 12864440320, _H),
    PublishedRun("13b", 2048, 64, 2, 1, False, 4800, 12853954560, _H),
    PublishedRun("13b", 2048, 32, 2, 1, False, 4811, 12853954560, _H),
    PublishedRun("13b", 2048, 16, 2, 1, False, 4767, 12853954560, _H),
    PublishedRun("13b", 2048, 8, 2, 1, False, 4792, 12853954560, _H),
    PublishedRun("13b", 1024, 8, 40, 3, True, 5502, 12848711680, _H),
    PublishedRun("7b", 8192, 8, 8, 2, True, 6935, 6684024832, _H),
    PublishedRun("7b", 4096, 8, 16, 2, True, 8611, 6667247616, _H),
    PublishedRun("7b", 2048, 8, 6, 1, False, 10643, 6658859008, _H),
    PublishedRun("7b", 1024, 8, 64, 2, True, 10203, 6654664704, _H),
    PublishedRun("3b", 8192, 8, 3, 6, False, 16578, 2667566080, _H),
    PublishedRun("3b", 4096, 8, 5, 6, False, 20964, 2657080320, _H),
    PublishedRun("3b", 2048, 64, 6, 3, False, 22525, 2651837440, _H),
    PublishedRun("3b", 2048, 32, 6, 3, False, 23021, 2651837440, _H),
    PublishedRun("3b", 2048, 16, 10, 3, False, 24142, 2651837440, _H),
    PublishedRun("3b", 1024, 8, 20, 6, False, 27046, 2649216000, _H),
    PublishedRun("3b", 512, 8, 40, 6, False, 27965, 2647905280, _H),
    PublishedRun("1b", 8192, 8, 3, 4, False, 29157, 1328533504, _H),
    PublishedRun("1b", 4096, 8, 7, 4, False, 38535, 1320144896, _H),
    PublishedRun("1b", 2048, 64, 20, 1, False, 44402, 1315950592, _H),
    PublishedRun("1b", 2048, 32, 20, 1, False, 45130, 1315950592, _H),
    PublishedRun("1b", 2048, 16, 20, 1, False, 46037, 1315950592, _H),
    PublishedRun("1b", 2048, 8, 14, 1, False, 45455, 1315950592, _H),
    PublishedRun("1b", 1024, 8, 18, 4, False, 48910, 1313853440, _H),
    PublishedRun("1b", 512, 8, 56, 4, False, 52275, 1312804864, _H),
    PublishedRun("760m", 8192, 8, 6, 2, False, 41825, 769907712, _H),
    PublishedRun("760m", 4096, 8, 12, 2, False, 55459, 763616256, _H),
    PublishedRun("760m", 2048, 32, 24, 1, False, 67971, 760470528, _H),
    PublishedRun("760m", 2048, 16, 24, 1, False, 68551, 760470528, _H),
    PublishedRun("760m", 2048, 8, 24, 2, False, 63147, 760470528, _H),
    PublishedRun("760m", 1024, 8, 48, 2, False, 78581, 758897664, _H),
    PublishedRun("760m", 512, 8, 96, 2, False, 83749, 758111232, _H),
)

LLM_FOUNDRY_H100_SOURCE = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md @ "
                           "8c8dd48f, 'H100 80GB BF16 (Large Scale, >= 128 GPUs)' and "
                           "'H100 80GB BF16'")

LLM_FOUNDRY_TABLES = (
    PublishedTable("llm_foundry_a100", LLM_FOUNDRY_SOURCE,
                   tuple(r.row() for r in LLM_FOUNDRY_A100),
                   "rows of sequences over 8192 (16k to 64k)"),
    PublishedTable("llm_foundry_h100", LLM_FOUNDRY_H100_SOURCE,
                   tuple(r.row() for r in LLM_FOUNDRY_H100),
                   "rows of sequences over 8192 (16k to 64k: 13 rows) and the FP8 table "
                   "(the planner prices bf16 matmuls only)"),
)

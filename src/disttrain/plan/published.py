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

The MPT models (the table's yamls, ``scripts/train/yamls/pretrain/mpt-*.yaml``):
vocabulary 50368, MLP 4 x d_model (GELU), learned positions, LayerNorm and linear
layers with biases, tied embedding, no dropout; the parameter counts equal the table's
(``NumParams``) for every row.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import OPTIONS, PlannedLayout
from .shape import ModelShape

_OPTION_NAMES = {o.name for o in OPTIONS}

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
class PublishedRun:
    """One row: model size, sequence, GPUs, micro-batch, accumulation, activation
    checkpointing, the published tokens per second per GPU, and the parameters."""

    model: str
    seq: int
    gpus: int
    mbs: int
    accumulation: int
    checkpointing: bool
    tokens_per_s_per_gpu: float
    num_params: int

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
        """The published layout: FSDP full shard over every GPU (ZeRO-3), whole-block
        recomputation when checkpointing."""
        return PlannedLayout.whole(self.gpus, mbs=self.mbs, zero=3,
                                   recompute="full" if self.checkpointing else "none")

    def cluster_spec(self) -> str:
        """``--cluster``: A100 80GB nodes of 8 (1600 Gb/s per node: 8 x 200 Gb/s, the
        preset's NIC per GPU), FlashAttention 1."""
        extra = ",".join(f"{k}={v}" for k, v in FLASH_ATTENTION_1.items())
        return f"gpu=a100-80gb,gpus_per_node=8,nodes={max(1, self.gpus // 8)},{extra}"

    def layout_spec(self) -> str:
        """``--layout`` as ``disttrain plan`` takes it."""
        return ",".join(f"{k}={v}" for k, v in self.layout().items(shown=True)
                        if k not in _OPTION_NAMES)


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

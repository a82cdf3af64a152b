"""Published runs with tensor, pipeline and context layouts (never fitted to).

**Megatron-LM's scaling table on H100** (github.com/NVIDIA/Megatron-LM, ``README.md``
section "Performance Benchmarking", the table image ``images/model_table.png``, read at
commit d98e8a64, 2026-08-22; first published in commit f2e5db40, 2024-07-15): GPT
models of 1.7B to 462B parameters, vocabulary 131072, sequence 4096, each row's
attention heads, hidden size, layers, tensor / pipeline / data-parallel sizes, GPUs,
global batch and per-GPU TFLOP/s, which the table's MFU column shows are model FLOPs
(408.8 / 989 = 41%). The parameter counts the sizes name are those of a GELU MLP of
4 x hidden and untied embeddings (7.1B: 12 x 30 x 4096^2 + 2 x 131072 x 4096), so that
is the model; the micro-batch and the recomputation are not given (the planner
chooses them); attention is Transformer Engine's fused kernel.

**Megatron-LM's scaling table on A100** (the same README at commit 2e90a342, 2022-05-19,
the table image ``images/cases_april2021.png``, from Narayanan et al. 2021, arXiv
2104.04473): GPT models of 1.7B to 1T parameters, vocabulary 51200, sequence 2048,
hidden size, layers, *model-parallel size*, GPUs, batch and achieved TFLOP/s per GPU,
which Narayanan et al. count with the recomputation's forward (full recomputation,
their formula 96Bslh^2(1 + s/6h + V/16lh)). The image gives tensor x pipeline as one
product: the split here takes tensor parallelism within a node, ``tp = min(mp, 8)``,
``pp = mp / tp`` (as the paper's 1T run, tp 8 x pp 64, does), an inference the table
does not state. Heads are not in the table: 128 per head is assumed (heads change only
the unfused attention's score memory, 5as^2b per layer, and which tp degrees divide
them). Attention is unfused (2021), dropout 0.1, learned positions, tied embedding.

**torchtitan's Llama 3.1 benchmarks** (github.com/pytorch/torchtitan,
``benchmarks/llama3_h100_202412_torchtitan.md``, read at commit b5bcd76c, 2026-08-21;
measured with torchtitan 9dec370, torch 1963fc8, December 2024): Table 1 and Table 3,
row "FSDP" (bf16, eager): Llama 3.1 8B on 8 and 128 H100s, local batch 2, sequence 8192
(``train_configs/llama3_8b.toml`` at 9dec370), selective activation checkpointing.
Their H100s are the 96 GB HBM2e part at 2.4 TB/s and a 500 W limit, whose peak the
page says lies between the SXM's and the NVL's: the SXM preset with that memory. The
other rows use torch.compile or Float8, which the planner does not price: left out.

**Korthikanti et al. 2022** (arXiv 2205.05198): its full / selective recomputation
tables could not be read here (the paper is not in this machine's reach); the README
copy of its MFU / HFU figures (Megatron-LM at 2e90a342: 22B to 1T, "measured using a
data parallel size of one") gives no layouts. Left out.
"""

from __future__ import annotations

from ..shape import ModelShape
from .layout import PlannedLayout
from .options import Options
from .published import PublishedTable, TableRow

MEGATRON_H100_SOURCE = ("NVIDIA/Megatron-LM README.md @ d98e8a64 (since f2e5db40), "
                        "'Performance Benchmarking', images/model_table.png")
MEGATRON_A100_SOURCE = ("NVIDIA/Megatron-LM README.md @ 2e90a342, "
                        "images/cases_april2021.png (Narayanan et al. 2021)")
TORCHTITAN_SOURCE = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ "
                     "b5bcd76c, Tables 1 and 3, row 'FSDP'")

# Megatron-LM replicates its model states or shards the optimizer's (its distributed
# optimizer, ZeRO-1); it has no ZeRO-2 or 3
MEGATRON_ZERO = (0, 1)
# what Megatron-LM did not have: zero-bubble schedules (Qi et al. 2023's are a fork's,
# sail-sg/zero-bubble-pipeline-parallelism), and in 2021 (Narayanan et al.) sequence
# parallelism (Korthikanti et al. 2022) and context parallelism (Megatron-Core, 2024)
MEGATRON_HELD = (("zb", 0),)
MEGATRON_2021_HELD = (("cp", 1), ("sp", 0), ("zb", 0))

# the README's "Communication optimizations": --overlap-grad-reduce (disttrain's
# buckets do as much), --overlap-param-gather, --tp-comm-overlap
MEGATRON_OVERLAPS = Options(accounting="mixed", layer_comm_overlap=True,
                            param_gather_overlap=True, fused_loss=False)

# size, heads, hidden, layers, tp, pp, dp, GPUs, global batch, TFLOP/s per GPU
_MEGATRON_H100 = (
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
)

# size, hidden, layers, model-parallel size, GPUs, batch, achieved TFLOP/s per GPU
_MEGATRON_A100 = (
    ("1.7B", 2304, 24, 1, 32, 512, 137.0),
    ("3.6B", 3072, 30, 2, 64, 512, 138.0),
    ("7.5B", 4096, 36, 4, 128, 512, 142.0),
    ("18B", 6144, 40, 8, 256, 1024, 135.0),
    ("39B", 8192, 48, 16, 512, 1536, 138.0),
    ("76B", 10240, 60, 32, 1024, 1792, 140.0),
    ("145B", 12288, 80, 64, 1536, 2304, 148.0),
    ("310B", 16384, 96, 128, 1920, 2160, 155.0),
    ("530B", 20480, 105, 280, 2520, 2520, 163.0),
    ("1T", 25600, 128, 512, 3072, 3072, 163.0),
)


def _nodes(gpus: int) -> int:
    return max(1, gpus // 8)


def megatron_h100_rows() -> tuple[TableRow, ...]:
    rows = []
    for size, heads, h, layers, tp, pp, dp, gpus, batch, tflops in _MEGATRON_H100:
        shape = ModelShape(name=f"gpt-{size}", layers=layers, hidden=h, heads=heads,
                           seq=4096, vocab=131072, tied=False, positions=0, flash=True)
        rows.append(TableRow(f"megatron-h100 {size} tp{tp} pp{pp} dp{dp}", shape,
                             f"gpu=h100-80gb,gpus_per_node=8,nodes={_nodes(gpus)}",
                             PlannedLayout(tp=tp, pp=pp, dp=dp), batch, tflops,
                             metric="tflops_per_gpu", degrees_only=True,
                             zero_choices=MEGATRON_ZERO, held=MEGATRON_HELD,
                             options=MEGATRON_OVERLAPS))
    return tuple(rows)


def megatron_a100_rows() -> tuple[TableRow, ...]:
    rows = []
    for size, h, layers, mp, gpus, batch, tflops in _MEGATRON_A100:
        tp = min(mp, 8)
        pp, dp = mp // tp, gpus // mp
        shape = ModelShape(name=f"gpt-{size}", layers=layers, hidden=h, heads=h // 128,
                           seq=2048, vocab=51200, positions=2048, dropout=True,
                           flash=False)
        rows.append(TableRow(f"megatron-a100 {size} tp{tp} pp{pp} dp{dp}", shape,
                             f"gpu=a100-80gb,gpus_per_node=8,nodes={_nodes(gpus)}",
                             PlannedLayout(tp=tp, pp=pp, dp=dp, recompute="full"), batch,
                             tflops, metric="tflops_per_gpu", hardware=True,
                             degrees_only=True, zero_choices=MEGATRON_ZERO,
                             held=MEGATRON_2021_HELD))
    return tuple(rows)


LLAMA31_8B = ModelShape(name="llama-3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8,
                        ffn=14336, seq=8192, vocab=128256, gated=True, bias=False,
                        qkv_bias=False, norm="rmsnorm", tied=False, positions=0)
# the 96 GB HBM2e H100 of Meta's Grand Teton hosts (the page's "Hardware")
_TITAN_H100 = "gpu=h100-80gb,gpus_per_node=8,memory_gib={gib:.2f},memory_gbps=2400,nodes={n}"


def torchtitan_rows() -> tuple[TableRow, ...]:
    rows = []
    for gpus, tokens in ((8, 5762.0), (128, 5605.0)):
        cluster = _TITAN_H100.format(gib=96e9 / 2**30, n=_nodes(gpus))
        rows.append(TableRow(f"torchtitan llama-3.1-8b fsdp x{gpus}", LLAMA31_8B, cluster,
                             PlannedLayout(dp=gpus, zero=3, mbs=2, recompute="selective"),
                             2 * gpus, tokens,
                             recompute_choices=("none", "selective", "full")))
    return tuple(rows)


LAYOUT_TABLES = (
    PublishedTable("megatron_h100", MEGATRON_H100_SOURCE, megatron_h100_rows(),
                   "nothing: every row (micro-batch and recomputation not published)"),
    PublishedTable("megatron_a100", MEGATRON_A100_SOURCE, megatron_a100_rows(),
                   "nothing; tp x pp split and heads inferred (see the module)"),
    PublishedTable("torchtitan_h100", TORCHTITAN_SOURCE, torchtitan_rows(),
                   "torch.compile and Float8 rows, Tables 2, 4, 5, 6 (all Float8)"),
)

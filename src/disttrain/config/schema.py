"""Typed configuration: one keyword-only dataclass per component.

Each component receives only its own section. Field metadata carries the range checks
and the help text shown by ``disttrain train --help``; ``consistency.py`` applies the
checks that span several fields (the batch triple, the layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..names import (
    BAD_EXAMPLE_ERROR,
    BAD_EXAMPLE_SKIP,
    CODEC_NONE,
    CODECS,
    DATA_FORMATS,
    DATA_TEXT,
    LOGGERS,
    NONFINITE_SKIP,
    NONFINITE_STOP,
    OPTIMIZER_ADAMW,
    OPTIMIZERS,
    SCHEDULE_1F1B,
    SCHEDULES,
    SYNC_EVERY_STEP,
    SYNC_MODES,
    TRACE_FILE,
)

# Upper bounds that keep a value finite and usable: a bucket beyond any device's memory
# buys nothing; a collective that waits a week is hung.
MAX_BUCKET_MB = 65536.0
MAX_ZERO_PREFETCH = 8  # blocks gathered ahead under ZeRO-3: past a few, only memory grows
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _f(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
       le: float | None = None, choices: tuple[str, ...] | None = None,
       optional: bool = False, key: str | None = None, registered: bool = False) -> Any:
    """A dataclass field with its help text and the bounds the validator checks;
    ``key`` is the config name when it differs from the attribute (``async``);
    ``registered``: ``choices`` are the built-in ones, more can be registered
    (:mod:`disttrain.parallel.registry` checks the name when the run is resolved)."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices,
            "optional": optional, "key": key, "registered": registered}
    return field(default=default, metadata=meta)


def config_key(f: Any) -> str:
    """The name a field has in TOML and --set."""
    return f.metadata.get("key") or f.name


@dataclass(kw_only=True)
class ModelConfig:
    """The model the command line trains: disttrain's byte-level GPT, a Hugging Face
    GPT-2 / Llama built with the same dimensions or any causal LM from a config.json
    (seeded random init), or a pretrained Hugging Face directory (its weights); the
    transformers ones need the `hf` extra."""

    name: str = _f("gpt", "model family: gpt (disttrain's), gpt2 or llama (transformers "
                   "models with these dimensions; needs transformers: pip install -e '.[hf]')",
                   choices=("gpt", "gpt2", "llama"))
    hf_config: str = _f("", "path to a transformers config.json: trains that model "
                        "(random init) instead of model.name")
    pretrained: str = _f("", "a transformers model directory (config.json and "
                         "model.safetensors, or shards with an index): trains from its "
                         "weights; its config.json sets the family and dimensions")
    n_kv_head: int = _f(0, "llama: key/value heads (grouped-query attention); 0 = n_head",
                        ge=0)
    vocab_size: int = _f(256, "vocabulary size (256 for byte-level tokens)", ge=2)
    seq_len: int = _f(128, "context length in tokens", ge=1)
    n_layer: int = _f(4, "number of transformer blocks", ge=1)
    n_head: int = _f(4, "attention heads per block", ge=1)
    d_model: int = _f(128, "model width (must be divisible by n_head)", ge=1)
    dropout: float = _f(0.0, "dropout probability", ge=0.0, le=1.0)
    lora_rank: int = _f(0, "LoRA: train rank-r adapters beside the targeted linear layers, "
                        "everything else frozen; checkpoints hold the adapters only (the "
                        "base comes from model.pretrained); 0 = train every weight",
                        ge=0, le=4096)
    lora_alpha: float = _f(16.0, "LoRA: the adapters' update is scaled by lora_alpha / "
                           "lora_rank", gt=0.0)
    lora_dropout: float = _f(0.0, "LoRA: dropout on the adapters' input", ge=0.0, le=1.0)
    lora_targets: tuple[str, ...] = _f((), "LoRA: the linear layers to adapt, as name "
                                       "patterns (a full module name or its last part, "
                                       "e.g. [\"q_proj\", \"v_proj\"]); empty = the "
                                       "attention and MLP projections")


@dataclass(kw_only=True)
class DataConfig:
    """Where training text (or instruction and chat examples) comes from and where its
    tokens are cached."""

    path: str = _f("", "directory of text files; empty = the Python standard library's "
                   "own source files (data.format=jsonl: a .jsonl file, a directory of "
                   "them, or a datasets dataset written by save_to_disk)")
    pattern: str = _f("**/*", "glob of files to read under data.path")
    cache_dir: str = _f("", "where token shards are written; empty = "
                        "$DISTTRAIN_CACHE or ~/.cache/disttrain")
    val_fraction: float = _f(0.05, "fraction of files held out for evaluation (jsonl: of "
                             "examples)", gt=0.0, le=0.5)
    format: str = _f(DATA_TEXT, "text: files tokenized as bytes and cached; tokens: "
                     "pre-tokenized shards (.bin / .npy) under data.path, memory-mapped "
                     "in place (files named val* held out); jsonl: prompt/completion or "
                     "chat-messages examples, tokenized once (chat through the "
                     "tokenizer's chat template) and cached, trained on the completion "
                     "and assistant tokens only", choices=DATA_FORMATS)
    token_dtype: str = _f("uint16", "dtype of .bin token shards (data.format=tokens)",
                          choices=("uint16", "uint32"))
    tokenizer: str = _f("bytes", "text to ids (data.format=text): bytes, the path of a "
                        "Hugging Face tokenizer.json, or bpe:N (a byte-level BPE of N "
                        "tokens trained on the training split, cached with the shards); "
                        "data.format=jsonl: a transformers tokenizer directory, or bytes "
                        "for model.pretrained's own tokenizer")
    truncate: bool = _f(False, "data.format=jsonl: an example longer than model.seq_len "
                        "is cut to its first seq_len tokens (true) or is a bad example "
                        "(false)")
    on_bad_example: str = _f(BAD_EXAMPLE_ERROR, "data.format=jsonl: a malformed, "
                             "unknown-role, too long or untrainable example stops "
                             "preparation (error: exit 2 naming file and line) or is "
                             "skipped, counted and reported (skip)",
                             choices=(BAD_EXAMPLE_ERROR, BAD_EXAMPLE_SKIP))
    workers: int = _f(0, "loader worker processes per rank assembling micro-batches "
                      "ahead of use (0: in the training process); the samples and their "
                      "order do not change", ge=0, le=64)
    packing: bool = _f(False, "concatenate examples (samples of input_ids and labels of "
                       "any length up to model.seq_len) into rows of model.seq_len tokens, "
                       "positions restarting and attention kept inside each example, so "
                       "each example's loss is what it is alone; train.global_batch then "
                       "counts packed rows (fixed by train.seed, the same on any number "
                       "of ranks), the loss stays normalised by the trained tokens")


@dataclass(kw_only=True)
class TrainConfig:
    """The optimisation loop: batch, schedule, optimizer, evaluation, logging."""

    steps: int = _f(250, "optimizer steps", ge=1)
    global_batch: int | None = _f(32, "samples per optimizer step over all ranks "
                                  "(= micro_batch x grad_accum x dp)", ge=1, optional=True)
    micro_batch: int | None = _f(None, "samples per forward pass on one rank", ge=1,
                                 optional=True)
    grad_accum: int | None = _f(1, "micro-batches accumulated per step", ge=1,
                                optional=True)
    lr: float = _f(3e-3, "peak learning rate", gt=0.0)
    min_lr_ratio: float = _f(0.1, "final LR as a fraction of the peak", ge=0.0, le=1.0)
    warmup_steps: int = _f(20, "linear warmup steps", ge=0)
    schedule: str = _f("cosine", "LR schedule after warmup",
                       choices=("cosine", "linear", "constant"))
    lr_scaling: str = _f("none", "scale lr with the global batch (linear: lr x "
                         "global_batch / base_batch)", choices=("none", "linear"))
    base_batch: int = _f(32, "global batch at which train.lr applies unscaled", ge=1)
    optimizer: str = _f(OPTIMIZER_ADAMW, "optimizer: adamw, sgd (momentum), lars (momentum SGD "
                        "with a layer-wise trust ratio), lamb (AdamW with one) or "
                        "onebit_adam (AdamW, then a frozen variance and the momentum "
                        "averaged over dp in 1 bit per element after train.freeze_step)",
                        choices=OPTIMIZERS, registered=True)
    freeze_step: int = _f(0, "onebit_adam: dense AdamW steps before the variance is "
                          "frozen and the momentum compressed; 0 = 15% of train.steps",
                          ge=0)
    trust_coefficient: float = _f(0.001, "lars: eta in the layer-wise rate eta x ||w|| / "
                                  "||g + wd w|| (lamb uses the plain ratio)", gt=0.0)
    weight_decay: float = _f(0.1, "decoupled weight decay (matrices only)", ge=0.0)
    beta1: float = _f(0.9, "AdamW beta1", ge=0.0, le=1.0)
    beta2: float = _f(0.95, "AdamW beta2", ge=0.0, le=1.0)
    momentum: float = _f(0.9, "SGD momentum", ge=0.0, le=1.0)
    grad_clip: float = _f(1.0, "clip gradients to this global norm; 0 = off", ge=0.0)
    on_nonfinite: str = _f(NONFINITE_STOP, "a step whose loss or gradient norm is nan/inf: "
                           "stop (exit code 3, nothing saved from it) or skip its "
                           "update (counted in metrics); fp16 loss scaling skips "
                           "gradient overflows itself",
                           choices=(NONFINITE_STOP, NONFINITE_SKIP))
    seed: int = _f(1234, "seed for initialisation and the sample order", ge=0)
    eval_every: int = _f(0, "evaluate on held-out data every N steps (and before the "
                         "first and after the last); 0 = auto, about 10 times a run on "
                         "logged steps; N >= train.steps: at start and end only (the "
                         "async parameter server evaluates at start and end only)", ge=0)
    eval_samples: int = _f(256, "held-out samples per evaluation", ge=1)
    log_every: int = _f(10, "write a metrics record every N steps", ge=1)
    device: str = _f("auto", "cpu, cuda or auto (cuda when available)",
                     choices=("auto", "cpu", "cuda"))
    precision: str = _f("fp32", "forward precision; master weights and optimizer state "
                        "stay fp32 (fp16 uses dynamic loss scaling, GPU only)",
                        choices=("fp32", "bf16", "fp16"))
    activation_checkpointing: str = _f("none", "recompute block activations in backward: "
                                       "none, full (every block) or every_k",
                                       choices=("none", "full", "every_k"))
    activation_checkpointing_k: int = _f(2, "with every_k: checkpoint blocks 0, k, 2k, ...",
                                         ge=1)
    compile: bool = _f(False, "compile each block of the model with torch.compile "
                       "(inductor; on CPU it needs a C++ compiler); refused under "
                       "parallel.tp > 1 and for a model with no block list")
    fused_loss: bool = _f(True, "compute the causal-LM loss with the output head's matmul, "
                          "chunk by chunk over the tokens, so the [tokens, vocabulary] "
                          "logits never exist whole (also vocabulary-parallel under tp); "
                          "applies with the default loss to a model whose spec names its "
                          "output head (the built-in GPT, transformers causal LMs whose "
                          "logits are the head's output unchanged); the start-up banner "
                          "says whether it is on")
    sync: str = _f(SYNC_EVERY_STEP, "how dp replicas synchronise: every_step (gradient "
                   "all-reduce), local_sgd (average parameters every sync_every steps), "
                   "diloco (outer Nesterov step every sync_every steps), async (parameter "
                   "servers), fedavg (federated averaging over non-IID partitions)",
                   choices=SYNC_MODES, registered=True)
    sync_every: int = _f(50, "local_sgd/diloco/fedavg: local steps per synchronisation "
                         "round (H)", ge=1)
    outer_lr: float = _f(0.7, "diloco: outer SGD learning rate", gt=0.0)
    outer_momentum: float = _f(0.5, "diloco: momentum of the outer Nesterov SGD "
                               "(0 = plain outer SGD)", ge=0.0, le=0.999)
    ps_servers: int = _f(1, "async: ranks 0..ps_servers-1 serve parameter shards, the "
                         "rest are workers", ge=1)
    ps_accumulate: int = _f(0, "async: a server steps once per this many accepted "
                            "pushes (their mean); 0 = one per worker, i.e. the "
                            "synchronous global batch per update; 1 = every push", ge=0)
    staleness_bound: int = _f(4, "async: a gradient computed on parameters more than this "
                              "many versions old is dropped", ge=0)
    fed_fraction: float = _f(1.0, "fedavg: fraction of clients chosen (seeded) each round",
                             gt=0.0, le=1.0)


@dataclass(kw_only=True)
class ParallelConfig:
    """The layout of ranks and how gradients are reduced."""

    dp: int = _f(0, "data-parallel degree; 0 = all ranks not used by pp x tp x cp", ge=0)
    pp: int = _f(1, "pipeline-parallel degree", ge=1)
    tp: int = _f(1, "tensor-parallel degree", ge=1)
    cp: int = _f(1, "context-parallel degree: each sequence split over cp ranks (rank i "
                 "holds chunks i and 2cp-1-i of 2cp), attention computed as a ring; the "
                 "sequence must be a multiple of 2 x cp", ge=1)
    zero: int = _f(0, "ZeRO sharding stage over the replicas, dp x cp (0 = none)", ge=0,
                   le=3)
    zero_prefetch: int = _f(1, "ZeRO-3: blocks whose parameters are gathered ahead of "
                            "the running one (at most 1 + this many held at once; 0: "
                            "each gathered only when needed)", ge=0, le=MAX_ZERO_PREFETCH)
    strategy: str = _f("auto", "how dp replicas share gradients and training state: auto "
                       "(zero when parallel.zero > 0, local when train.sync is not "
                       "every_step, else ddp), ddp, zero, local, or a name registered "
                       "with disttrain.parallel.register_strategy")
    bucket_mb: float = _f(25.0, "gradient bucket size in MiB for the all-reduce", gt=0.0,
                          le=MAX_BUCKET_MB)
    grad_reduce_dtype: str = _f("fp32", "dtype gradients travel in (bf16 halves the bytes)",
                                choices=("fp32", "bf16"))
    backend: str = _f("auto", "process-group backend: auto (nccl on GPU, gloo on CPU), "
                      "gloo or nccl", choices=("auto", "gloo", "nccl"))
    timeout_s: float = _f(300.0, "a collective that waits longer fails the job instead of "
                          "hanging (seconds)", gt=0.0, le=MAX_TIMEOUT_S)
    balance: str = _f("static", "split of each global batch over dp ranks: static (even) "
                      "or dynamic (in proportion to measured throughput)",
                      choices=("static", "dynamic"))
    pp_schedule: str = _f(SCHEDULE_1F1B, "pipeline schedule when pp > 1: gpipe, 1f1b, "
                          "interleaved, zb1 or zbv (zero-bubble; micro-batches per step "
                          "= train.grad_accum)",
                          choices=SCHEDULES)
    pp_virtual: int = _f(2, "interleaved: model chunks (virtual stages) per pipeline rank",
                         ge=1)
    pp_split: str = _f("auto", "where pipeline chunks begin: auto (balance the estimated "
                       "cost per block) or block indices, e.g. '0,3,5'")
    sequence_parallel: bool = _f(False, "tp > 1: norms and dropout on sequence shards "
                                 "(reduce-scatter / all-gather instead of all-reduce)")
    tp_check_grads: bool = _f(True, "tp > 1: at the first step, compare across the tp "
                              "ranks the gradients of the parameters every tp rank should "
                              "compute alike, and stop before the update naming any that "
                              "differ (one small all-gather, once per run)")
    fault_tolerance: str = _f("none", "none, or replica: the job runs as parallel.replicas "
                              "replica groups (torchft; needs the ft extra) that keep "
                              "stepping when one fails; a failed group restarts and takes "
                              "the current state from a live peer", choices=("none", "replica"))
    replicas: int = _f(2, "fault_tolerance = replica: the number of replica groups; the "
                       "global batch is split over those present at each step", ge=1)
    lighthouse: str = _f("", "fault_tolerance = replica: http://HOST:PORT of a running "
                         "torchft_lighthouse (empty: disttrain train starts one)")
    ft_heartbeat_s: float = _f(5.0, "fault_tolerance = replica, the lighthouse disttrain "
                               "train starts: a replica group silent this long leaves the "
                               "quorum (a loaded machine needs more)", gt=0.0)
    ft_rejoin_s: float = _f(120.0, "fault_tolerance = replica: how long a restarted group "
                            "waits for a live peer to heal from (then it stops, never "
                            "trains alone), the first step for every group to start, "
                            "and a finished group for missing ones to rejoin", gt=0.0)


@dataclass(kw_only=True)
class CommConfig:
    """Gradient compression for the data-parallel all-reduce."""

    codec: str = _f(CODEC_NONE, "gradient codec: none, fp16, bf16, topk, randomk, powersgd, "
                    "onebit or qsgd", choices=CODECS)
    topk_ratio: float = _f(0.01, "topk: fraction of each bucket's entries sent", gt=0.0,
                           le=1.0)
    randomk_ratio: float = _f(0.01, "randomk: fraction of each bucket's entries sent",
                              gt=0.0, le=1.0)
    powersgd_rank: int = _f(4, "powersgd: rank of each gradient matrix's approximation",
                            ge=1)
    powersgd_warm_start: bool = _f(True, "powersgd: reuse the previous step's Q")
    powersgd_batched: bool = _f(False, "powersgd: factorise each whole bucket as one "
                                "near-square matrix (~sqrt(n) / 2r times fewer bytes; "
                                "coarser) instead of each weight matrix")
    onebit_block: int = _f(128, "onebit: elements per scale (blocks of a tensor; 1.25 "
                           "bits per element at 128); 0 = one scale per tensor", ge=0)
    qsgd_levels: int = _f(127, "qsgd: quantisation levels of |x| / ||x|| (int8 on the "
                          "wire whatever the count, so the most int8 holds is the "
                          "default; fewer only add variance)", ge=1, le=127)
    error_feedback: bool = _f(True, "topk, onebit, powersgd: add what was not sent to the "
                              "next step's gradient (the unbiased codecs do not use it)")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Sharded, atomic checkpoints in ``run_dir/checkpoints``."""

    every: int = _f(50, "save every N steps and at the end; 0 = never", ge=0)
    keep: int = _f(3, "committed checkpoints kept", ge=1)
    async_: bool = _f(True, "copy and write in a background thread; training waits for "
                      "the copy only before its next optimizer step", key="async")
    on_signal: str = _f("save", "on SIGTERM / SIGINT: save a checkpoint after the current "
                        "step, then exit 143 / 130 (save), or exit without saving (exit)",
                        choices=("save", "exit"))
    allow_changes: bool = _f(False, "resume even when the seed, model, data or global "
                             "batch differ from the checkpoint's")


@dataclass(kw_only=True)
class MonitorConfig:
    """Metrics, timeline, hang and straggler diagnostics."""

    hang_timeout: float = _f(120.0, "a collective waiting longer than this (s) is a hang: "
                             "ranks report where they are and the job exits; 0 = off",
                             ge=0.0)
    trace: bool = _f(False, f"record a Chrome-trace timeline of every rank ({TRACE_FILE})")
    straggler_threshold: float = _f(0.25, "a rank whose compute time exceeds the median "
                                    "by this fraction is slow", gt=0.0)
    straggler_window: int = _f(3, "consecutive logged steps a rank must be slow to be "
                               "named a straggler", ge=1)
    peak_tflops: float = _f(0.0, "peak TFLOP/s per rank for MFU; 0 = the GPU's published "
                            "dense peak at the run's precision, else a matmul measured at "
                            "start (the records' peak_source says which)", ge=0.0)
    tensorboard: bool = _f(True, "also write TensorBoard events when tensorboard is "
                           "installed (monitor.loggers=[\"tensorboard\"] requires it)")
    loggers: tuple[str, ...] = _f((), "metrics loggers beside metrics.jsonl, e.g. "
                                  "[\"csv\", \"wandb\"] (wandb, mlflow: their extras)",
                                  choices=LOGGERS)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "comm": CommConfig,
    "checkpoint": CheckpointConfig,
    "monitor": MonitorConfig,
}


@dataclass(kw_only=True)
class Config:
    """The whole configuration: one section per component.

    ``explicit`` holds the dotted keys the user set (in a file or with --set); the
    batch triple uses it to tell given values from defaults.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    explicit: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section as ``{section: {key: value}}``, under the names TOML and ``--set`` use."""
        return {name: {config_key(f): getattr(getattr(self, name), f.name)
                       for f in fields(cls)}
                for name, cls in SECTIONS.items()}

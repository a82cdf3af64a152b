"""Names that several modules must agree on, each defined once here.

A config choice (a pipeline schedule, a gradient codec, a sync mode) is checked by the
config schema, dispatched on by the strategy that implements it and compared against by
the trainer and the validator; a file in the run directory is written by one module and
read by another (the report, a resumed run, ``disttrain export``). Spelling any of them
twice lets the copies drift apart silently, so they all import from here.

This module imports nothing from disttrain: ``config/schema.py`` sits at the bottom of
the layers and takes its ``choices`` from here.
"""

from __future__ import annotations

# ----------------------------------------------------------- pipeline schedules
SCHEDULE_GPIPE = "gpipe"
SCHEDULE_1F1B = "1f1b"
SCHEDULE_INTERLEAVED = "interleaved"  # several chunks per stage, looped placement
SCHEDULE_ZB1 = "zb1"  # zero-bubble ZB-H1: 1F1B's order, backward split into B and W
SCHEDULE_ZBV = "zbv"  # zero-bubble V: two chunks per stage in a V, split backward
SCHEDULES = (SCHEDULE_GPIPE, SCHEDULE_1F1B, SCHEDULE_INTERLEAVED, SCHEDULE_ZB1, SCHEDULE_ZBV)

# ----------------------------------------------------------- gradient codecs
CODEC_NONE = "none"  # the plain all-reduce: no codec object at all
CODEC_FP16 = "fp16"
CODEC_BF16 = "bf16"
CODEC_TOPK = "topk"
CODEC_RANDOMK = "randomk"
CODEC_POWERSGD = "powersgd"
CODEC_ONEBIT = "onebit"
CODEC_QSGD = "qsgd"
CODECS = (CODEC_NONE, CODEC_FP16, CODEC_BF16, CODEC_TOPK, CODEC_RANDOMK, CODEC_POWERSGD,
          CODEC_ONEBIT, CODEC_QSGD)
# casts only: they reduce element-wise, so they also apply to ZeRO's reduce-scatter
CAST_CODECS = (CODEC_FP16, CODEC_BF16)
# biased: what they drop is carried to the next step by error feedback
BIASED_CODECS = (CODEC_TOPK, CODEC_ONEBIT, CODEC_POWERSGD)

# ----------------------------------------------------------- sync modes (train.sync)
SYNC_EVERY_STEP = "every_step"
SYNC_LOCAL_SGD = "local_sgd"
SYNC_DILOCO = "diloco"
SYNC_ASYNC = "async"
SYNC_FEDAVG = "fedavg"
SYNC_MODES = (SYNC_EVERY_STEP, SYNC_LOCAL_SGD, SYNC_DILOCO, SYNC_ASYNC, SYNC_FEDAVG)
# train.on_nonfinite: what a step whose loss or gradient norm is nan / inf does
NONFINITE_STOP = "stop"
NONFINITE_SKIP = "skip"
# the periodic modes whose per-round update goes through comm.codec (their builders
# build one); the other built-in modes but every_step refuse one (parallel/sync/check.py)
CODEC_SYNC_MODES = (SYNC_LOCAL_SGD, SYNC_DILOCO)

# ----------------------------------------------------------- data (data.format, ...)
DATA_TEXT = "text"      # text files tokenized and cached as token shards
DATA_TOKENS = "tokens"  # pre-tokenized shards, memory-mapped in place
DATA_JSONL = "jsonl"    # instruction / chat examples, only the answers trained on
DATA_FORMATS = (DATA_TEXT, DATA_TOKENS, DATA_JSONL)
# data.on_bad_example: a malformed or unusable example stops the run, or is skipped
BAD_EXAMPLE_ERROR = "error"
BAD_EXAMPLE_SKIP = "skip"

# ----------------------------------------------------------- data-parallel strategies
STRATEGY_AUTO = "auto"
STRATEGY_DDP = "ddp"
STRATEGY_ZERO = "zero"
STRATEGY_LOCAL = "local"  # replicas on their own gradients, between a sync mode's rounds

# ----------------------------------------------------------- the run directory
CONFIG_FILE = "config.toml"          # the resolved config; a resumed run starts from it
METRICS_FILE = "metrics.jsonl"       # one MetricsRecord per logged step
SUMMARY_FILE = "summary.json"        # written once, when the run finishes
WEIGHTS_FILE = "model.safetensors"   # the final, unsharded weights
MODEL_CONFIG_FILE = "model_config.json"  # the model's own config (transformers), for export
TENSORBOARD_DIR = "tensorboard"      # event files, when tensorboard is installed
CSV_FILE = "metrics.csv"             # monitor.loggers "csv": the records' scalar columns
WANDB_DIR = "wandb"                  # monitor.loggers "wandb": its offline run
MLFLOW_DIR = "mlruns"                # monitor.loggers "mlflow": a file store

# monitor.loggers: the names, and the module each needs with the extra that installs it
LOGGER_TENSORBOARD, LOGGER_CSV = "tensorboard", "csv"
LOGGER_WANDB, LOGGER_MLFLOW = "wandb", "mlflow"
LOGGERS = (LOGGER_TENSORBOARD, LOGGER_CSV, LOGGER_WANDB, LOGGER_MLFLOW)
LOGGER_PACKAGES = {LOGGER_TENSORBOARD: ("tensorboard", "tensorboard"),
                   LOGGER_WANDB: ("wandb", "wandb"), LOGGER_MLFLOW: ("mlflow", "mlflow")}

TRACE_FILE = "trace.json"            # the merged Chrome-trace timeline of every rank
REPORT_DIR = "report"                # `disttrain report`: PNGs and REPORT_FILE
REPORT_FILE = "report.html"
CHECKPOINT_DIR = "checkpoints"       # one step-NNNNNNNN directory per committed save
CHECKPOINT_INDEX_FILE = "index.json"  # in each checkpoint: global shapes, shards, checksums
CHECKPOINT_LATEST_FILE = "latest"    # names the newest committed checkpoint (the commit)
STOPPED_FILE = "stopped.json"       # why the last attempt stopped on purpose (restarts skip)
OWNER_FILE = "owner.lock"            # flock-ed by the run that owns the directory: "pid host"
# set by the launcher for its workers: the run directory it already owns (they must not
# lock it again)
RUN_DIR_OWNED_ENV = "DISTTRAIN_RUN_DIR_OWNED"

# ----------------------------------------------------------- the shared-GPU test mode
# "1": every rank of a job on one GPU, collectives through Gloo (a test mode, not a way
# to train: docs/testing.md). Read by the config check, the runtime and the comm layer.
SHARED_GPU_ENV = "DISTTRAIN_SHARED_GPU"

# ----------------------------------------------------------- the transport's threads
# "low" (unset: the same): the transport's polling threads at the lowest priority
# (comm/transport.py); "keep": as torch made them. Read by the runtime and the comm layer.
TRANSPORT_PRIORITY_ENV = "DISTTRAIN_TRANSPORT_PRIORITY"
TRANSPORT_PRIORITIES = ("low", "keep")


def trace_rank_file(rank: int) -> str:
    """One rank's timeline before rank 0 merges them all into :data:`TRACE_FILE`."""
    return f"trace-rank{rank}.json"

# train.optimizer values (the built-in optimizers; user code may register more)
OPTIMIZER_ADAMW = "adamw"
OPTIMIZER_SGD = "sgd"
OPTIMIZER_LARS = "lars"    # momentum SGD with a layer-wise trust ratio
OPTIMIZER_LAMB = "lamb"    # AdamW with a layer-wise trust ratio
OPTIMIZER_ONEBIT_ADAM = "onebit_adam"
OPTIMIZERS = (OPTIMIZER_ADAMW, OPTIMIZER_SGD, OPTIMIZER_LARS, OPTIMIZER_LAMB,
              OPTIMIZER_ONEBIT_ADAM)

# ----------------------------------------------------------- a batch's model inputs
# the keyword inputs a causal LM takes (the built-in GPT and transformers models alike)
# that a strategy or the data reads or adds: the tokens' positions (global positions of
# the tokens a context-parallel rank holds; positions restarting per example in a packed
# row), each token's example in a packed row (data.packing; a spec's packed_inputs name
# them), and the padding mask (which a rank holding part of each sequence cannot apply)
POSITION_IDS = "position_ids"
DOCUMENT_IDS = "document_ids"
ATTENTION_MASK = "attention_mask"

# ----------------------------------------------------------- fault tolerance
# the environment the launcher (or a cluster's job spec) sets on each replica group
REPLICA_GROUP_ENV = "DISTTRAIN_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"

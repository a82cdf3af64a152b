"""``disttrain train``: validate the whole configuration, check that the job fits this
host, prepare the data and start the workers; in a worker, train."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.describe import config_keys_help
from ..errors import ConfigError, UserError
from ..names import METRICS_FILE, SUMMARY_FILE
from .launch_flags import add_launch_options, launch_options

if TYPE_CHECKING:
    from ..config.schema import Config
    from ..launch.agent import LaunchOptions


def _help_width() -> int:
    """Columns for help text: the terminal's (as argparse does), 100 when not a terminal."""
    return max(shutil.get_terminal_size((100, 24)).columns - 2, 60)


def _raw_epilog_formatter(prog: str) -> argparse.HelpFormatter:
    """Options wrapped by argparse to the same width as the pre-wrapped epilog."""
    return argparse.RawDescriptionHelpFormatter(prog, width=_help_width())


def add_train_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    train = sub.add_parser(
        "train", help="train the default model (or the configured one)",
        description=textwrap.fill(
            "Train a model on N local worker processes (Gloo on CPU, NCCL on GPU), "
            "validating the whole configuration first. With no arguments: the byte-level "
            "GPT on the Python standard library's source, 2 workers. Show the resolved "
            "configuration without training: disttrain config show. "
            "DISTTRAIN_SHARED_GPU=1 is a test mode, not a way to train: every worker "
            "on one GPU, collectives through Gloo and host memory (refused where each "
            "worker could have a GPU of its own). On the CPU a run lowers Gloo's "
            "polling threads to nice 19 so they stop taking the cores' time from compute; "
            "DISTTRAIN_TRANSPORT_PRIORITY=keep leaves them as torch made them.",
            _help_width()),
        epilog=config_keys_help(_help_width()), formatter_class=_raw_epilog_formatter)
    train.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                       help="TOML file with [model] [data] [train] [parallel] sections")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       dest="overrides", help="override one config value (repeatable)")
    train.add_argument("--run-dir", default=None, metavar="DIR",
                       help=f"where the config snapshot, {METRICS_FILE}, {SUMMARY_FILE} and "
                       "weights go (default runs/<time>)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    add_launch_options(train)
    return train


def run_train(ns: argparse.Namespace) -> int:
    from ..comm.transport import transport_priority
    from ..config.load import load_run_config
    from ..launch.agent import inside_worker, launch
    from ..plan.capacity import check_batch_fits, check_model_fits
    from ..run_checks import resolve

    transport_priority()  # the environment's switch, before any worker starts
    config = load_run_config(ns.config, ns.overrides, ns.run_dir)
    if ns.nnodes == "1" and not ns.rdzv_endpoint:  # not one elastic agent per node
        from ..launch.slurm import adopt_slurm_env

        adopt_slurm_env()  # a task srun started as one rank: a worker, no launcher
    elif "TORCHELASTIC_RUN_ID" not in os.environ:
        # this node's agent: a scheduler's RANK / WORLD_SIZE (a PyTorchJob pod's) count
        # nodes, not workers; torchrun sets each worker's own
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(var, None)
    if inside_worker():
        return _train_worker(config, ns)
    from ..train.rundir import new_run_dir_name

    run_dir = ns.run_dir or str(new_run_dir_name())
    opts = launch_options(ns, os.path.abspath(run_dir))
    groups = _replica_groups(config, opts)  # fault tolerance: ranks per group; else 1
    for world_size in opts.world_sizes():
        check_model_fits(config, world_size, opts.nproc)  # first: resolve's spec is O(n_layer)
        check_batch_fits(config, resolve(config, world_size // groups), opts.nproc)
    if opts.node_counts() != range(1, 2) and not (ns.run_dir or ns.rdzv_id):
        raise UserError("a multi-node job needs --run-dir, the same path on every node "
                        "(it also names the job's rendezvous), or --rdzv-id")
    if ns.run_dir:  # before anything is written: a finished run stays as it is, and a
        # run directory whose checkpoints are all damaged is refused up front
        from ..train.checkpointing import finished_run

        finished = finished_run(Path(ns.run_dir), config.train.steps, warn=lambda _: None)
        if finished is not None:
            print(f"disttrain: {finished}", file=sys.stderr)
            return 0
    if config.model.pretrained:  # its files, before any worker or run directory
        from ..weights import check_pretrained

        check_pretrained(config.model.pretrained, config.model.seq_len)
    _prepare_data(config)  # once here, before the workers start
    from ..monitor.progress import status

    if config.parallel.fault_tolerance != "none" and not _one_group(config):
        return _launch_replicas(config, ns, opts, run_dir)
    with _own_run_dir(Path(run_dir), opts):
        target = ["-m", "disttrain", "train", *([ns.config] if ns.config else []),
                  *[a for o in ns.overrides for a in ("--set", o)], "--run-dir", run_dir,
                  *(["--quiet"] if ns.quiet else [])]
        status(f"starting {opts.nproc} worker(s)...")
        return launch(opts, target)


def _replica_groups(config: Config, opts: LaunchOptions) -> int:
    """``parallel.fault_tolerance = replica``: the number of replica groups the job's
    ranks split into (refused unless it divides them; the lighthouse, when given, must
    answer); 1 otherwise, and 1 for one group started on its own (a cluster's job per
    group: ``DISTTRAIN_REPLICA_GROUP`` set, ``--nproc`` its ranks per node)."""
    from ..names import LIGHTHOUSE_ENV
    from ..parallel.ft.check import replica_groups
    from ..parallel.ft.replicas import check_lighthouse

    groups = replica_groups(config)
    if config.parallel.fault_tolerance == "none":
        return 1
    lighthouse = config.parallel.lighthouse
    if _one_group(config):
        lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise ConfigError("parallel.lighthouse", lighthouse,
                              "a replica group started on its own needs the lighthouse",
                              f"set parallel.lighthouse or {LIGHTHOUSE_ENV}")
        check_lighthouse(lighthouse)
        return 1
    for world_size in opts.world_sizes():
        if world_size % groups:
            raise ConfigError("parallel.replicas", groups,
                              f"does not divide the {world_size} ranks",
                              "give --nproc a multiple of parallel.replicas")
    if lighthouse:
        check_lighthouse(lighthouse)
    return groups


def _one_group(config: Config) -> bool:
    """A replica group started on its own (``DISTTRAIN_REPLICA_GROUP`` set): an
    ordinary torchrun job, no lighthouse or other groups started here."""
    from ..names import REPLICA_GROUP_ENV

    return config.parallel.fault_tolerance != "none" and REPLICA_GROUP_ENV in os.environ


def _launch_replicas(config: Config, ns: argparse.Namespace, opts: LaunchOptions,
                     run_dir: str) -> int:
    """Start the lighthouse (unless parallel.lighthouse names one) and the replica
    groups, group ``i`` writing to ``RUN_DIR/replica-i``."""
    from ..launch.replicas import launch_replicas, replica_dir
    from ..monitor.progress import status

    def target(i: int) -> list[str]:
        return ["-m", "disttrain", "train", *([ns.config] if ns.config else []),
                *[a for o in ns.overrides for a in ("--set", o)],
                "--run-dir", replica_dir(run_dir, i), *(["--quiet"] if ns.quiet else [])]

    os.makedirs(run_dir, exist_ok=True)
    status(f"starting {config.parallel.replicas} replica group(s) of "
           f"{opts.nproc // config.parallel.replicas} worker(s)...")
    return launch_replicas(opts, config.parallel.replicas, config.parallel.lighthouse,
                           target, config.parallel.ft_heartbeat_s)


def _prepare_data(config: Config) -> None:
    """Tokenize the corpus or the examples into the cache (the workers find them
    there) and check them against the model; say what bad examples were skipped."""
    from ..data import corpus_from_config
    from ..data.check import check_corpus_vocab, check_packable, check_samples, check_vocab
    from ..data.example_cache import examples_from_config
    from ..monitor.progress import status
    from ..names import DATA_JSONL

    check_packable(config.data)
    status(f"preparing the data in {config.data.path or 'the standard library sources'} "
           "(tokenized once, then cached)...")
    if config.data.format == DATA_JSONL:
        examples = examples_from_config(config.data, config.model)
        check_corpus_vocab(config.model, examples, config.explicit)
        report = examples.skip_report()
        if report is not None:
            print(f"disttrain: {report}", file=sys.stderr)
        return
    if config.data.format == "text":  # before preparing: refused without the work
        check_vocab(config.model)
    corpus = corpus_from_config(config.data)
    check_corpus_vocab(config.model, corpus, config.explicit)
    check_samples(corpus, config.data, config.model.seq_len)


def _train_worker(config: Config, ns: argparse.Namespace) -> int:
    """One worker of ``disttrain train``. Under ``--max-restarts``, an attempt after one
    that stopped on purpose (a divergence, a failed save, refused input: the same would
    happen again) stops at once with its exit code (:func:`~disttrain.train.rundir.
    stops_once`, around the data's preparation too)."""
    from ..train import train_default
    from ..train.rundir import stops_once

    with stops_once(Path(ns.run_dir) if ns.run_dir else None):
        train_default(config, run_dir=ns.run_dir, progress=not ns.quiet)
    return 0


def _own_run_dir(run_dir: Path, opts: LaunchOptions) -> AbstractContextManager:
    """A single-node launcher owns the run directory for its workers; in a multi-node
    job (one launcher per host) rank 0 of the job takes it."""
    from ..train.ownership import owned_for_workers

    if opts.node_counts() != range(1, 2):
        return nullcontext()
    return owned_for_workers(run_dir)

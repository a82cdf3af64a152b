"""The ``disttrain`` command: argument parsing only; the work is done elsewhere.

    disttrain train [CONFIG] [--nproc N] [--set section.key=value ...] [--run-dir DIR]
    disttrain run [--nproc N] script.py [args ...]
    disttrain export RUN_DIR --out model.safetensors [--format hf]
    disttrain report RUN_DIR [--out DIR]
    disttrain plan --model SPEC --cluster SPEC --global-batch B [--layout ...] [--json]
    disttrain plan calibrate --out cluster.json [--nproc N]
    disttrain slurm --nodes N --gpus-per-node G [-- train options] > job.sbatch
    disttrain config show [CONFIG] [--set section.key=value ...] [--nproc N]
    disttrain env [--json]

Bad input (a config key, a value, a path, a flag) prints one line on stderr per problem
and exits with code 2, before any worker or process group is started; a run that stops on purpose
(divergence, a failed checkpoint save) prints one line and exits with its own code (see
:mod:`disttrain.errors`).
"""

from __future__ import annotations

import argparse
from contextlib import AbstractContextManager, nullcontext
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .commands.config_show import add_config_parser, run_config
from .commands.env import add_env_parser, run_env
from .config.describe import config_keys_help
from .errors import EXIT_USAGE, Interrupted, TrainingStopped, UserError
from .monitor.report import add_report_parser, run_report
from .plan.choose import add_plan_parser, run_plan
from .launch.slurm import add_slurm_parser, run_slurm
from .names import METRICS_FILE, SUMMARY_FILE

if TYPE_CHECKING:
    from .config.schema import Config
    from .launch.agent import LaunchOptions


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"disttrain: error: {message} (see {self.prog} --help)\n")


def _help_width() -> int:
    """Columns for help text: the terminal's (as argparse does), 100 when not a terminal."""
    return max(shutil.get_terminal_size((100, 24)).columns - 2, 60)


def _add_launch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch (passed to torch's elastic agent)")
    g.add_argument("--nproc", type=int, default=2, metavar="N",
                   help="worker processes on this node (default 2)")
    g.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="number of nodes, or a range for an elastic job (default 1)")
    g.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="this node's rank; only for a fixed node order (the c10d "
                   "rendezvous assigns ranks itself)")
    g.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                   help="rendezvous endpoint shared by all nodes (multi-node)")
    g.add_argument("--rdzv-id", default="", metavar="ID",
                   help="job id, the same on all nodes (default: derived from the run "
                   "directory's path, so jobs on different run directories never meet)")
    g.add_argument("--rdzv-conf", default="", metavar="KEY=VALUE,...",
                   help="extra c10d rendezvous settings, e.g. is_host=1,read_timeout=30")
    g.add_argument("--local-addr", default="", metavar="ADDR",
                   help="this node's address as the other nodes reach it (default: its "
                   "host name)")
    g.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="restart the worker group up to R times after a failure")


def _raw_epilog_formatter(prog: str) -> argparse.HelpFormatter:
    """Options wrapped by argparse to the same width as the pre-wrapped epilog."""
    return argparse.RawDescriptionHelpFormatter(prog, width=_help_width())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="disttrain", description="Distributed training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser(
        "train", help="train the default model (or the configured one)",
        description=textwrap.fill(
            "Train a model on N local worker processes (Gloo on CPU, NCCL on GPU), "
            "validating the whole configuration first. With no arguments: the byte-level "
            "GPT on the Python standard library's source, 2 workers. Show the resolved "
            "configuration without training: disttrain config show.", _help_width()),
        epilog=config_keys_help(_help_width()), formatter_class=_raw_epilog_formatter)
    train.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                       help="TOML file with [model] [data] [train] [parallel] sections")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       dest="overrides", help="override one config value (repeatable)")
    train.add_argument("--run-dir", default=None, metavar="DIR",
                       help=f"where the config snapshot, {METRICS_FILE}, {SUMMARY_FILE} and "
                       "weights go (default runs/<time>)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_launch_options(train)

    export = sub.add_parser(
        "export", help="write a run's weights unsharded (safetensors, or a Hugging Face "
        "directory)",
        description="Assemble the newest intact checkpoint of RUN_DIR into one safetensors "
        "file, loadable with safetensors.torch.load_model into the plain model; with "
        "--format hf (runs of transformers models), into a directory that "
        "AutoModelForCausalLM.from_pretrained loads.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    export.add_argument("--out", required=True, metavar="PATH",
                        help="output .safetensors file (hf: output directory)")
    export.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="safetensors (default) or hf (config.json + model.safetensors)")

    run = sub.add_parser(
        "run", help="launch your own script on N workers, as torchrun does",
        description="Run SCRIPT on N worker processes with RANK, WORLD_SIZE, LOCAL_RANK, "
        "MASTER_ADDR and MASTER_PORT set; disttrain.Trainer picks them up.")
    run.add_argument("script", metavar="SCRIPT", help="Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    _add_launch_options(run)
    add_report_parser(sub)
    add_plan_parser(sub)
    add_slurm_parser(sub)
    add_config_parser(sub)
    add_env_parser(sub)
    return parser


def _launch_options(ns: argparse.Namespace, job: str) -> LaunchOptions:
    """Launch options; ``job`` (the run directory, or the script and its arguments)
    names the default rendezvous id."""
    from .launch.agent import LaunchOptions, default_rdzv_id

    return LaunchOptions(nproc=ns.nproc, nnodes=ns.nnodes, node_rank=ns.node_rank,
                         rdzv_endpoint=ns.rdzv_endpoint,
                         rdzv_id=ns.rdzv_id or default_rdzv_id(job),
                         rdzv_conf=ns.rdzv_conf, local_addr=ns.local_addr,
                         max_restarts=ns.max_restarts)


def _train(ns: argparse.Namespace) -> int:
    from .plan.capacity import check_batch_fits, check_model_fits
    from .run_checks import resolve
    from .config.load import load_run_config
    from .launch.agent import inside_worker, launch

    config = load_run_config(ns.config, ns.overrides, ns.run_dir)
    if ns.nnodes == "1" and not ns.rdzv_endpoint:  # not one elastic agent per node
        from .launch.slurm import adopt_slurm_env

        adopt_slurm_env()  # a task srun started as one rank: a worker, no launcher
    elif "TORCHELASTIC_RUN_ID" not in os.environ:
        # this node's agent: a scheduler's RANK / WORLD_SIZE (a PyTorchJob pod's) count
        # nodes, not workers; torchrun sets each worker's own
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(var, None)
    if inside_worker():
        return _train_worker(config, ns)
    from .train.rundir import new_run_dir_name

    run_dir = ns.run_dir or str(new_run_dir_name())
    opts = _launch_options(ns, os.path.abspath(run_dir))
    for world_size in opts.world_sizes():
        check_model_fits(config, world_size, opts.nproc)  # first: resolve's spec is O(n_layer)
        check_batch_fits(config, resolve(config, world_size), opts.nproc)
    if opts.node_counts() != range(1, 2) and not (ns.run_dir or ns.rdzv_id):
        raise UserError("a multi-node job needs --run-dir, the same path on every node "
                        "(it also names the job's rendezvous), or --rdzv-id")
    if ns.run_dir:  # before anything is written: a finished run stays as it is, and a
        # run directory whose checkpoints are all damaged is refused up front
        from .train.checkpointing import finished_run

        finished = finished_run(Path(ns.run_dir), config.train.steps, warn=lambda _: None)
        if finished is not None:
            print(f"disttrain: {finished}", file=sys.stderr)
            return 0
    from .data import corpus_from_config
    from .data.check import check_corpus_vocab, check_samples, check_vocab
    from .monitor.progress import status

    if config.model.pretrained:  # its files, before any worker or run directory
        from .weights import check_pretrained

        check_pretrained(config.model.pretrained, config.model.seq_len)
    if config.data.format == "text":  # before preparing: refused without the work
        check_vocab(config.model)
    status(f"preparing the data in {config.data.path or 'the standard library sources'} "
           "(tokenized once, then cached)...")
    corpus = corpus_from_config(config.data)  # prepared once here, before the workers start
    check_corpus_vocab(config.model, corpus, config.explicit)
    check_samples(corpus, config.data, config.model.seq_len)
    with _own_run_dir(Path(run_dir), opts):
        target = ["-m", "disttrain", "train", *([ns.config] if ns.config else []),
                  *[a for o in ns.overrides for a in ("--set", o)], "--run-dir", run_dir,
                  *(["--quiet"] if ns.quiet else [])]
        status(f"starting {opts.nproc} worker(s)...")
        return launch(opts, target)


def _train_worker(config: Config, ns: argparse.Namespace) -> int:
    """One worker of ``disttrain train``. Under ``--max-restarts``, an attempt after one
    that stopped on purpose (a divergence, a failed save, refused input: the same would
    happen again) stops at once with its exit code."""
    from .train import train_default
    from .train.rundir import earlier_stop, forget_stop, record_stop

    run_dir = Path(ns.run_dir) if ns.run_dir else None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    restartable = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > attempt
    main = os.environ.get("RANK", "0") == "0"
    if run_dir is not None and attempt > 0:
        code = earlier_stop(run_dir)
        if code is not None:
            stop = TrainingStopped(f"not restarting (restart {attempt}): an earlier "
                                   f"attempt stopped on purpose (exit {code}, said above) "
                                   "and would again")
            stop.exit_code = code
            if not main:  # rank 0 says it: leaving first could get it stopped unheard;
                time.sleep(60.0)  # the agent stops this worker as soon as rank 0 exits
            raise stop
    elif run_dir is not None and main:
        forget_stop(run_dir)
    try:
        train_default(config, run_dir=ns.run_dir, progress=not ns.quiet)
    except (TrainingStopped, UserError) as exc:
        code = exc.exit_code if isinstance(exc, TrainingStopped) else EXIT_USAGE
        if run_dir is not None and main and restartable and run_dir.is_dir():
            record_stop(run_dir, code, str(exc))
        raise
    return 0


def _own_run_dir(run_dir: Path, opts: LaunchOptions) -> AbstractContextManager:
    """A single-node launcher owns the run directory for its workers; in a multi-node
    job (one launcher per host) rank 0 of the job takes it."""
    from .train.ownership import owned_for_workers

    if opts.node_counts() != range(1, 2):
        return nullcontext()
    return owned_for_workers(run_dir)


def _export(ns: argparse.Namespace) -> int:
    from .checkpoint.export import export_hf, export_weights

    def warn(text: str) -> None:
        print(f"disttrain: warning: {text}", file=sys.stderr)

    write = export_hf if ns.format == "hf" else export_weights
    out, step = write(Path(ns.run_dir), Path(ns.out), warn)
    print(f"wrote {out} (step {step})")
    return 0


def _run(ns: argparse.Namespace) -> int:
    from .launch.agent import launch

    if not Path(ns.script).is_file():
        raise UserError(f"script {ns.script!r} does not exist (give the path of a Python "
                        "file)")
    job = " ".join([os.path.abspath(ns.script), *ns.args])
    return launch(_launch_options(ns, job), [ns.script, *ns.args])


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return {"train": _train, "run": _run, "export": _export,
                "report": run_report, "plan": run_plan, "slurm": run_slurm,
                "config": run_config, "env": run_env}[ns.command](ns)
    except UserError as exc:
        if os.environ.get("RANK", "0") == "0":  # in a worker group, rank 0 speaks for all
            for line in str(exc).splitlines():  # InputErrors: one line per problem
                print(f"disttrain: error: {line}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as exc:  # a worker that stopped on a signal (it said so)
        return int(exc.code)
    except TrainingStopped as exc:  # every rank agrees on why: rank 0 says it
        if os.environ.get("RANK", "0") == "0":
            print(f"disttrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("disttrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

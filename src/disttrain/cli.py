"""The ``disttrain`` command: the subcommands of :mod:`disttrain.commands` assembled into
one parser, and the dispatch to the one named.

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
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .commands.config_show import add_config_parser, run_config
from .commands.env import add_env_parser, run_env
from .commands.export import add_export_parser, run_export
from .commands.plan import add_plan_parser, run_plan
from .commands.report import add_report_parser, run_report
from .commands.run import add_run_parser, run_script
from .commands.slurm import add_slurm_parser, run_slurm
from .commands.train import add_train_parser, run_train
from .errors import EXIT_USAGE, Interrupted, TrainingStopped, UserError


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"disttrain: error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True, kw_only=True)
class _Command:
    """One subcommand (a module of :mod:`disttrain.commands`): adds its parser, named
    there, to the subparsers; runs a namespace that parser made, returning the exit code."""

    add_parser: Callable[[argparse._SubParsersAction], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], int]


# in the order ``disttrain --help`` lists them
_COMMANDS = (
    _Command(add_parser=add_train_parser, run=run_train),
    _Command(add_parser=add_export_parser, run=run_export),
    _Command(add_parser=add_run_parser, run=run_script),
    _Command(add_parser=add_report_parser, run=run_report),
    _Command(add_parser=add_plan_parser, run=run_plan),
    _Command(add_parser=add_slurm_parser, run=run_slurm),
    _Command(add_parser=add_config_parser, run=run_config),
    _Command(add_parser=add_env_parser, run=run_env),
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="disttrain", description="Distributed training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in _COMMANDS:
        command.add_parser(sub).set_defaults(run_command=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.run_command(ns)
    except UserError as exc:
        if os.environ.get("RANK", "0") == "0":  # in a worker group, rank 0 speaks for all
            for line in str(exc).splitlines():  # InputErrors: one line per problem
                print(f"disttrain: error: {line}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as exc:  # a worker that stopped on a signal (it said so)
        return exc.exit_code
    except TrainingStopped as exc:  # every rank agrees on why: rank 0 says it
        if os.environ.get("RANK", "0") == "0":
            print(f"disttrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("disttrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

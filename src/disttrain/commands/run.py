"""``disttrain run SCRIPT``: launch the user's own script on N workers, as torchrun
does."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import UserError
from .launch_flags import add_launch_options, launch_options


def add_run_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    run = sub.add_parser(
        "run", help="launch your own script on N workers, as torchrun does",
        description="Run SCRIPT on N worker processes with RANK, WORLD_SIZE, LOCAL_RANK, "
        "MASTER_ADDR and MASTER_PORT set; disttrain.Trainer picks them up.")
    run.add_argument("script", metavar="SCRIPT", help="Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    add_launch_options(run)
    return run


def run_script(ns: argparse.Namespace) -> int:
    from ..launch.agent import launch

    if not Path(ns.script).is_file():
        raise UserError(f"script {ns.script!r} does not exist (give the path of a Python "
                        "file)")
    job = " ".join([os.path.abspath(ns.script), *ns.args])
    return launch(launch_options(ns, job), [ns.script, *ns.args])

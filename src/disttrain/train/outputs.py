"""The run directory a run writes into, held by one owner, and rank 0's writes to it.

Rank 0 picks the directory (given, or a new dated one), locks it unless its launcher
already holds it, and writes the resolved config there; every rank learns the outcome,
so no rank waits in a collective for one that gave up.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

from ..comm import Communicator
from ..config import Config, RunPlan
from ..config.dump import config_to_toml
from ..errors import UserError
from ..names import CONFIG_FILE, MODEL_CONFIG_FILE
from . import rundir
from .ownership import RunDirLock, owned_by_launcher


def on_main(world: Communicator, work: Callable[[], None], failed: str,
            error: type[Exception]) -> None:
    """Rank 0 runs ``work``; a refusal it raises (its text) or an I/O failure
    (``failed``: the reason) becomes every rank's ``error``."""
    problem = None
    if world.rank == 0:
        try:
            work()
        except UserError as exc:
            problem = str(exc)
        except OSError as exc:
            problem = f"{failed}: {exc.strerror or exc}"
    agreed = cast("str | None", world.broadcast_object(problem))
    if agreed is not None:
        raise error(agreed)


class RunDirectory:
    """Where this run writes (``path``), with rank 0's lock on it once :meth:`claim`
    took it (the loader's forked workers drop their copy: :meth:`forget_in_child`)."""

    def __init__(self, given: Path | None) -> None:
        self.path = given
        self.lock: RunDirLock | None = None

    def claim(self, world: Communicator, config: Config, plan: RunPlan,
              model_config_json: str | None) -> Path:
        """Agree on the directory, lock it and write the config (rank 0); every rank
        returns the path."""
        chosen = self.path or (rundir.new_run_dir_name() if world.rank == 0 else None)
        # rank 0 always has a name (given or new): every rank receives a str
        self.path = Path(cast(str, world.broadcast_object(str(chosen) if chosen else None)))
        path = self.path

        def own() -> None:
            if not owned_by_launcher(path):
                self.lock = RunDirLock(path)
            path.mkdir(parents=True, exist_ok=True)
            rundir.write_text_atomic(path / CONFIG_FILE, config_to_toml(config, plan))
            if model_config_json is not None:
                rundir.write_text_atomic(path / MODEL_CONFIG_FILE, model_config_json)
        on_main(world, own, f"cannot write the run directory {path}", UserError)
        return path

    def forget_in_child(self) -> None:
        if self.lock is not None:
            self.lock.forget_in_child()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

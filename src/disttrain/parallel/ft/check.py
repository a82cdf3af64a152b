"""``parallel.fault_tolerance``'s compatibility check (run by validation before launch)."""

from __future__ import annotations

import importlib.util

from ...config.layout import Layout
from ...config.schema import Config
from ...dimensions import Role
from ...errors import ConfigError
from ...names import SYNC_EVERY_STEP

FT_REPLICA = "replica"


def replica_groups(config: Config) -> int:
    """How many replica groups share the global batch (1 without fault tolerance)."""
    p = config.parallel
    return p.replicas if p.fault_tolerance == FT_REPLICA else 1


def check_fault_tolerance(config: Config, layout: Layout) -> None:
    """Replica groups step on the every_step gradients, each a group of whole-batch
    ranks (tp x pp x cp, no data parallelism inside): the share of a missing group is
    redistributed over the groups, not over ranks inside one."""
    p = config.parallel
    if p.fault_tolerance != FT_REPLICA:
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("parallel.fault_tolerance", p.fault_tolerance,
                          "needs torchft, which is not installed",
                          "pip install 'disttrain[ft]' (Python >= 3.11), or set "
                          "parallel.fault_tolerance=none")
    if config.train.sync != SYNC_EVERY_STEP:
        raise ConfigError("train.sync", config.train.sync,
                          "is not supported with parallel.fault_tolerance=replica yet",
                          "set train.sync=every_step")
    inner = layout.role(Role.SAMPLES)
    if inner != 1 or p.zero:
        raise ConfigError("parallel.dp", inner,
                          "data parallelism inside a replica group is not supported with "
                          "parallel.fault_tolerance=replica (the groups are the dp "
                          "dimension)",
                          "run one group per model replica: --nproc = replicas x tp x pp "
                          "x cp, parallel.dp=1, parallel.zero=0")
    if p.balance != "static":
        raise ConfigError("parallel.balance", p.balance,
                          "is not supported with parallel.fault_tolerance=replica",
                          "set parallel.balance=static")

"""Communication: every collective disttrain issues goes through a Communicator."""

from .collectives import (
    CollectiveLedger,
    CollectiveRecord,
    Communicator,
    ReduceOp,
    control_beside,
    release_groups,
)

__all__ = ["CollectiveLedger", "CollectiveRecord", "Communicator", "ReduceOp",
           "control_beside", "release_groups"]

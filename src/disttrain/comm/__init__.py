"""Communication: every collective disttrain issues goes through a Communicator."""

from .collectives import CollectiveLedger, CollectiveRecord, Communicator, ReduceOp

__all__ = ["CollectiveLedger", "CollectiveRecord", "Communicator", "ReduceOp"]

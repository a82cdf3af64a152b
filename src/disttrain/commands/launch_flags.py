"""The launch options ``disttrain train`` and ``disttrain run`` share: the flags, and the
:class:`~disttrain.launch.agent.LaunchOptions` they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..launch.agent import LaunchOptions


def add_launch_options(p: argparse.ArgumentParser) -> None:
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


def launch_options(ns: argparse.Namespace, job: str) -> LaunchOptions:
    """Launch options; ``job`` (the run directory, or the script and its arguments)
    names the default rendezvous id."""
    from ..launch.agent import LaunchOptions, default_rdzv_id

    return LaunchOptions(nproc=ns.nproc, nnodes=ns.nnodes, node_rank=ns.node_rank,
                         rdzv_endpoint=ns.rdzv_endpoint,
                         rdzv_id=ns.rdzv_id or default_rdzv_id(job),
                         rdzv_conf=ns.rdzv_conf, local_addr=ns.local_addr,
                         max_restarts=ns.max_restarts)

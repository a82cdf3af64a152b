"""The launcher's torchrun arguments: the default rendezvous id names the job."""

from __future__ import annotations

from disttrain.cli import build_parser
from disttrain.commands.launch_flags import launch_options as _launch_options
from disttrain.launch.agent import torchrun_args


def _rdzv_id(*argv: str) -> str:
    ns = build_parser().parse_args(["train", "--nnodes", "2", "--rdzv-endpoint", "h:29400",
                                    *argv])
    args = torchrun_args(_launch_options(ns, f"/shared/{ns.run_dir}"), [])
    return args[args.index("--rdzv-id") + 1]


def test_default_rendezvous_id_is_derived_from_the_run_directory():
    assert _rdzv_id("--run-dir", "a") == _rdzv_id("--run-dir", "a")  # every node agrees
    assert _rdzv_id("--run-dir", "a") != _rdzv_id("--run-dir", "b")  # jobs never meet
    assert _rdzv_id("--run-dir", "a", "--rdzv-id", "mine") == "mine"

"""``disttrain plan`` and ``disttrain plan calibrate``: the parsers, and the dispatch
to choosing a layout (:mod:`disttrain.plan.choose`), comparing with a finished run
(:mod:`disttrain.plan.accuracy`) or measuring this machine
(:mod:`disttrain.plan.calibrate`)."""

from __future__ import annotations

import argparse

from ..plan.choose import choose_layout
from ..plan.layout import RECOMPUTE
from ..plan.options import ACCOUNTING


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    plan = sub.add_parser(
        "plan", help="choose and explain a parallel layout for a model on a cluster",
        description="Predict the memory and step time of training a model with every valid "
        "layout (tp x pp x dp, micro-batch, ZeRO stage, recomputation, sequence "
        "parallelism) on a cluster, and show the fastest that fit; or one layout "
        "(--layout). Presets: a100-40gb, a100-80gb, h100-80gb, h200; measure this "
        "machine with 'disttrain plan calibrate'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  disttrain plan --model layers=32,hidden=4096,heads=32,seq=4096,"
        "vocab=32000 --cluster gpu=h100-80gb,gpus_per_node=8,nodes=4 --global-batch 512\n"
        "  disttrain plan --model config.json,seq=2048 --cluster gpu=a100-80gb,nodes=2 "
        "--global-batch 256 --layout tp=8,pp=1,dp=2,mbs=2,zero=1 --explain\n"
        "  disttrain plan calibrate --out cluster.json  # then: --cluster cluster.json")
    plan.add_argument("--model", metavar="SPEC", help="layers=L,hidden=H,heads=A,seq=S,"
                      "vocab=V[,ffn=F][,kv_heads=K][,gated=1], a transformers config.json "
                      "(optionally followed by ,seq=S), or gpt (the [model] of --config)")
    plan.add_argument("--config", metavar="TOML", default=None,
                      help="a disttrain config: its [model] for --model gpt")
    plan.add_argument("--cluster", metavar="SPEC", default=None,
                      help="gpu=PRESET,gpus_per_node=G,nodes=N[,memory_gib=..] or a cluster "
                      "JSON file (default: one node of 8 A100-80GB; with --validate, the "
                      "preset of the run's GPU)")
    plan.add_argument("--global-batch", type=int, metavar="B", help="sequences per step")
    plan.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    plan.add_argument("--accounting", choices=ACCOUNTING, default="disttrain",
                      help="model-state bytes: disttrain (fp32 params/grads/Adam, 16 B per "
                      "param) or mixed (the ZeRO paper's 2+2+12)")
    plan.add_argument("--fused-loss", choices=("on", "off"), default=None,
                      help="price the fused linear + cross-entropy (on: two gradients and "
                      "one chunk of logits) or the full logits (off); default: "
                      "train.fused_loss of --config, else on")
    plan.add_argument("--layout", metavar="K=V,...", default=None,
                      help="estimate this layout only: tp,pp,dp,mbs,v,zero,recompute,sp "
                      "(gpipe=1: the GPipe schedule instead of 1F1B)")
    plan.add_argument("--recompute", default=",".join(RECOMPUTE), metavar="LIST",
                      help="recomputation modes the search may use (default all)")
    plan.add_argument("--top", type=int, default=5, metavar="K", help="rows shown (5)")
    plan.add_argument("--json", action="store_true", help="print a JSON array of rows")
    plan.add_argument("--explain", action="store_true",
                      help="why the best layout wins, and what the next-best loses")
    plan.add_argument("--emit-config", metavar="OUT.toml", default=None,
                      help="write the best layout as a config 'disttrain train' runs")
    plan.add_argument("--trace", metavar="OUT.json", default=None,
                      help="Chrome trace of one simulated step of the best layout")
    plan.add_argument("--validate", metavar="RUN_DIR", default=None,
                      help="compare the prediction for a finished run with what it "
                      "measured")
    commands = plan.add_subparsers(dest="plan_command", metavar="{calibrate}",
                                   parser_class=type(plan))
    _add_calibrate_parser(commands)
    return plan


def _add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser(
        "calibrate", help="measure this machine and write it as a cluster JSON file",
        description="Time matmuls, fused attention, a large memory copy and collectives "
        "(all-reduce, reduce-scatter, all-gather, point-to-point) over N local ranks, fit "
        "the planner's cost model to them, and write a cluster file for "
        "'disttrain plan --cluster FILE.json'. Under a minute; --quick: seconds.")
    cal.add_argument("--out", required=True, metavar="FILE.json",
                     help="cluster file to write")
    cal.add_argument("--nproc", type=int, default=None, metavar="N",
                     help="ranks (devices) on this node (default: the GPUs, or 2 on a CPU)")
    cal.add_argument("--device", choices=("cpu", "cuda"), default=None,
                     help="what to measure (default: cuda when a GPU is visible)")
    cal.add_argument("--quick", action="store_true",
                     help="fewer and smaller measurements (rougher figures)")


def run_plan(ns: argparse.Namespace) -> int:
    if getattr(ns, "plan_command", None) == "calibrate":
        from ..plan.calibrate import run_calibrate

        return run_calibrate(ns)
    if ns.validate:
        from ..plan.accuracy import run_validate

        return run_validate(ns)
    return choose_layout(ns)

"""``disttrain export RUN_DIR --out PATH``: a run's newest weights (its newest intact
checkpoint, or its final weights when they are newer or there is no checkpoint) as one
safetensors file, or a Hugging Face directory (:mod:`disttrain.checkpoint.export`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_export_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    export = sub.add_parser(
        "export", help="write a run's weights unsharded (safetensors, or a Hugging Face "
        "directory)",
        description="Assemble the newest weights of RUN_DIR (its newest intact checkpoint, "
        "or its final model.safetensors when that is of a later step or there is no "
        "checkpoint; the output line says which) into one safetensors file, loadable "
        "with safetensors.torch.load_model into the plain model; with "
        "--format hf (runs of transformers models), into a directory that "
        "AutoModelForCausalLM.from_pretrained loads.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    export.add_argument("--out", required=True, metavar="PATH",
                        help="output .safetensors file (hf: output directory)")
    export.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="safetensors (default) or hf (config.json + model.safetensors)")
    return export


def run_export(ns: argparse.Namespace) -> int:
    from ..checkpoint.export import export_hf, export_weights

    def warn(text: str) -> None:
        print(f"disttrain: warning: {text}", file=sys.stderr)

    write = export_hf if ns.format == "hf" else export_weights
    out, weights = write(Path(ns.run_dir), Path(ns.out), warn)
    step = "step unknown" if weights.step is None else f"step {weights.step}"
    print(f"wrote {out} ({step}, from {weights.source})")
    return 0

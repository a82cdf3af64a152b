"""``disttrain export RUN_DIR --out PATH``: a run's newest intact checkpoint as one
safetensors file, or a Hugging Face directory (:mod:`disttrain.checkpoint.export`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_export_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    export = sub.add_parser(
        "export", help="write a run's weights unsharded (safetensors, or a Hugging Face "
        "directory)",
        description="Assemble the newest intact checkpoint of RUN_DIR into one safetensors "
        "file, loadable with safetensors.torch.load_model into the plain model; with "
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
    out, step = write(Path(ns.run_dir), Path(ns.out), warn)
    print(f"wrote {out} (step {step})")
    return 0

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
        "AutoModelForCausalLM.from_pretrained loads. A LoRA run (model.lora_rank > 0) "
        "holds adapters only: --format peft writes them as peft loads them onto the base "
        "model, --format hf --merge writes the base with the adapters merged in.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    export.add_argument("--out", required=True, metavar="PATH",
                        help="output .safetensors file (hf, peft: output directory)")
    export.add_argument("--format", choices=("safetensors", "hf", "peft"),
                        default="safetensors",
                        help="safetensors (default), hf (config.json + model.safetensors) "
                        "or peft (a LoRA run's adapter_config.json + "
                        "adapter_model.safetensors)")
    export.add_argument("--merge", action="store_true",
                        help="with --format hf, of a LoRA run: the adapters merged into "
                        "the base read from the run's model.pretrained")
    return export


def run_export(ns: argparse.Namespace) -> int:
    from ..checkpoint.export import export_hf, export_weights
    from ..errors import UserError

    def warn(text: str) -> None:
        print(f"disttrain: warning: {text}", file=sys.stderr)

    run_dir, out_path = Path(ns.run_dir), Path(ns.out)
    if ns.merge and ns.format != "hf":
        raise UserError(f"--merge goes with --format hf, not --format {ns.format} (give "
                        "--format hf --merge)")
    if ns.format == "peft" or ns.merge:
        from ..lora.export import export_adapters

        out, weights = export_adapters(run_dir, out_path, merge=ns.merge, warn=warn)
    else:
        if ns.format == "hf":
            from ..lora.export import refuse_adapters

            refuse_adapters(run_dir)
        write = export_hf if ns.format == "hf" else export_weights
        out, weights = write(run_dir, out_path, warn)
    said = "step unknown" if weights.step is None else f"step {weights.step}"
    print(f"wrote {out} ({said}, from {weights.source})")
    return 0

"""A LoRA run's newest weights as ``peft`` adapters, or merged into its base.

The newest weights are those :func:`~disttrain.checkpoint.export.newest_weights` picks:
the newest checkpoint, which holds the adapters only, or the run's final
``model.safetensors`` (no checkpoint, or a later step), which holds the base as trained
and the adapters. Which layers they adapt comes from the run itself: its model (the
transformers ``config.json`` the run kept, built on the meta device) with its own
``model.lora_*`` settings (the checkpoint's config, or the run's ``config.toml``) gives
the same adapted layers :func:`~.apply.add_lora` gave the run.

- :func:`export_peft`: ``adapter_config.json`` + ``adapter_model.safetensors``, the
  tensors under peft's names (``base_model.model.<path>.lora_A.weight``), which
  ``PeftModel.from_pretrained(base, out_dir)`` loads onto the base model;
- :func:`export_merged`: ``config.json`` + ``model.safetensors`` of the base with each
  adapted weight replaced by W + (alpha / r) B A (transposed for a GPT-2 ``Conv1D``),
  which ``AutoModelForCausalLM.from_pretrained`` loads. The base is the final weights'
  own; from a checkpoint it is read from the run's ``model.pretrained`` (or made by the
  seeded initialiser, for a run that had none), one tensor at a time, and checked
  against the checkpoint's fingerprint of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..adapters import LORA_A, LORA_B
from ..checkpoint.export import ExportedWeights, newest_weights
from ..checkpoint.fingerprint import FROZEN_KEY, first_difference, piece_checksums
from ..checkpoint.state import MODEL
from ..checkpoint.stream import write_streamed
from ..config import load_config
from ..errors import ConfigError, UserError
from ..names import CONFIG_FILE, MODEL_CONFIG_FILE
from ..weights import initial_weights, open_pretrained
from ..weights.pretrained import model_tensor_shapes
from .apply import LoRASettings, adapted_names, add_lora

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRARun:
    """What an export needs of a LoRA run: its newest weights, its model on meta (with
    the adapters), its settings, its adapted layers ((path, transposed) each) and its
    config (as a mapping of sections)."""

    weights: ExportedWeights
    model: nn.Module
    settings: LoRASettings
    adapted: list[tuple[str, bool]]
    config: dict[str, Any]


def lora_run(run_dir: Path, weights: ExportedWeights) -> LoRARun | None:
    """The LoRA side of ``run_dir``'s newest ``weights``: None for a run without
    adapters; a :class:`~disttrain.errors.UserError` for one whose model the run did not
    keep (only transformers models' runs can be exported to peft or merged)."""
    config = (weights.meta.get("config", {}) if weights.meta is not None
              else _run_config(run_dir))
    model_cfg = config.get("model", {})
    if not model_cfg.get("lora_rank"):
        return None
    kept = Path(run_dir) / MODEL_CONFIG_FILE
    if not kept.is_file():
        raise UserError(f"{run_dir} has no {MODEL_CONFIG_FILE}: adapters are exported for "
                        "runs of transformers models (the default format writes the "
                        "checkpoint's adapter tensors)")
    import transformers as tf

    from ..models.hf import hf_spec, read_hf_config

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(read_hf_config(str(kept)),
                                                    dtype=torch.float32)
    settings = LoRASettings(rank=int(model_cfg["lora_rank"]),
                            alpha=float(model_cfg.get("lora_alpha", 16.0)),
                            dropout=float(model_cfg.get("lora_dropout", 0.0)),
                            targets=tuple(model_cfg.get("lora_targets", ())))
    spec = hf_spec(model)
    adapted = adapted_names(model, settings, spec)
    add_lora(model, settings, spec, seed=0)  # the run's structure, on meta: nothing drawn
    held = {name for name, _, _ in weights.entries}
    for path, _ in adapted:
        for factor in (LORA_A, LORA_B):
            if f"{path}.{factor}.weight" not in held:
                raise UserError(f"{weights.source} of {run_dir} has no adapter tensor "
                                f"{path}.{factor}.weight (the weights of another run?)")
    return LoRARun(weights, model, settings, adapted, config)


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config (``config.toml``, as the run wrote it) as sections."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} has no {CONFIG_FILE}: its final weights cannot be "
                        "told apart from a LoRA run's (not a disttrain run directory?)")
    try:
        return load_config(path).to_dict()
    except ConfigError as exc:
        raise UserError(f"{path}: {exc}") from None


def export_peft(run: LoRARun, out_dir: Path) -> Path:
    """``out_dir/adapter_config.json`` and ``out_dir/adapter_model.safetensors``."""
    names = {f"{path}.{factor}.weight" for path, _ in run.adapted
             for factor in (LORA_A, LORA_B)}
    entries = [(PEFT_PREFIX + n, shape, dtype) for n, shape, dtype in run.weights.entries
               if n in names]
    write_streamed(out_dir / ADAPTER_WEIGHTS, entries,
                   lambda key: run.weights.fetch(key[len(PEFT_PREFIX):]),
                   {"format": "pt"})
    pretrained = run.config.get("model", {}).get("pretrained") or None
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM",
              "base_model_name_or_path": pretrained, "r": run.settings.rank,
              "lora_alpha": run.settings.alpha, "lora_dropout": run.settings.dropout,
              "target_modules": [path for path, _ in run.adapted], "bias": "none",
              "fan_in_fan_out": any(t for _, t in run.adapted), "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "modules_to_save": None}
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n",
                                          encoding="utf-8")
    return out_dir


def export_merged(run: LoRARun, run_dir: Path, out_dir: Path) -> Path:
    """``out_dir/config.json`` and ``out_dir/model.safetensors``: the base with every
    adapted weight merged (fp32). A checkpoint's base is read from the run's
    ``model.pretrained`` and checked against the checkpoint's fingerprint of it
    (refused, nothing left behind, when they differ); final weights hold their base."""
    read = _base_reader(run)
    shapes, _ = model_tensor_shapes(run.model)
    merged = {f"{path}.weight": (path, transposed) for path, transposed in run.adapted}
    seen: dict[str, list[float]] = {}
    frozen = (run.weights.meta or {}).get(FROZEN_KEY) or {}

    def fetch(name: str) -> torch.Tensor:
        t = read(name).to(torch.float32)
        if name in frozen:
            seen[name] = piece_checksums(t, tuple(t.shape), (0,) * t.dim()).tolist()
        if name in merged:
            t = t + _delta(run, *merged[name])
        return t

    out = out_dir / "model.safetensors"
    write_streamed(out, [(n, s, torch.float32) for n, s in shapes.items()], fetch,
                   {"format": "pt"})
    diff = first_difference(frozen, seen) if frozen else None
    if diff is not None:
        out.unlink(missing_ok=True)
        raise UserError(f"the base of {run_dir} is not the one its adapters were trained "
                        f"on: {diff} (model.pretrained changed since the run?)")
    (out_dir / "config.json").write_text(
        (Path(run_dir) / MODEL_CONFIG_FILE).read_text(encoding="utf-8"), encoding="utf-8")
    return out_dir


def _delta(run: LoRARun, path: str, transposed: bool) -> torch.Tensor:
    """(alpha / r) B @ A of layer ``path``, in its weight's layout."""
    a = run.weights.fetch(f"{path}.{LORA_A}.weight").to(torch.float32)
    b = run.weights.fetch(f"{path}.{LORA_B}.weight").to(torch.float32)
    update = (b @ a) * (run.settings.alpha / run.settings.rank)
    return update.t() if transposed else update


def _base_reader(run: LoRARun) -> Callable[[str], torch.Tensor]:
    """plain name -> the base's tensor: the final weights' own, else the base a
    checkpoint's adapters were trained on (:func:`_base_source`)."""
    if run.weights.meta is None:
        return run.weights.fetch
    base = _base_source(run)
    return lambda name: base.tensor(MODEL + name)


def _base_source(run: LoRARun) -> Any:
    """The run's base: ``model.pretrained``'s files (the adapters and anything they lack
    from the seeded initialiser), or the seeded initialiser alone."""
    seed = int(run.config.get("train", {}).get("seed", 0))
    seeded = initial_weights(run.model, seed)
    pretrained = run.config.get("model", {}).get("pretrained")
    if not pretrained:
        return seeded
    if not Path(pretrained).expanduser().is_dir():
        raise UserError(f"model.pretrained {pretrained} of the run is gone: the merged "
                        "weights need the base it was trained on")
    return open_pretrained(pretrained, run.model, rest=seeded)


def export_adapters(run_dir: Path, out_dir: Path, *, merge: bool,
                    warn: Callable[[str], None]) -> tuple[Path, ExportedWeights]:
    """The newest weights of LoRA run ``run_dir`` as peft adapters, or (``merge``)
    merged into its base, in ``out_dir``; returns (out_dir, where they came from)."""
    weights = newest_weights(run_dir, warn)
    run = lora_run(run_dir, weights)
    if run is None:
        raise UserError(f"{run_dir} trained every weight (model.lora_rank=0): it has no "
                        "adapters to export (use --format hf without --merge)")
    out_dir = Path(out_dir)
    if merge:
        return export_merged(run, run_dir, out_dir), weights
    return export_peft(run, out_dir), weights


def refuse_adapters(run_dir: Path) -> None:
    """Refuse the plain hf export of a LoRA run: a transformers model does not load
    its adapters (a checkpoint holds no base; final weights hold the adapters under
    names the model does not have, which from_pretrained would drop in silence). A run
    that cannot be exported at all is left for the export to refuse."""
    if not (Path(run_dir) / MODEL_CONFIG_FILE).is_file():
        return
    try:
        run = lora_run(run_dir, newest_weights(run_dir, warn=lambda _: None))
    except UserError:
        return
    if run is not None:
        raise UserError(f"{run_dir} trained LoRA adapters beside a frozen base: export "
                        "them with --format peft, or merged into the base with --format "
                        "hf --merge")

"""``disttrain plan --validate RUN_DIR``: what a finished run measured, against what
the planner predicts for the same model, layout, batch and machine.

From the run directory: the config snapshot (model, layout, batch, precision,
schedule, recomputation), ``summary.json`` (world size, every rank's model-state and
activation bytes, the device) and ``metrics.jsonl`` (step times). Each rank is compared
with its pipeline stage's prediction (:func:`~.estimate.estimate`, ``disttrain``
accounting, the run's own cut of the layers into chunks); the step time is the median
of the logged step times after the first record, whose window holds the first step's
one-off costs. An error is predicted / measured - 1.

A run measures its activations as what autograd saves during forward passes: under
full recomputation the layer rebuilt during a backward is not among them, nor the
fused loss's chunk during a forward, so the compared prediction leaves them out (the
notes give them). The fused loss is assumed as the run's ``train.fused_loss`` says.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import Config, load_config
from ..config.consistency import data_parallel_degree, resolve_batch
from ..config.layout import Layout, resolve_layout
from ..config.schema import ModelConfig
from ..dimensions import DIMENSIONS, Role, with_role
from ..errors import UserError
from ..monitor.record import (
    ACTIVATIONS,
    DEVICE_NAME,
    MEMORY_BYTES,
    MEMORY_BYTES_PER_RANK,
    MODEL_STATE_PARTS,
    STEP_TIME_S,
)
from ..names import (
    CONFIG_FILE,
    METRICS_FILE,
    MODEL_CONFIG_FILE,
    SUMMARY_FILE,
    SYNC_EVERY_STEP,
)
from ..parallel.dimensions import behaviour, stage_pricing
from ..shape import ModelShape, gpt_shape, hf_shape
from .cluster import PRESETS, Cluster, parse_cluster, preset_for_device
from .estimate import Estimate, estimate, layout_fields
from .layout import PlannedLayout
from .options import Options

_RECOMPUTE = ("none", "full")  # the activation_checkpointing modes the planner models


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """What a finished run left in its directory. ``step_times``: ``step_time_s`` of
    each metrics record, in step order."""

    run_dir: Path
    config: Config
    summary: dict[str, Any]
    step_times: list[float]

    @property
    def world_size(self) -> int:
        world = self.summary.get("world_size")
        if not isinstance(world, int) or world < 1:
            raise UserError(f"--validate {self.run_dir}: {SUMMARY_FILE} has no valid "
                            f"world_size ({world!r})")
        return world


def read_run(run_dir: Path) -> RunRecord:
    """The run's config snapshot, summary and step times; a UserError naming the file
    when one is missing or unreadable."""
    if not run_dir.is_dir():
        raise UserError(f"--validate {run_dir}: not a directory; give the run directory "
                        "of a finished 'disttrain train' run")
    config_path = _need(run_dir, CONFIG_FILE, "not a disttrain run directory?")
    summary = _read_json(_need(run_dir, SUMMARY_FILE, "the run has not finished: it is "
                               "written at the end"))
    if not isinstance(summary, dict):
        raise UserError(f"--validate {run_dir}: {SUMMARY_FILE} is not a JSON object")
    times = [r[STEP_TIME_S] for r in _read_records(_need(run_dir, METRICS_FILE, ""))
             if isinstance(r.get(STEP_TIME_S), (int, float))]
    return RunRecord(run_dir=run_dir, config=load_config(config_path), summary=summary,
                     step_times=times)


def _need(run_dir: Path, name: str, why: str) -> Path:
    path = run_dir / name
    if not path.is_file():
        raise UserError(f"--validate {run_dir}: no {name}" + (f" ({why})" if why else ""))
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--validate: cannot read {path} ({exc})") from None


def _read_records(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"--validate: cannot read {path} ({exc})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                raise UserError(f"--validate: {path} line {number} is not JSON") from None
    return [r for r in records if isinstance(r, dict)]


# the run as the planner sees it ---------------------------------------------------

def run_shape(run: RunRecord) -> ModelShape:
    """disttrain's GPT from the ``[model]`` section; a transformers model from the
    config.json the run saved (else ``model.hf_config``, else the dimensions
    ``model.name`` gpt2 / llama is built with), at the run's sequence length."""
    model = run.config.model
    if model.name == "gpt" and not model.hf_config:
        return gpt_shape(model)
    saved = run.run_dir / MODEL_CONFIG_FILE
    source = saved if saved.is_file() else Path(model.hf_config) if model.hf_config \
        else None
    if source is None:
        return _named_shape(model)
    return replace(hf_shape(source), seq=model.seq_len)


def _named_shape(model: ModelConfig) -> ModelShape:
    """What :func:`~disttrain.models.hf.build_hf_model` builds for ``model.name``."""
    common: dict[str, Any] = dict(name=model.name, layers=model.n_layer, hidden=model.d_model,
                  heads=model.n_head, seq=model.seq_len, vocab=model.vocab_size,
                  dropout=model.dropout > 0)
    if model.name == "gpt2":
        return ModelShape(**common, positions=model.seq_len)
    return ModelShape(**common, kv_heads=model.n_kv_head, gated=True, bias=False,
                      qkv_bias=False, norm="rmsnorm", tied=False)


# a rank's stage: its coordinate on the axis that cuts the layers
_STAGE_KEY = with_role(Role.LAYERS)[0].key


def run_layout(run: RunRecord) -> tuple[Layout, PlannedLayout, int]:
    """(the run's mesh, the planner's layout of it, the global batch)."""
    cfg, world = run.config, run.world_size
    if cfg.train.sync != SYNC_EVERY_STEP:
        raise UserError(f"--validate {run.run_dir}: train.sync={cfg.train.sync}; the "
                        f"planner models {SYNC_EVERY_STEP} runs only")
    if cfg.train.activation_checkpointing not in _RECOMPUTE:
        raise UserError(f"--validate {run.run_dir}: train.activation_checkpointing="
                        f"{cfg.train.activation_checkpointing}; the planner models "
                        f"{' or '.join(_RECOMPUTE)}")
    p = cfg.parallel
    mesh = resolve_layout(p, world)
    batch = resolve_batch(cfg.train, cfg.explicit, data_parallel_degree(cfg, mesh))
    degrees = mesh.by_key()
    options = {k: v for d in DIMENSIONS
               for k, v in behaviour(d).pricing.options_from_config(p, degrees[d.key]).items()}
    planned = PlannedLayout(**degrees, **options, mbs=batch.micro_batch, zero=mesh.zero,
                        recompute=cfg.train.activation_checkpointing)
    return mesh, planned, batch.global_batch


def run_chunks(config: Config, planned: PlannedLayout) -> tuple[int, ...] | None:
    """Layers in each chunk as the run cut them (``parallel.pp_split``, or balanced by
    the model's costs: the stage pricing's); None when the layers are not cut, or for a
    transformers model when transformers cannot build it here."""
    if planned.stages == 1:
        return None
    from ..models.gpt import gpt_spec
    from ..models.hf import hf_config_spec, is_hf

    try:
        spec = hf_config_spec(config.model) if is_hf(config.model) else gpt_spec(config.model)
    except (ImportError, OSError, ValueError):
        return None
    return stage_pricing().run_chunks(config.parallel, spec, planned.stages)


def run_cluster(text: str | None, run: RunRecord) -> Cluster:
    """``--cluster`` if given, else the preset of the GPU the run recorded."""
    if text:
        return parse_cluster(text)
    device = str(run.summary.get(DEVICE_NAME) or "")
    preset = preset_for_device(device) if device else None
    if preset is None:
        where = f"on {device!r}" if device else "on a device it did not record"
        raise UserError(f"--validate {run.run_dir}: the run trained {where}, which no "
                        "preset describes; pass --cluster FILE (from 'disttrain plan "
                        "calibrate' on that machine) or --cluster gpu=PRESET,...")
    base = PRESETS[preset]
    return replace(base, nodes=math.ceil(run.world_size / base.gpus_per_node))


# the comparison --------------------------------------------------------------------

def _pair(predicted: float, measured: float | None) -> dict[str, float | None]:
    error = None if not measured else predicted / measured - 1
    return {"predicted": predicted, "measured": measured, "rel_error": error}


def _rank_memory(run: RunRecord, notes: list[str]) -> list[dict[str, Any]]:
    per_rank = run.summary.get(MEMORY_BYTES_PER_RANK)
    if per_rank is None and isinstance(run.summary.get(MEMORY_BYTES), dict):
        notes.append(f"{SUMMARY_FILE} has rank 0's memory only (no "
                     f"{MEMORY_BYTES_PER_RANK}: a run from an older disttrain)")
        per_rank = [run.summary[MEMORY_BYTES]]
    keys = (*MODEL_STATE_PARTS, ACTIVATIONS)
    if not isinstance(per_rank, list) or not all(
            isinstance(m, dict) and all(isinstance(m.get(k), int) for k in keys)
            for m in per_rank):
        raise UserError(f"--validate {run.run_dir}: {SUMMARY_FILE} has no per-rank "
                        f"memory ({MEMORY_BYTES_PER_RANK}: {', '.join(keys)} per rank)")
    return per_rank


def compare(run: RunRecord, mesh: Layout, est: Estimate, global_batch: int,
            cluster: Cluster, notes: list[str]) -> dict[str, Any]:
    """The JSON object of the comparison (see the module docstring)."""
    ranks = []
    for rank, measured in enumerate(_rank_memory(run, notes)):
        stage = mesh.coordinates(rank)[_STAGE_KEY]
        mem = est.stage_memory(stage)
        ranks.append({"rank": rank, "stage": stage,
                      "model_states": _pair(mem.model_states,
                                            sum(measured[k] for k in MODEL_STATE_PARTS)),
                      "activations": _pair(mem.activations - mem.transient,
                                           measured[ACTIVATIONS])})
    rebuilt = max(m.rebuilt for m in est.stages if m is not None)
    if rebuilt:
        notes.append(f"full recomputation: the prediction also holds one layer rebuilt "
                     f"during its backward ({_bytes(rebuilt)}), which the run's "
                     "saved-tensor meter does not see; left out of the comparison")
    chunk = max(m.loss_transient for m in est.stages if m is not None)
    if chunk:
        notes.append(f"fused loss: the prediction also holds its chunk during the last "
                     f"stage's forward ({_bytes(chunk)}), which the run's saved-tensor "
                     "meter does not see; left out of the comparison")
    steps = run.step_times[1:] if len(run.step_times) > 1 else run.step_times
    time = _pair(est.step_time_s, statistics.median(steps) if steps else None)
    planned = est.layout
    return {"run_dir": str(run.run_dir), "model": run.config.model.name,
            "layout": layout_fields(planned),
            "global_batch": global_batch, "precision": run.config.train.precision,
            "cluster": cluster.name, "cluster_source": cluster.source, "ranks": ranks,
            "step_time_s": {**time, "steps": len(steps),
                            "warmup_records_skipped": len(run.step_times) - len(steps)},
            "model_states_rel_error_max": _worst(ranks, "model_states"),
            "activations_rel_error_max": _worst(ranks, "activations"), "notes": notes}


def _worst(ranks: list[dict[str, Any]], part: str) -> float | None:
    errors = [abs(r[part]["rel_error"]) for r in ranks if r[part]["rel_error"] is not None]
    return max(errors) if errors else None


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _error(e: float | None) -> str:
    return "-" if e is None else f"{100 * e:+.1f}%"


def format_report(report: dict[str, Any]) -> str:
    """The comparison as a table: one row per rank, then the step time and notes."""
    planned, t = report["layout"], report["step_time_s"]
    layout = ",".join(f"{k}={v}" for k, v in planned.items())
    lines = [f"validate {report['run_dir']}: {report['model']}, {layout}, global batch "
             f"{report['global_batch']}, {report['precision']}; cluster "
             f"{report['cluster']} ({report['cluster_source']})",
             f"{'rank':>4} {'stage':>5}  {'model states':>12} {'measured':>11} {'error':>7}"
             f"  {'activations':>12} {'measured':>11} {'error':>7}"]
    for r in report["ranks"]:
        s, a = r["model_states"], r["activations"]
        lines.append(f"{r['rank']:>4} {r['stage']:>5}  {_bytes(s['predicted']):>12} "
                     f"{_bytes(s['measured']):>11} {_error(s['rel_error']):>7}  "
                     f"{_bytes(a['predicted']):>12} {_bytes(a['measured']):>11} "
                     f"{_error(a['rel_error']):>7}")
    measured = "-" if t["measured"] is None else f"{t['measured']:.4g} s"
    lines.append(f"step time: predicted {t['predicted']:.4g} s, measured {measured} "
                 f"(median of {t['steps']} logged steps, {t['warmup_records_skipped']} "
                 f"warm-up record skipped), error {_error(t['rel_error'])}")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def validate_run(run_dir: Path, cluster_text: str | None = None) -> dict[str, Any]:
    """Read the run at ``run_dir``, predict it on the cluster, compare."""
    run = read_run(run_dir)
    mesh, planned, global_batch = run_layout(run)
    cluster = run_cluster(cluster_text, run)
    cfg = run.config
    notes: list[str] = []
    if cfg.train.optimizer not in ("adamw", "lamb"):
        notes.append(f"train.optimizer={cfg.train.optimizer}: the planner counts AdamW's "
                     "8 bytes of state per parameter")
    chunks = run_chunks(cfg, planned)
    if planned.stages > 1 and chunks is None:
        notes.append("the run's pipeline cut is not known here (transformers cannot "
                     "build its model): layers assumed evenly split")
    options = Options(precision=cfg.train.precision, accounting="disttrain",
                      bucket_mb=cfg.parallel.bucket_mb, log_every=cfg.train.log_every,
                      fused_loss=cfg.train.fused_loss)
    est = estimate(run_shape(run), cluster, planned, global_batch, options, all_stages=True,
                   chunk_sizes=chunks)
    return compare(run, mesh, est, global_batch, cluster, notes)


def run_validate(ns: argparse.Namespace) -> int:
    report = validate_run(Path(ns.validate), ns.cluster)
    print(json.dumps(report) if ns.json else format_report(report))
    return 0

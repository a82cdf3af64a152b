"""Planning without running: estimates a planner uses to choose a layout.

Pure Python over configs and formulas; nothing here creates a process group or
allocates model memory (``plan calibrate`` aside, which measures the machine). A layout
is a degree per declared dimension (:mod:`disttrain.dimensions`); each dimension's own
candidates, rules and messages are its pricing (:mod:`disttrain.parallel.dimensions`),
the rest is priced here over the roles' degrees. The pipeline schedules' in-flight
counts are the pipeline's own (:mod:`disttrain.parallel.pipeline.pricing`).

    shape = parse_model("layers=32,hidden=4096,heads=32,seq=4096,vocab=32000")
    cluster = parse_cluster("gpu=h100-80gb,gpus_per_node=8,nodes=4")
    result = search(shape, cluster, global_batch=512, options=Options(precision="bf16"))
    best = result.rows[0]          # an Estimate: best.row() is the JSON row
"""

from ..shape import ModelShape, gpt_shape, hf_shape, parse_model
from .cluster import PRESETS, Cluster, parse_cluster
from .estimate import Estimate, estimate
from .layout import PlannedLayout
from .memory import (
    MemoryEstimate,
    estimate_gpt,
    gpt_activation_bytes,
    layer_activation_bytes,
    model_state_bytes,
)
from .options import Options
from .search import SearchResult, layout_problem, search

__all__ = ["PRESETS", "Cluster", "Estimate", "MemoryEstimate", "ModelShape", "Options",
           "PlannedLayout", "SearchResult", "estimate", "estimate_gpt", "gpt_activation_bytes",
           "gpt_shape", "hf_shape", "layer_activation_bytes",
           "layout_problem", "model_state_bytes", "parse_cluster", "parse_model", "search"]

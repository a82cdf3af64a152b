"""Planning without running: estimates a planner uses to choose a layout.

Pure Python over configs and formulas; nothing here creates a process group or
allocates model memory (``plan calibrate`` aside, which measures the machine).

    shape = parse_model("layers=32,hidden=4096,heads=32,seq=4096,vocab=32000")
    cluster = parse_cluster("gpu=h100-80gb,gpus_per_node=8,nodes=4")
    result = search(shape, cluster, global_batch=512, options=Options(precision="bf16"))
    best = result.rows[0]          # an Estimate: best.row() is the JSON row
"""

from .cluster import PRESETS, Cluster, parse_cluster
from .estimate import Estimate, estimate, in_flight, layer_activation_bytes
from .layout import PlannedLayout
from .memory import MemoryEstimate, estimate_gpt, gpt_activation_bytes, model_state_bytes
from .options import Options
from .search import SearchResult, layout_problem, search
from .shape import ModelShape, gpt_shape, hf_shape, parse_model

__all__ = ["PRESETS", "Cluster", "Estimate", "MemoryEstimate", "ModelShape", "Options",
           "PlannedLayout", "SearchResult", "estimate", "estimate_gpt", "gpt_activation_bytes",
           "gpt_shape", "hf_shape", "in_flight", "layer_activation_bytes",
           "layout_problem", "model_state_bytes", "parse_cluster", "parse_model", "search"]

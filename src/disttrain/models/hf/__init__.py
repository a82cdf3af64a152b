"""Hugging Face ``transformers`` causal-LM models: built from ``[model]`` (:mod:`.build`),
recognised by their module structure whoever built them (:mod:`.recognise`, with the
tensor-parallel plan of :mod:`.tp_plan`), so every strategy applies to them, and their
FLOPs per token (:mod:`.flops`). ``transformers`` is imported only when a model is
built (the ``hf`` extra); validation refuses these settings without it. What is
recognised, and what is refused: docs/guides/finetune.md ("Transformers models under
tensor and pipeline parallelism")."""

from .build import MAX_CONFIG_BYTES, build_hf_model, hf_config_spec, is_hf, read_hf_config
from .flops import hf_dimensions, hf_flops_per_token, matmul_flops_per_token
from .recognise import hf_spec

__all__ = ["MAX_CONFIG_BYTES", "build_hf_model", "hf_config_spec", "hf_dimensions",
           "hf_flops_per_token", "hf_spec", "is_hf", "matmul_flops_per_token",
           "read_hf_config"]

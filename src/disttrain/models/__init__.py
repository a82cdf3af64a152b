"""Plain models (no parallelism inside) with their specs and FLOP formulas."""

from ..spec import Divisor, ModelSpec, generic_spec, register_spec, spec_for
from . import hf  # noqa: F401  (registers the transformers recogniser)
from .gpt import GPT, GPT_TP_PLAN, IGNORE_INDEX, flops_per_token, gpt_spec, num_params, token_loss

__all__ = ["GPT", "GPT_TP_PLAN", "IGNORE_INDEX", "Divisor", "ModelSpec", "flops_per_token",
           "generic_spec", "gpt_spec", "num_params", "register_spec", "spec_for",
           "token_loss"]

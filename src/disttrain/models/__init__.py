"""Plain models (no parallelism inside) with their FLOP formulas."""

from .gpt import GPT, IGNORE_INDEX, flops_per_token, num_params, token_loss

__all__ = ["GPT", "IGNORE_INDEX", "flops_per_token", "num_params", "token_loss"]

"""Planning without running: estimates a planner uses to choose a layout.

Pure Python over configs and formulas; nothing here creates a process group or
allocates model memory.
"""

from .memory import MemoryEstimate, estimate_gpt, gpt_activation_bytes, model_state_bytes

__all__ = ["MemoryEstimate", "estimate_gpt", "gpt_activation_bytes", "model_state_bytes"]

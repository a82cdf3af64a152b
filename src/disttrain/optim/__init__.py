"""Optimizers that torch does not ship (LARS, LAMB), and which parameters take weight
decay; the optimizer each ``train.optimizer`` name builds is registered in
:mod:`disttrain.parallel.registry`."""

from .groups import decay_groups, takes_decay
from .layerwise import LAMB, LARS, trust_ratio

__all__ = ["LAMB", "LARS", "decay_groups", "takes_decay", "trust_ratio"]

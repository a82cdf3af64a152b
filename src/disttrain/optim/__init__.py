"""Optimizers that torch does not ship (LARS, LAMB); the optimizer each
``train.optimizer`` name builds is registered in :mod:`disttrain.parallel.registry`."""

from .layerwise import LAMB, LARS, trust_ratio

__all__ = ["LAMB", "LARS", "trust_ratio"]

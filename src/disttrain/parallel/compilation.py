"""torch.compile per block (``train.compile``): each block of the model's block list
runs as a compiled region; the modules around the blocks and everything between them
stay eager.

Per block, not the whole model, because the strategies act on the parameters and at the
blocks' edges, never inside a block: compiled this way, dynamo never traces a
collective. :func:`check_compile` refuses what cannot work; why each strategy is
unaffected: ``docs/strategies/memory.md``, "Compilation".
"""

from __future__ import annotations

import importlib.util
import shutil
from typing import Any

from torch import nn

from ..config.consistency import on_gpu
from ..config.schema import Config
from ..errors import ConfigError
from ..param_names import COMPILED
from ..spec import ModelSpec
from .wrappers import hide_segment


class CompiledBlock(nn.Module):
    """Runs ``compiled`` (the wrapped block) through torch.compile
    (``nn.Module.compile``); this wrapper itself stays eager, so what is registered on
    the block list's element (ZeRO-3's hooks, the checkpointing wrapper) runs outside
    the compiled region. Unlike ``torch.compile(model)``'s ``OptimizedModule``
    (``_orig_mod.*``), its segment is dropped from parameter names
    (:func:`~disttrain.param_names.canonical_name`) and state-dict keys, so checkpoints
    carry the model's own names."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.compiled = block
        block.compile()  # compiles the block's __call__, not this wrapper's
        hide_segment(self, COMPILED)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


def compile_blocks(blocks: nn.ModuleList) -> int:
    """Wrap every block of ``blocks`` in place in a :class:`CompiledBlock`; returns how
    many were wrapped. Call it before anything wraps or hooks the blocks (activation
    checkpointing, pipeline cuts, ZeRO), so that those stay outside the compiled code."""
    wrapped = 0
    for i, block in enumerate(blocks):
        if not isinstance(block, CompiledBlock):
            blocks[i] = CompiledBlock(block)
            wrapped += 1
    return wrapped


def check_compile(config: Config, spec: ModelSpec) -> None:
    """Refuse ``train.compile=true`` where it cannot apply, saying why."""
    if not config.train.compile:
        return
    if spec.blocks is None:
        raise ConfigError("train.compile", True, "compiles the model block by block and "
                          "this model's spec names no block list",
                          "keep the blocks in an nn.ModuleList (or pass a ModelSpec "
                          "naming it), or set train.compile=false")
    _check_compiler(config)


def _check_compiler(config: Config) -> None:
    """Inductor, torch.compile's backend, generates Triton kernels on GPU and C++ on CPU."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError("train.compile", True, "torch.compile does not support this "
                          "Python version or platform", "set train.compile=false")
    if on_gpu(config.train):
        if importlib.util.find_spec("triton") is None:
            raise ConfigError("train.compile", True, "inductor needs Triton on GPU and "
                              "it is not installed", "pip install triton, or set "
                              "train.compile=false")
        return
    from torch._inductor import config as inductor  # the compilers it looks for

    names = [c for c in inductor.cpp.cxx if c]
    if not any(shutil.which(c) for c in names):
        raise ConfigError("train.compile", True, "inductor compiles CPU kernels with a "
                          f"C++ compiler and none was found (looked for "
                          f"{', '.join(names)})", "install g++ (or point $CXX at a "
                          "compiler), or set train.compile=false")

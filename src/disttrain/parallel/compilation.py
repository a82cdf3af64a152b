"""torch.compile per block (``train.compile``): each block of the model's block list
runs as a compiled region; the modules around the blocks and everything between them
stay eager.

Why per block, not the whole model: the strategies act on the parameters and at the
blocks' edges, never inside a block. Data parallelism's post-accumulate hooks sit on the
parameters and are fired by the autograd engine after a compiled backward as after an
eager one; ZeRO's parameters are views of flat buffers, which a compiled graph takes as
inputs; ZeRO-3 gathers and frees a block's parameters in hooks on the block; activation
checkpointing wraps the block; a pipeline chunk runs whole blocks between its messages.
:class:`CompiledBlock` compiles the block's own call (``nn.Module.compile``) and stays
eager itself, so everything registered on the block list's element (ZeRO-3's hooks, the
checkpointing wrapper) runs outside the compiled region: dynamo never traces a
collective. ``torch.compile(model)`` would trace them all, and its ``OptimizedModule``
would rename every parameter ``_orig_mod.*``; here the wrapper's segment is dropped from
parameter names (:func:`~disttrain.param_names.canonical_name`) and state-dict keys, so
checkpoints carry the model's own names.

:func:`check_compile` refuses, before launch, what cannot work: a model whose spec names
no block list, and a machine without the compiler inductor needs (a dimension whose
layers issue collectives inside every block, tensor parallelism, refuses it in its own
check).
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
    """Runs ``compiled`` (the wrapped block) through torch.compile; this wrapper itself
    stays eager, so hooks registered on it run outside the compiled region."""

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

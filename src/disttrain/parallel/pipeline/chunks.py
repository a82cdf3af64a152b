"""A pipeline chunk built from the original model's submodules (the same parameter
objects, no copies, under the same paths, so ``named_parameters()`` keep the model's
names): chunk 0 also holds what runs before the blocks (``spec.before``), the last
chunk what runs after them (``spec.after``). A tied weight (``spec.tied``) has a copy
on the last chunk, saved from chunk 0 only (``PipelineChunk.tied_copies``);
:mod:`.tied` keeps the two equal. How the model's own forward runs on a chunk:
docs/strategies/pipeline.md."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

import torch
from torch import nn

from ...spec import ModelSpec, block_list, output_logits
from .cuts import StagePlan


class PipelineChunk(nn.Module):
    """Chunk ``index`` of a model: blocks ``bounds[index] : bounds[index + 1]``, plus
    ``spec.before`` on the first chunk and ``spec.after`` on the last.

    ``chunk(x, inputs)``: ``inputs`` are the micro-batch's model inputs (a tensor, or an
    object with ``args`` / ``kwargs``); ``x`` the activation [B, T, hidden] received
    from the previous chunk (None on the first). The last chunk returns the model's
    logits, the others [B, T, hidden].

    Two ways to run a chunk, by the spec:

    - ``spec.embed`` / ``spec.finish`` (the built-in GPT): the first chunk embeds the
      inputs, every chunk runs its blocks on a single tensor, the last one finishes;
    - ``spec.inject`` (any model whose forward is embeddings -> the block list -> final
      pieces, e.g. a transformers causal LM): the chunk runs the model's *own* forward
      on a shell, a shallow copy of the model whose block list holds only this chunk's
      blocks, whose ``before`` modules are replaced on later chunks by stand-ins (the
      ``inject`` module returns the received activation, other embeddings return zeros,
      the rest pass their input through) and whose ``after`` modules pass through on
      earlier chunks. So everything the model computes for its blocks from the inputs
      (attention masks, rotary position embeddings, position ids) is computed again on
      every stage from the micro-batch's own inputs, which every stage has: only the
      hidden state travels between stages. :func:`check_cut` verifies once that the
      stand-ins reproduce the whole model.
    """

    def __init__(self, model: nn.Module, spec: ModelSpec, plan: StagePlan,
                 index: int) -> None:
        super().__init__()
        self.index, self.spec = index, spec
        self.is_first, self.is_last = index == 0, index == plan.n_chunks - 1
        self.tied_copies: tuple[str, ...] = ()
        self.tied_pairs: list[tuple[str, int]] = []  # (local name, peer pp rank)
        start, stop = plan.bounds[index], plan.bounds[index + 1]
        self.blocks_path, blocks = _pipeline_blocks(model, spec)
        # Keyed by the block's index in the full model, so parameter names are kept.
        mine = BlockSlice({i: blocks[i] for i in range(start, stop)})
        subs: dict[str, nn.Module] = {self.blocks_path: mine}
        split = plan.pp > 1 and not (self.is_first and self.is_last)
        for owner, copy_name in spec.tied if split else ():
            if model.get_parameter(owner) is not model.get_parameter(copy_name):
                continue
            if self.is_first:
                self.tied_pairs.append((owner, plan.rank_of(plan.n_chunks - 1)))
            elif self.is_last:  # own module and Parameter, same values
                holder = copy_name.rpartition(".")[0]
                subs[holder] = copy.deepcopy(model.get_submodule(holder))
                subs[holder].get_parameter(copy_name.rpartition(".")[2]).grad = None
                self.tied_copies += (copy_name,)
                self.tied_pairs.append((copy_name, plan.rank_of(0)))
        self._received = _Received()
        if spec.inject is None:  # spec.embed / spec.finish on a holder of the pieces
            for path in spec.before if self.is_first else ():
                _attach(self, path, model.get_submodule(path))
            _attach(self, self.blocks_path, mine)
            for path in spec.after if self.is_last else ():
                _attach(self, path, subs[path] if path in subs else model.get_submodule(path))
            self._nodes: list[nn.Module] = []
            self.__dict__["_shell"] = None
            return
        subs.update(_stand_ins(model, spec, self._received, first=self.is_first,
                               last=self.is_last))
        shell, self._nodes = _shell(model, subs)
        self.__dict__["_shell"] = shell  # not a submodule: its children are ours
        for name, child in shell.named_children():
            self.add_module(name, child)

    def forward(self, x: torch.Tensor | None, inputs: Any = None) -> torch.Tensor:
        if inputs is None and self.is_first:
            x, inputs = None, x
        shell = self.__dict__["_shell"]
        if shell is None:
            return self._run_pieces(x, inputs)
        self._received.value = x
        try:
            return output_logits(_call(shell, inputs))
        finally:
            self._received.value = None

    def _run_pieces(self, x: torch.Tensor | None, inputs: Any) -> torch.Tensor:
        """``spec.embed`` on the first chunk, the blocks, ``spec.finish`` on the last;
        the keyword inputs the spec names go to the embedding and to every block."""
        ids, to_embed, to_blocks = _piece_inputs(inputs, self.spec)
        if self.is_first:
            if self.spec.embed is None:
                raise ValueError("the first pipeline chunk needs spec.embed (or spec.inject)")
            if ids is None:
                raise ValueError("the first pipeline chunk ran without the micro-batch's inputs")
            x = self.spec.embed(self, ids, **to_embed)
        elif x is None:
            raise RuntimeError("a later pipeline chunk ran without a received activation")
        for block in self._block_slice():
            x = block(x, **to_blocks)
        if not self.is_last:
            return x
        if self.spec.finish is None:
            raise ValueError("the last pipeline chunk needs spec.finish (or spec.inject)")
        return self.spec.finish(self, x)

    def _block_slice(self) -> nn.ModuleList:
        blocks = self.get_submodule(self.blocks_path)
        if not isinstance(blocks, nn.ModuleList):  # never: the chunk put its slice there
            raise TypeError(f"{self.blocks_path!r} is a {type(blocks).__name__}")
        return blocks

    def train(self, mode: bool = True) -> PipelineChunk:
        super().train(mode)
        for node in self._nodes:  # the shell's own copies of the model's containers
            node.training = mode
        return self

    def replace_module(self, path: str, new: nn.Module) -> nn.Module:
        """Put ``new`` at dotted ``path`` where this chunk runs it (and registers it);
        returns the module it replaced. On a shell the containers along the path are
        copied first, so the model the shell was copied from keeps its own."""
        old = self.get_submodule(path)
        shell = self.__dict__["_shell"]
        *parents, leaf = path.split(".")
        if shell is None:
            holder = self.get_submodule(".".join(parents)) if parents else self
            setattr(holder, leaf, new)
            return old
        node = shell
        for name in parents:
            copied = _shallow(_child(node, name))
            node._modules[name] = copied
            self._nodes.append(copied)
            node = copied
        node._modules[leaf] = new
        self.add_module(path.split(".")[0], shell._modules[path.split(".")[0]])
        return old

    def chunk_blocks(self) -> list[nn.Module]:
        """This chunk's blocks, in order."""
        return list(self._block_slice())

    @property
    def tie_peer(self) -> int | None:
        """The pp rank holding the other copy of this chunk's tied weight, if any."""
        return self.tied_pairs[0][1] if self.tied_pairs else None

    def tied_weights(self) -> list[tuple[nn.Parameter, int]]:
        """This chunk's copies of tied weights whose other copy lives on another pp
        rank, with that rank."""
        return [(self.get_parameter(name), peer) for name, peer in self.tied_pairs]


class BlockSlice(nn.ModuleList):
    """Some of a model's blocks, registered under their indices in the full block list
    (``layers.5``, ``layers.6``), iterated in order like the full list."""

    def __init__(self, blocks: Mapping[int, nn.Module] | Iterable[nn.Module] = ()) -> None:
        super().__init__()
        items = blocks.items() if isinstance(blocks, Mapping) else enumerate(blocks)
        for i, block in items:
            self.add_module(str(i), block)

    @overload
    def __getitem__(self, idx: slice) -> BlockSlice: ...
    @overload
    def __getitem__(self, idx: int) -> nn.Module: ...

    def __getitem__(self, idx: int | slice) -> nn.Module | BlockSlice:
        values = list(self._modules.values())
        return BlockSlice(values[idx]) if isinstance(idx, slice) else values[idx]


class _Received(nn.Module):
    """Stands in for the module whose output is the first hidden state: returns the
    activation the chunk received."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.value is None:
            raise RuntimeError("a later pipeline chunk ran without a received activation")
        return self.value


class _Zeros(nn.Module):
    """Stands in for another embedding (positions, token types) on later chunks: adds
    nothing to the received activation."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


class _PassThrough(nn.Module):
    """Stands in for a module the chunk does not run: returns its first input."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Set ``module`` at dotted ``path`` under ``root``, creating plain holder modules
    for the intermediate names (so parameter names match the full model's)."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if name not in node._modules:
            node.add_module(name, nn.Module())
        node = _child(node, name)
    node.add_module(leaf, module)


def _child(node: nn.Module, name: str) -> nn.Module:
    """``node``'s registered child ``name`` (refused if registered as None)."""
    child = node._modules[name]
    if child is None:
        raise ValueError(f"{type(node).__name__} has no module {name!r} (registered as None)")
    return child


def _pipeline_blocks(model: nn.Module, spec: ModelSpec) -> tuple[str, nn.ModuleList]:
    """The block list's path and the list itself, which a pipeline cut needs."""
    blocks = block_list(model, spec)
    if spec.blocks is None or blocks is None:
        raise ValueError("a pipeline cut needs a ModelSpec naming the block list (blocks)")
    return spec.blocks, blocks


def _stand_in(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Embedding):
        return _Zeros(module.embedding_dim, module.weight.dtype)
    return _PassThrough()


def _stand_ins(model: nn.Module, spec: ModelSpec, received: _Received, *, first: bool,
               last: bool) -> dict[str, nn.Module]:
    """What a chunk's shell puts in place of the pieces it does not run: on a later
    chunk the ``before`` modules (``inject`` -> ``received``), on an earlier one the
    ``after`` modules."""
    subs: dict[str, nn.Module] = {}
    for path in () if first else spec.before:
        subs[path] = received if path == spec.inject else _stand_in(
            model.get_submodule(path))
    for path in () if last else spec.after:
        subs[path] = _PassThrough()
    return subs


def _shell(model: nn.Module, subs: Mapping[str, nn.Module]
           ) -> tuple[nn.Module, list[nn.Module]]:
    """A shallow copy of ``model`` with the submodules at ``subs``' paths replaced
    (every container on a path copied, every other submodule shared); returns it and
    the copied containers."""
    copies = {"": _shallow(model)}
    for path, new in subs.items():
        *parents, leaf = path.split(".")
        node, prefix = copies[""], ""
        for name in parents:
            prefix = f"{prefix}.{name}" if prefix else name
            if prefix not in copies:
                copies[prefix] = _shallow(_child(node, name))
                node._modules[name] = copies[prefix]
            node = copies[prefix]
        node._modules[leaf] = new
    return copies[""], list(copies.values())


def _shallow(module: nn.Module) -> nn.Module:
    clone = copy.copy(module)
    for table in ("_modules", "_parameters", "_buffers"):
        setattr(clone, table, dict(getattr(module, table)))
    return clone


def _call(fn: Callable[..., Any], inputs: Any) -> Any:
    """``fn`` on a micro-batch's model inputs (a tensor, or ``args`` / ``kwargs``)."""
    if isinstance(inputs, torch.Tensor):
        return fn(inputs)
    return fn(*inputs.args, **inputs.kwargs)


def _piece_inputs(inputs: Any, spec: ModelSpec
                  ) -> tuple[torch.Tensor | None, dict[str, Any], dict[str, Any]]:
    """(token ids, keyword inputs for ``spec.embed``, keyword inputs for every block) of
    a micro-batch: the ids are its one positional input, else ``input_ids``, else its
    one keyword input; every other keyword input must be one the spec hands on. No
    inputs (a later chunk called on its activation alone): none."""
    if inputs is None or isinstance(inputs, torch.Tensor):
        return inputs, {}, {}
    keywords = dict(inputs.kwargs)
    handed = (*spec.embed_inputs, *spec.block_inputs)
    ids = list(inputs.args)
    if not ids and "input_ids" in keywords:
        ids.append(keywords.pop("input_ids"))
    rest = [k for k in keywords if k not in handed]
    if not ids and len(rest) == 1:
        ids.append(keywords.pop(rest.pop()))
    if len(ids) != 1 or rest:
        takes = " and ".join(["one token input", *handed])
        raise ValueError(f"this model's pipeline stages take {takes}; the batch has "
                         f"{len(inputs.args)} positional input(s) and "
                         f"{', '.join(inputs.kwargs) or 'no keyword inputs'}")
    return (ids[0], {k: v for k, v in keywords.items() if k in spec.embed_inputs},
            {k: v for k, v in keywords.items() if k in spec.block_inputs})

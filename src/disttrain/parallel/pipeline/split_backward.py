"""A chunk's backward in two passes: B, the gradient of its input (what the previous
stage waits for), then W, its weight gradients (which a zero-bubble schedule runs
later, in what would be idle time).

For a chunk ``y = f(x; theta)`` and the gradient ``g = dL/dy`` it received:

- B runs autograd from ``y`` to ``x`` only, keeping the graph. On its way it passes
  the *frontier*: the nodes on the path to ``x`` with an edge into a part of the graph
  that leads to parameters but not to ``x`` (for a linear layer, its matmul's node,
  whose other edge goes to the weight). Hooks record the gradient each frontier node
  receives (``dL/d`` its forward output);
- W runs autograd from the frontier nodes, fed those recorded gradients, to the
  parameters, one group of parameters at a time (the parameters reached from a set
  of frontier nodes), so nothing on the path to ``x`` is computed again except the
  frontier nodes themselves (their other outputs are not asked for). A frontier node
  that W reaches again from another frontier node gets its recorded gradient, never a
  second one.

What B keeps for W is only what W reads: the saved tensors of the nodes W runs (the
frontier nodes, e.g. a linear layer's input, and the nodes between them and the
parameters) and the recorded gradients. Forwards run under :class:`WeightPassSaves`,
which boxes every saved tensor; B notes which node reads which box and empties the
boxes of the nodes W never runs (softmax outputs, activations' inputs, dropout masks),
so a micro-batch waiting for its W holds less than one waiting for its B. The vector
parameters' gradients (norm scales and shifts: cheap, and their nodes' inputs and
gradients would otherwise wait for W) are computed in B and accumulated in W.

The gradients W accumulates into ``.grad`` are those of the fused backward (same
nodes, same inputs; summation order within a node unchanged). Parameters'
accumulation hooks (data parallelism's buckets, ZeRO's reduce-scatter) fire in W.
A chunk without an input (the first) keeps its whole backward for W.

The idea is the zero-bubble paper's (Qi et al., 2023) and torch's pipelining
``stage_backward_input`` / ``stage_backward_weight``; written here on
``torch.autograd.graph`` (``GradientEdge``, node pre-hooks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

_RELEASED = object()  # a box emptied after B: no W reads it


class _Box:
    """What the graph holds instead of a saved tensor (see :class:`WeightPassSaves`)."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


class WeightPassSaves(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks for a split schedule's forwards: each tensor autograd saves
    is boxed, so that :func:`backward_input` can empty the boxes no W reads. ``inner``:
    hooks to pack through inside the box (a :class:`SavedActivationMeter`, whose count
    drops when a box is emptied)."""

    def __init__(self, inner: torch.autograd.graph.saved_tensors_hooks | None = None
                 ) -> None:
        self._inner = inner
        self._node: Node | None = None  # the node B is running, while one runs
        self._reads: list[tuple[Node, _Box]] | None = None  # during B only
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Box:
        return _Box(self._inner.pack_hook(tensor) if self._inner else tensor)

    def _unpack(self, box: _Box) -> torch.Tensor:
        if box.packed is _RELEASED:  # never: B keeps what the nodes W runs read
            raise RuntimeError("a W pass read a saved tensor that its B released")
        if self._reads is not None and self._node is not None:
            self._reads.append((self._node, box))
        return self._inner.unpack_hook(box.packed) if self._inner else box.packed

    def track_reads(self, nodes: Sequence[Node], keep: set[Node]) -> list:
        """Hooks (to remove after B), one per node of ``nodes`` (those B runs), that
        note which boxes the nodes outside ``keep`` (those no W runs) read."""
        self._reads = []

        def enter(node: Node | None) -> Callable[[tuple], None]:
            def hook(_grad_outputs: tuple) -> None:
                self._node = node
            return hook
        return [n.register_prehook(enter(None if n in keep else n)) for n in nodes]

    def release_read(self) -> None:
        """Empty the boxes the tracked nodes read; the others (read by nodes W runs
        again, or on the weights' side of the graph, which B does not run) stay."""
        reads, self._reads, self._node = self._reads or [], None, None
        for _, box in reads:
            box.packed = _RELEASED

    def hold(self, tensors: Iterable[torch.Tensor]) -> list[Any]:
        """Count ``tensors`` (recorded gradients W keeps) in the inner meter for as
        long as the returned list lives; nothing without one."""
        return [self._inner.pack_hook(t) for t in tensors] if self._inner else []


@dataclass
class DeferredWeightGrads:
    """What B kept for W: ``groups`` of (frontier nodes, their recorded gradients, the
    parameters they reach); or, for a chunk without input, the ``output`` and its
    ``grad`` for a whole backward. ``vectors``: (parameter, gradient) of the vector
    parameters, whose gradients B computed; ``held``: the meter's count of the
    recorded gradients (see :meth:`WeightPassSaves.hold`)."""

    groups: list[tuple[list[Node], list[tuple], list[torch.Tensor]]] = field(
        default_factory=list)
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    vectors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    held: list[Any] = field(default_factory=list)


def backward_input(output: torch.Tensor, grad: torch.Tensor | None,
                   x: torch.Tensor | None, params: Iterable[torch.Tensor],
                   saves: WeightPassSaves | None = None
                   ) -> tuple[torch.Tensor | None, DeferredWeightGrads]:
    """B: ``dL/dx`` for the chunk output ``output`` (receiving ``grad``, None for a
    scalar loss) and its input ``x`` (a leaf [b, T, d] requiring grad, or None), and
    what W needs. ``dL/dx`` is zeros where ``x`` does not reach ``output``. ``saves``:
    the hooks the forward ran under; the saved tensors no W reads are released."""
    if x is None or output.grad_fn is None:
        return None, DeferredWeightGrads(output=output, grad=grad)
    x_node = get_gradient_edge(x).node
    param_nodes = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    children = _graph(output.grad_fn)
    to_x = _reaching(children, {x_node})
    to_params = _reaching(children, set(param_nodes))
    frontier = [n for n in children if n in to_x and any(
        c in to_params and c not in to_x for c in children[n])]
    groups = _groups(children, frontier, to_x, param_nodes)
    # vector parameters (norm scales, their biases): their gradients come in B, from
    # the nodes B runs anyway, so W keeps neither their inputs nor their gradients
    vectors = [ps for _, ps in groups if all(p.dim() <= 1 for p in ps)]
    groups = [(nodes, ps) for nodes, ps in groups if any(p.dim() > 1 for p in ps)]
    now = [p for ps in vectors for p in ps]
    recorded: dict[Node, tuple] = {}
    handles = [n.register_prehook(_recorder(recorded, n)) for nodes, _ in groups
               for n in nodes]
    if saves is not None:
        runs = _weight_pass_nodes(children, groups, param_nodes)
        handles += saves.track_reads([n for n in children if n in to_x], runs)
    try:
        dx, *vector_grads = torch.autograd.grad(
            output, [x, *now], grad_outputs=grad, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    kept = DeferredWeightGrads(groups=[(nodes, [recorded.get(n, ()) for n in nodes], ps)
                                       for nodes, ps in groups],
                               vectors=[(p, g) for p, g in zip(now, vector_grads,
                                                               strict=True)
                                        if g is not None])
    if saves is not None:
        saves.release_read()
        kept.held = saves.hold(g for _, grads, _ in kept.groups for r in grads
                               for g in r if g is not None)
    return dx if dx is not None else torch.zeros_like(x), kept


def _weight_pass_nodes(children: dict[Node, list[Node]],
                       groups: Sequence[tuple[list[Node], list[torch.Tensor]]],
                       param_nodes: dict[Node, torch.Tensor]) -> set[Node]:
    """The nodes on the path to x that W runs: each group's frontier nodes and, in a
    group of several (a parameter used twice), those on a path from its frontier nodes
    to its parameters (W runs them again on the way to the next frontier node)."""
    by_param = {id(p): n for n, p in param_nodes.items()}
    runs = {n for nodes, _ in groups for n in nodes}
    for nodes, params in groups:
        if len(nodes) > 1:  # one alone: its path-to-x children reach none of them
            runs |= _below(children, nodes) & _reaching(
                children, {by_param[id(p)] for p in params})
    return runs


def _below(children: dict[Node, list[Node]], roots: Sequence[Node]) -> set[Node]:
    """``roots`` and every node reachable from them."""
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(children[node])
    return seen


def backward_weight(kept: DeferredWeightGrads) -> None:
    """W: accumulate the chunk's weight gradients into ``.grad`` from what
    :func:`backward_input` kept (the graph is freed after)."""
    if kept.output is not None:
        if kept.output.requires_grad:  # else nothing before it trains (a frozen chunk)
            torch.autograd.backward(kept.output, grad_tensors=kept.grad)
        return
    if kept.vectors:  # through autograd: their accumulation hooks fire here, in W
        torch.autograd.backward([p for p, _ in kept.vectors],
                                grad_tensors=[g for _, g in kept.vectors])
    for nodes, grads, params in kept.groups:
        edges, values = [], []
        for node, recorded in zip(nodes, grads, strict=True):
            for slot, g in enumerate(recorded):
                if g is not None:
                    edges.append(GradientEdge(node, slot))
                    values.append(g)
        # every frontier node gets its recorded input, the very tensors of B (also
        # when another frontier node reaches it again)
        handles = [n.register_prehook(lambda _g, r=r: r) for n, r in
                   zip(nodes, grads, strict=True)]
        try:
            if edges:
                torch.autograd.backward(edges, grad_tensors=values, inputs=params,
                                        retain_graph=True)
        finally:
            for h in handles:
                h.remove()
    kept.groups.clear()
    kept.vectors.clear()
    kept.held.clear()


def _graph(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from ``root``, with its children (next functions)."""
    children: dict[Node, list[Node]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node in children:
            continue
        children[node] = [c for c, _ in node.next_functions if c is not None]
        stack.extend(children[node])
    return children


def _reaching(children: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes from which one of ``targets`` can be reached (targets included)."""
    parents: dict[Node, list[Node]] = {}
    for node, kids in children.items():
        for c in kids:
            parents.setdefault(c, []).append(node)
    seen = {t for t in targets if t in children}
    stack = list(seen)
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _groups(children: dict[Node, list[Node]], frontier: Sequence[Node], to_x: set[Node],
            param_nodes: dict[Node, torch.Tensor]
            ) -> list[tuple[list[Node], list[torch.Tensor]]]:
    """Frontier nodes joined when the parameters they reach (through nodes off the
    path to x) overlap, each group with those parameters."""
    reach: dict[Node, set[Node]] = {}
    for n in frontier:
        found: set[Node] = set()
        stack = [c for c in children[n] if c not in to_x]
        seen: set[Node] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in param_nodes:
                found.add(node)
            stack.extend(c for c in children[node] if c not in to_x)
        reach[n] = found
    groups: list[tuple[list[Node], set[Node]]] = []
    for n in frontier:
        joined = [g for g in groups if g[1] & reach[n]]
        nodes, params = [n], set(reach[n])
        for g in joined:
            nodes += g[0]
            params |= g[1]
        groups = [g for g in groups if not any(g is j for j in joined)]
        groups.append((nodes, params))
    order = {p: k for k, p in enumerate(param_nodes)}  # the chunk's order, not hashes
    return [(nodes, [param_nodes[p] for p in sorted(params, key=order.__getitem__)])
            for nodes, params in groups if params]


def _recorder(recorded: dict[Node, tuple], node: Node) -> Callable[[tuple], None]:
    def hook(grad_outputs: tuple) -> None:
        recorded[node] = tuple(grad_outputs)
    return hook

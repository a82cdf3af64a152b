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

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class DeferredWeightGrads:
    """What B kept for W: ``groups`` of (frontier nodes, their recorded gradients, the
    parameters they reach); or, for a chunk without input, the ``output`` and its
    ``grad`` for a whole backward."""

    groups: list[tuple[list[Node], list[tuple], list[torch.Tensor]]] = field(
        default_factory=list)
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None


def backward_input(output: torch.Tensor, grad: torch.Tensor | None,
                   x: torch.Tensor | None, params: Iterable[torch.Tensor]
                   ) -> tuple[torch.Tensor | None, DeferredWeightGrads]:
    """B: ``dL/dx`` for the chunk output ``output`` (receiving ``grad``, None for a
    scalar loss) and its input ``x`` (a leaf [b, T, d] requiring grad, or None), and
    what W needs. ``dL/dx`` is zeros where ``x`` does not reach ``output``."""
    if x is None or output.grad_fn is None:
        return None, DeferredWeightGrads(output=output, grad=grad)
    x_node = get_gradient_edge(x).node
    param_nodes = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    children = _graph(output.grad_fn)
    to_x = _reaching(children, {x_node})
    to_params = _reaching(children, set(param_nodes))
    frontier = [n for n in children if n in to_x and any(
        c in to_params and c not in to_x for c in children[n])]
    recorded: dict[Node, tuple] = {}
    handles = [n.register_prehook(_recorder(recorded, n)) for n in frontier]
    try:
        (dx,) = torch.autograd.grad(output, [x], grad_outputs=grad, retain_graph=True,
                                    allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    groups = _groups(children, frontier, to_x, param_nodes)
    return (dx if dx is not None else torch.zeros_like(x),
            DeferredWeightGrads(groups=[(nodes, [recorded.get(n, ()) for n in nodes], ps)
                                        for nodes, ps in groups]))


def backward_weight(kept: DeferredWeightGrads) -> None:
    """W: accumulate the chunk's weight gradients into ``.grad`` from what
    :func:`backward_input` kept (the graph is freed after)."""
    if kept.output is not None:
        if kept.output.requires_grad:  # else nothing before it trains (a frozen chunk)
            torch.autograd.backward(kept.output, grad_tensors=kept.grad)
        return
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

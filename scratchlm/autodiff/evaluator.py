"""Running graphs (`Evaluator`) and building gradient graphs (`gradients`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .graph import Node, Variable, placeholder, topological_sort


class GraphRunError(ValueError):
    """An op failed while the graph ran; the message names the op, the node and the input shapes."""


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


class Evaluator:
    """Computes the values of `eval_nodes` from the values fed to their Variables.

    The topological order and the point after which each intermediate value can be freed are worked out
    once here, so `run` is one loop over the nodes.
    """

    def __init__(self, eval_nodes: Sequence[Node]):
        eval_nodes = list(eval_nodes)
        for n in eval_nodes:
            if not isinstance(n, Node):
                raise TypeError(f"Evaluator expects Nodes, got {type(n).__name__}")
        self.eval_nodes = eval_nodes
        self.order = topological_sort(eval_nodes)
        keep = set(eval_nodes)
        last_use: dict[Node, int] = {}
        for i, node in enumerate(self.order):
            for inp in node.inputs:
                last_use[inp] = i
        self._free_after: list[list[Node]] = [[] for _ in self.order]
        for node, i in last_use.items():
            if node not in keep:
                self._free_after[i].append(node)
        self.variables = [n for n in self.order if n.op is placeholder]

    def run(self, input_values: Mapping[Node, torch.Tensor]) -> list[torch.Tensor]:
        """Values of the evaluation nodes, in order. `input_values` maps Variables (or any node, to
        override its value) to tensors; a missing Variable is an error that names all missing ones."""
        missing = [v.name for v in self.variables if v not in input_values]
        if missing:
            raise ValueError(f"Evaluator.run: no value fed for Variable(s) {missing}; "
                             f"the graph needs values for {[v.name for v in self.variables]}")
        values: dict[Node, object] = {}
        for i, node in enumerate(self.order):
            if node in input_values:
                values[node] = input_values[node]
            else:
                ins = [values[inp] for inp in node.inputs]
                try:
                    values[node] = node.op.compute(node, ins)
                except (RuntimeError, ValueError, IndexError, TypeError) as e:
                    shapes = ", ".join(_describe(v) for v in ins)
                    raise GraphRunError(
                        f"op {node.op.name!r} (node {node.name!r}) failed on inputs of shape [{shapes}]: {e}"
                    ) from e
            for dead in self._free_after[i]:
                values.pop(dead, None)
        return [values[n] for n in self.eval_nodes]


def _sum_nodes(nodes: list[Node]) -> Node:
    from .ops import add

    total = nodes[0]
    for n in nodes[1:]:
        total = add(total, n)
    return total


def gradients_or_none(
    output_node: Node, nodes: Sequence[Node], output_grad: Node | None = None
) -> list[Node | None]:
    """Reverse-mode gradient graphs of `output_node` w.r.t. `nodes` (None where no path leads).

    `output_grad` seeds the backward pass (default: ones shaped like the output). Only nodes on a path
    from `output_node` down to one of `nodes` get gradient nodes. Entries an op's `gradient` returns as
    `zeros_like(...)` nodes (no gradient flows there) are structural zeros: they are not added up.
    """
    from .ops import ones_like, zeros_like

    order = topological_sort([output_node])
    wanted = set(nodes)
    on_path: set[Node] = set()
    for node in order:  # inputs first: a node is on a path if it is wanted or one of its inputs is
        if node in wanted or any(inp in on_path for inp in node.inputs):
            on_path.add(node)
    seed = output_grad if output_grad is not None else ones_like(output_node)
    partials: dict[Node, list[Node]] = {output_node: [seed]}
    total_grad: dict[Node, Node] = {}
    for node in reversed(order):
        if node not in on_path or node not in partials:
            continue
        grad = _sum_nodes(partials.pop(node))
        total_grad[node] = grad
        if not node.inputs:
            continue
        input_grads = node.op.gradient(node, grad)
        if len(input_grads) != len(node.inputs):
            raise RuntimeError(f"{node.op.name}.gradient returned {len(input_grads)} gradients "
                               f"for {len(node.inputs)} inputs")
        for inp, g in zip(node.inputs, input_grads):
            if g is not None and g.op is not zeros_like and inp in on_path:
                partials.setdefault(inp, []).append(g)
    return [total_grad.get(n) for n in nodes]


def gradients(output_node: Node, nodes: Sequence[Node]) -> list[Node]:
    """Gradient nodes d output / d node for each node (zeros where the output does not depend on it).

    For a non-scalar output this is the vector-Jacobian product with ones, as in CSE234 PA1.
    """
    from .ops import zeros_like

    if not isinstance(output_node, Node):
        raise TypeError(f"gradients: output_node must be a Node, got {type(output_node).__name__}")
    grads = gradients_or_none(output_node, list(nodes))
    return [g if g is not None else zeros_like(n) for g, n in zip(grads, nodes)]


def substitute(roots: Sequence[Node], mapping: Mapping[Node, Node], stop: set[Node]) -> list[Node]:
    """Copies of the graphs of `roots` with the nodes in `mapping` replaced. Nodes in `stop` and nodes that
    do not depend on a replaced node are shared, not copied."""
    order = topological_sort(list(roots), stop=set(stop) | set(mapping))
    new: dict[Node, Node] = dict(mapping)
    for node in order:
        if node in new or node in stop or not node.inputs:
            continue
        inputs = [new.get(inp, inp) for inp in node.inputs]
        if any(a is not b for a, b in zip(inputs, node.inputs)):
            new[node] = Node(inputs, node.op, node.attrs, node.name)
    return [new.get(r, r) for r in roots]


def composite_gradient(node: Node, output_grad: Node, composite) -> list[Node]:
    """The gradient of `node` derived from `composite(*placeholders)`, a definition of the same function
    from primitive ops. Fast backward ops use this for their own (second-order) gradient. Inputs the
    composite does not depend on get `zeros_like(input)`."""
    from .ops import zeros_like

    holders = [Variable(f"{node.name}.in{i}") for i in range(len(node.inputs))]
    expr = composite(*holders)
    grads = gradients_or_none(expr, holders, output_grad=output_grad)
    mapping = dict(zip(holders, node.inputs))
    live = [g for g in grads if g is not None]
    copies = iter(substitute(live, mapping, stop={output_grad}))
    return [zeros_like(inp) if g is None else next(copies) for g, inp in zip(grads, node.inputs)]

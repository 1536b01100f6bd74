"""The computational graph: `Node`, `Variable`, the `Op` base class, and the iterative topological sort.

A node is one application of an op to input nodes. Nodes hold no values: an `Evaluator` walks the graph
in topological order and calls each op's `compute`; `gradients` walks it in reverse and calls each op's
`gradient`, which returns *new nodes*, so gradients are graphs and can be differentiated again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_NAME_LIMIT = 80


def _short(name: str) -> str:
    """Bound node names so that long chains do not build quadratic-size strings."""
    return name if len(name) <= _NAME_LIMIT else name[: _NAME_LIMIT - 3] + "..."


def _is_scalar(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


class Node:
    """One node of the graph: `op` applied to `inputs`, with constant `attrs` (dims, eps, scalars ...).

    Arithmetic operators build new nodes; the other side may be a Node or a Python scalar::

        z = (x + 1) * y / 2 - x ** 2 @ w
    """

    __slots__ = ("inputs", "op", "attrs", "name", "__weakref__")

    def __init__(self, inputs: list[Node], op: Op, attrs: dict[str, Any] | None = None, name: str = ""):
        self.inputs = inputs
        self.op = op
        self.attrs = attrs if attrs is not None else {}
        self.name = _short(name)

    # Identity semantics: nodes are dictionary keys (no __eq__ override, as in CSE234 PA1).
    __hash__ = object.__hash__

    def __getattr__(self, attr_name: str) -> Any:
        """PA1's attribute forwarding: `node.constant` is `node.attrs["constant"]` (only called when normal
        lookup fails). A missing name raises `NodeAttributeError`, an AttributeError (so `hasattr` works) that
        is also a KeyError (what PA1's Node raises)."""
        if attr_name.startswith("__") or attr_name in Node.__slots__:  # copy/pickle probes, half-built nodes
            raise AttributeError(attr_name)
        attrs = object.__getattribute__(self, "attrs")
        if attr_name in attrs:
            return attrs[attr_name]
        raise NodeAttributeError(
            f"node {object.__getattribute__(self, 'name')!r} has no attribute {attr_name!r} "
            f"(its attrs: {sorted(attrs)})", name=attr_name, obj=self)

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__

    def __add__(self, other: Node | float) -> Node:
        from . import ops

        return ops.add(self, other) if isinstance(other, Node) else ops.add_by_const(self, _scalar(other, "+"))

    __radd__ = __add__

    def __sub__(self, other: Node | float) -> Node:
        from . import ops

        return ops.sub(self, other) if isinstance(other, Node) else ops.add_by_const(self, -_scalar(other, "-"))

    def __rsub__(self, other: float) -> Node:
        from . import ops

        return ops.add_by_const(ops.neg(self), _scalar(other, "-"))

    def __mul__(self, other: Node | float) -> Node:
        from . import ops

        return ops.mul(self, other) if isinstance(other, Node) else ops.mul_by_const(self, _scalar(other, "*"))

    __rmul__ = __mul__

    def __truediv__(self, other: Node | float) -> Node:
        from . import ops

        return ops.div(self, other) if isinstance(other, Node) else ops.div_by_const(self, _scalar(other, "/"))

    def __rtruediv__(self, other: float) -> Node:
        from . import ops

        return ops.rdiv_by_const(self, _scalar(other, "/"))

    def __neg__(self) -> Node:
        from . import ops

        return ops.neg(self)

    def __pow__(self, other: Node | float) -> Node:
        from . import ops

        if isinstance(other, Node):  # x ** y = exp(y log x), defined for x > 0
            return ops.exp(ops.mul(other, ops.log(self)))
        return ops.power(self, _scalar(other, "**"))

    def __rpow__(self, other: float) -> Node:
        import math

        from . import ops

        base = _scalar(other, "**")
        if base <= 0:
            raise ValueError(f"c ** node needs a positive base c, got {base}")
        return ops.exp(ops.mul_by_const(self, math.log(base)))

    def __matmul__(self, other: Node) -> Node:
        from . import ops

        if not isinstance(other, Node):
            raise TypeError(f"@ needs a Node on both sides, got {type(other).__name__}; wrap tensors in a Variable")
        return ops.matmul(self, other)


class NodeAttributeError(AttributeError, KeyError):
    """A name that is neither a Node attribute nor a key of its `attrs`."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _scalar(x: Any, symbol: str) -> float:
    if not _is_scalar(x):
        hint = "; feed tensors through a Variable or ad.constant" if isinstance(x, torch.Tensor) else ""
        raise TypeError(f"operator {symbol}: expected a Node or a Python int/float, got {type(x).__name__}{hint}")
    return x


class Op:
    """Base class of all ops. Subclasses implement `__call__` (build a node), `compute` and `gradient`.

    `compute(node, input_values)` returns the node's value from its inputs' values (torch tensors).
    `gradient(node, output_grad)` returns one gradient node per input, as PA1 does: a `zeros_like(input)` node
    where no gradient flows (integer ids, shape-only inputs, piecewise-constant ops). `gradients` recognises
    those as structural zeros and adds nothing for them.
    """

    name = "op"

    def __call__(self, *args: Any, **kwargs: Any) -> Node:
        raise NotImplementedError

    def compute(self, node: Node, input_values: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.compute")

    def gradient(self, node: Node, output_grad: Node) -> list[Node]:
        raise NotImplementedError(f"{type(self).__name__}.gradient")

    def __repr__(self) -> str:
        return self.name


class PlaceholderOp(Op):
    """The op of a `Variable`: its value must be fed to `Evaluator.run`."""

    name = "placeholder"

    def __call__(self, name: str) -> Variable:
        return Variable(name)

    def compute(self, node: Node, input_values: list[torch.Tensor]) -> torch.Tensor:
        raise KeyError(f"Variable {node.name!r} has no value: feed it to Evaluator.run")

    def gradient(self, node: Node, output_grad: Node) -> list[Node]:
        return []


placeholder = PlaceholderOp()


class Variable(Node):
    """A leaf node whose value is fed at run time: `x = ad.Variable("x")` or `ad.Variable(name="x")`.

    A class, as in PA1, so `isinstance(node, Variable)` tells graph inputs apart; its op is `placeholder`.
    """

    __slots__ = ()

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Variable name must be a str, got {type(name).__name__}")
        super().__init__([], placeholder, {}, name)


def topological_sort(nodes: Node | Iterable[Node], stop: frozenset[Node] | set[Node] = frozenset()) -> list[Node]:
    """All nodes that `nodes` depend on, inputs before users (post-order DFS).

    Iterative, with an explicit stack, so a 100,000-node chain does not hit Python's recursion limit.
    Nodes in `stop` are included but their inputs are not visited.
    """
    roots = [nodes] if isinstance(nodes, Node) else list(nodes)
    order: list[Node] = []
    visited: set[Node] = set()
    for root in roots:
        if root in visited:
            continue
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if node in visited:
                continue
            visited.add(node)
            stack.append((node, True))
            if node in stop:
                continue
            for inp in reversed(node.inputs):
                if inp not in visited:
                    stack.append((inp, False))
    return order

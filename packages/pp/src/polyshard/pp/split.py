"""The zero-bubble split of a stage's backward, without doing the input-gradient work twice.

B (input half) runs ``autograd.grad(output, input)``: only the autograd nodes on
paths from the output to the input run, and only for the gradients those paths
need. W (weight half) must then reach every parameter. Run naively as
``backward(output, inputs=params)`` it walks the input path again - in a stage
of n linears, the weight gradient of the first needs the input gradients of the
other n-1 recomputed. Instead, B records the gradient arriving at each node of
the input path from which a parameter branch leaves (a *branch node*: a linear's
backward, whose weight gradient B did not compute), and W starts from those
nodes with those gradients, so it runs only the weight branches.

Example, a stage ``Linear1 -> Tanh -> Linear2`` with a received input x::

    input path:   Addmm2 -> Tanh -> Addmm1 -> (x)       (B runs these)
    branches:     Addmm2 -> W2, b2;  Addmm1 -> W1, b1   (W runs these, from B's recorded gradients)

A branch node that computes all its gradients at once - a compiled block (AOTAutograd's backward is
one node for the whole block), a custom autograd Function that takes a weight - has already computed
its weight gradients while B ran it. B keeps them (a post-hook on the node), and W sends them on from
below the node instead of running it a second time: with compiled blocks W costs the parameters'
accumulation, not a second block backward. A node that skipped its weight outputs in B (an eager
matmul's backward computes only what the graph task needs) is run again by W from the gradients that
arrived at it, as above.

Gradients are accumulated with ``autograd.backward(..., inputs=params)``, so
``.grad`` and post-accumulate-grad hooks (a data-parallel reducer's) behave as
for any backward. torch.distributed.pipelining splits its backward the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightWork:
    """What B leaves for W: the branch nodes with the gradients B saw arrive there (or, when no path
    reaches the stage input, the output and its gradient for a plain backward)."""

    params: list[torch.Tensor]
    branches: dict[Node, list[torch.Tensor]] = field(default_factory=dict)  # branch node -> its parameters
    arrived: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    # branch node -> (edge towards a parameter, the gradient B's run of the node already computed for it)
    computed: dict[Node, list[tuple[GradientEdge, torch.Tensor]]] = field(default_factory=dict)
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None


def backward_input(
    output: torch.Tensor, grad: torch.Tensor | None, input: torch.Tensor, params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, WeightWork]:
    """B: the gradient of ``input`` (None when it does not require one), keeping what W needs."""
    params = [p for p in params if p.requires_grad]
    path = _input_path(output, input) if input.requires_grad else set()
    if not path:  # nothing to split off: W runs the whole backward
        return None, WeightWork(params, output=output, grad=grad)
    branches = _branches(path, params)
    if len({id(p) for group in branches.values() for p in group}) < sum(map(len, branches.values())):
        # a parameter used on two branches (a shared weight): starting W at one branch node could reach
        # it again through the path below, counting twice; run W as a plain backward instead
        (input_grad,) = torch.autograd.grad(output, input, grad, retain_graph=True)
        return input_grad, WeightWork(params, output=output, grad=grad)
    work = WeightWork(params, branches=branches)
    hooks = [node.register_prehook(_recorder(work, node)) for node in work.branches]
    on_path = path | {get_gradient_edge(input).node}
    hooks += [node.register_hook(_keeper(work, node, _weight_edges(node, on_path))) for node in work.branches]
    try:
        (input_grad,) = torch.autograd.grad(output, input, grad, retain_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
    return input_grad, work


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameters' gradients into ``.grad``."""
    if work.output is not None:
        torch.autograd.backward(work.output, work.grad, inputs=work.params)
        return
    for node, params in work.branches.items():
        if node in work.computed:  # B's run of the node computed them: send them on from below it
            below = [edge for edge, _ in work.computed[node]]
            computed = [value for _, value in work.computed[node]]
            torch.autograd.backward(below, computed, inputs=params, retain_graph=True)
            continue
        grads = work.arrived.get(node, ())
        edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        if edges:
            values = [g for g in grads if g is not None]
            # retain_graph: branches may share nodes (a weight used twice); the graph goes with `work`
            torch.autograd.backward(edges, values, inputs=params, retain_graph=True)


def _recorder(work: WeightWork, node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        work.arrived[node] = grad_outputs

    return record


def _keeper(work: WeightWork, node: Node, edges: list[int]) -> Callable[..., None]:
    def keep(grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        grads = [grad_inputs[i] for i in edges]
        if edges and all(g is not None for g in grads):
            children = [node.next_functions[i] for i in edges]  # (child node, its input number); never None
            below = [GradientEdge(cast(Node, child), number) for child, number in children]
            work.computed[node] = [(e, cast(torch.Tensor, g)) for e, g in zip(below, grads, strict=True)]
            work.arrived.pop(node, None)  # not needed: W will not run the node again

    return keep


def _weight_edges(node: Node, on_path: set[Node]) -> list[int]:
    """Indices of ``node``'s edges that leave the input path and the input (towards its weight branches)."""
    return [i for i, (child, _) in enumerate(node.next_functions) if child is not None and child not in on_path]


def _input_path(output: torch.Tensor, input: torch.Tensor) -> set[Node]:
    """Autograd nodes on some path from ``output`` to ``input`` (iteratively: graphs can be deep)."""
    root, target = output.grad_fn, get_gradient_edge(input).node
    if root is None:
        return set()
    order, seen, stack = [], {root}, [root]
    while stack:  # every node reachable from the output, parents before children
        node = stack.pop()
        order.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    reaches = {target}
    changed = True
    while changed:  # a node is on the path when a child is (a fixed point: a DAG converges quickly)
        changed = False
        for node in reversed(order):
            if node not in reaches and any(child in reaches for child, _ in node.next_functions):
                reaches.add(node)
                changed = True
    return reaches - {target}


def _branches(path: set[Node], params: Sequence[torch.Tensor]) -> dict[Node, list[torch.Tensor]]:
    """Each path node from which parameters hang off the path -> those parameters."""
    owner = {get_gradient_edge(p).node: p for p in params}
    branches: dict[Node, list[torch.Tensor]] = {}
    for node in path:
        found: list[torch.Tensor] = []
        stack = [child for child, _ in node.next_functions if child is not None and child not in path]
        seen = set(stack)
        while stack:
            child = stack.pop()
            if child in owner:
                found.append(owner[child])
                continue
            for grandchild, _ in child.next_functions:
                if grandchild is not None and grandchild not in path and grandchild not in seen:
                    seen.add(grandchild)
                    stack.append(grandchild)
        if found:
            branches[node] = found
    return branches

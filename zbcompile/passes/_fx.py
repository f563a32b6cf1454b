"""Small FX helpers shared by the passes: value sizes and copying node sets into new graphs."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import fx

from zbcompile import _torch_internals as ti


def get_attr_value(root: torch.nn.Module, path: str) -> object:
    """What a `get_attr` node with target `path` reads from `root` (a dotted attribute path)."""
    for part in path.split("."):
        root = getattr(root, part)
    return root


def tensor_bytes(value: object) -> int:
    """Bytes of a tensor (or the tensors in a tuple/list); 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return size_hint(value.numel()) * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def symbolic_bytes(value: object) -> Any:
    """`tensor_bytes` as a sympy expression of a value's symbolic sizes (an int where it has none)."""
    if isinstance(value, torch.Tensor):
        numel = value.numel()
        return (numel.node.expr if isinstance(numel, torch.SymInt) else int(numel)) * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum((symbolic_bytes(v) for v in value), 0)
    return 0


def size_hint(size: object) -> int:
    """A size as a number: a symbolic size's value in the example it was traced with, read
    without adding a guard (`shape_symbols.py`); any other size as it is."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def is_differentiable(value: object) -> bool:
    """A floating-point or complex tensor (the dtypes autograd differentiates)."""
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


# keys of node.meta["custom"]: the share of a node's FLOPs and bytes one tensor-parallel rank has,
# where a plan counts them (`tensor_parallel_shares.py`; 1 where absent)
TP_FLOPS, TP_BYTES = "tp_flops", "tp_bytes"


def node_bytes(node: fx.Node) -> int:
    """Bytes of a node's value (its tensor-parallel share of them, where a plan set one)."""
    share = node.meta.get("custom", {}).get(TP_BYTES)
    nbytes = tensor_bytes(node.meta.get("val"))
    return nbytes if share is None else int(nbytes * share)


def is_multi_output(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def copy_nodes(graph: fx.Graph, nodes: Iterable[fx.Node], env: dict[fx.Node, fx.Node]) -> None:
    """Append copies of `nodes` (in the given order) to `graph`, reading inputs through `env`
    and recording each copy in it. Meta (shapes, annotations) travels with the copy."""
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])


def finish(
    graph: fx.Graph, root: torch.nn.Module | dict | None = None, name: str = "GraphModule", read_only: bool = False
) -> fx.GraphModule:
    """Lint `graph` and wrap it in a GraphModule named `name` (the constructor generates its
    code); `read_only`: a graph later passes read and may never run, its code generated on first
    use instead (`ti.graph_module_coded_on_use`)."""
    graph.lint()
    root = root if root is not None else {}
    if read_only:
        return ti.graph_module_coded_on_use(root, graph, name)
    return fx.GraphModule(root, graph, class_name=name)


COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


def is_collective(node: fx.Node) -> bool:
    """A functional collective of torch.distributed (`_c10d_functional.all_reduce`, ...,
    `wait_tensor`): communication with the other ranks of its group."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) in COLLECTIVE_NAMESPACES


def is_view_op(node: fx.Node) -> bool:
    """Ops whose result aliases an input (aten views, getitem)."""
    target = node.target
    if node.op != "call_function":
        return False
    if isinstance(target, ti.OpOverload):
        return any(r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)
    return getattr(target, "__name__", "") == "getitem"


def state_only_nodes(graph: fx.Graph, state: set[fx.Node]) -> set[fx.Node]:
    """Tensor constants (`get_attr`) and call_function nodes that read only `state` placeholders
    (parameters, buffers) or constants through views, or nothing (input-free factories:
    `t(weight)`, `arange`): cheaper to recompute in each graph that reads them than to save.
    Never a random draw (`rand`): recomputed, it would draw other numbers than the forward used."""
    result: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            result.add(node)
            continue
        if node.op != "call_function" or is_random(node):
            continue
        inputs = node.all_input_nodes
        if all(a in state or a in result for a in inputs) and (is_view_op(node) or not inputs):
            result.add(node)
    return result


def written_arguments(node: fx.Node) -> list[tuple[str, object]]:
    """(name, value) of each positional argument `node` writes in place (`add_`'s self,
    `native_batch_norm`'s running statistics), by its op's schema."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    return [
        (argument.name, value)
        for argument, value in zip(schema.arguments, node.args)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]


def is_random(node: fx.Node) -> bool:
    """Whether `node` draws random numbers (an op tagged nondeterministic_seeded)."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def with_state_ancestors(nodes: set[fx.Node], recompute: set[fx.Node]) -> set[fx.Node]:
    """`nodes` plus the recomputable nodes they (transitively) read."""
    result = set(nodes)
    frontier = [a for n in nodes for a in n.all_input_nodes if a in recompute]
    while frontier:
        node = frontier.pop()
        if node not in result:
            result.add(node)
            frontier.extend(a for a in node.all_input_nodes if a in recompute)
    return result


def requires_grad_closure(graph: fx.Graph, seeds: set[fx.Node]) -> set[fx.Node]:
    """`seeds` (values that require grad) and every value computed from them through a
    differentiable op: floating-point or complex results (or tuples) of call_functions other than
    `detach`, in graph order (an over-approximation: a value that turns out to need no gradient
    gets none)."""
    result = set(seeds)
    for node in graph.nodes:
        if node.op != "call_function" or node.target is torch.ops.aten.detach.default or node in result:
            continue
        value = node.meta.get("val")
        if (isinstance(value, (tuple, list)) or is_differentiable(value)) and any(
            a in result for a in node.all_input_nodes
        ):
            result.add(node)
    return result


def ancestors(roots: Iterable[fx.Node], stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Every node the roots depend on (roots included), not walking past `stop` nodes (which
    are included when reached)."""
    result: set[fx.Node] = set()
    frontier = [r for r in roots if r is not None]
    while frontier:
        node = frontier.pop()
        if node in result:
            continue
        result.add(node)
        if node not in stop:
            frontier.extend(node.all_input_nodes)
    return result


def descendants(roots: Iterable[fx.Node]) -> set[fx.Node]:
    """Every node that depends on the roots (roots included)."""
    result: set[fx.Node] = set()
    frontier = list(roots)
    while frontier:
        node = frontier.pop()
        if node not in result:
            result.add(node)
            frontier.extend(node.users)
    return result


def storage_roots(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """For every node, the node whose result owns its memory: views (and getitems of view ops
    like `split`) map to their base; everything else, placeholders included, owns its own."""
    roots: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        root = node
        if node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
            base = node.args[0]
            if getattr(node.target, "__name__", "") == "getitem":
                if is_view_op(base):  # an element of split/unbind shares the input's storage
                    root = roots[base]
            elif is_view_op(node):
                root = roots[base]
        roots[node] = root
    return roots

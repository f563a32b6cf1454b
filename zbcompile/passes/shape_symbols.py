"""Symbolic sizes: one compile for every length.

A trace with symbolic dimensions (`trace_model(..., dynamic=...)`) computes sizes as expressions
of symbols, one per input dimension that may vary (a sequence length, a microbatch size). This
pass gives each symbol one placeholder of the traced graph, `size_<leaf>_<dim>` (role `size`,
named by the input dimension that defines it: `size_input_0_1` is dimension 1 of the first
input tensor), and rewrites every size the graph computes from a tensor's shape as arithmetic on
those placeholders. The sizes then depend on no activation: partition gives every stage the
placeholders it reads, as it gives parameters, and the runtime feeds each microbatch's sizes to
every stage (`ShapeSymbols.sizes`), so no rank waits for another to learn a shape.

`ShapeSymbols` binds a batch's tensors to the symbols, checks that the compile covers them (the
trace's guards hold, every symbol in the range the trace assumed) and evaluates any size the
compile recorded (a boundary value's shape, a cost) at those values. A compile's guards are read
when a batch is checked, so a guard a later pass added (a cost that read a size) counts too.

Example (a decoder's dimension 1 symbolic):

    size_input_0_1 = placeholder          role: size, val s0
    embedding = aten.embedding(emb.weight, input_0)        # input_0: [2, s0]
    arange = aten.arange(size_input_0_1)
    mul = size_input_0_1 * 2                               # was: 2 * sym_size(targets, 1)
    view = aten.view(target_0, [mul])
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import sympy
import torch
from torch import fx

from zbcompile import _torch_internals as ti
from zbcompile.passes._fx import size_hint

ROLE_SIZE = "size"


class NotGeneric(ValueError):
    """The trace cannot serve every size of its symbolic dimensions (a size it computes is not
    arithmetic of the input sizes); the caller compiles per shape instead."""


@dataclass(frozen=True)
class SymbolicDim:
    """Dimension `dim` of input leaf `leaf` (`input_<i>` or `target_<i>`): its size as the
    trace saw it, a sympy expression (a symbol, or a constant where the trace specialised it)."""

    leaf: str
    dim: int
    size: Any


@dataclass(frozen=True)
class ShapeSymbols:
    """The symbolic dimensions of a trace, the placeholder of each symbol (`names`: symbol ->
    placeholder name) and the fake mode whose shape environment holds their guards."""

    dims: tuple[SymbolicDim, ...]
    names: dict[Any, str]
    fake_mode: Any = field(compare=False, repr=False)
    example: dict[Any, int] = field(default_factory=dict)  # each symbol's value in the example traced
    _guards: list = field(default_factory=list, compare=False, repr=False)  # read so far, simplified
    _bound: dict = field(default_factory=dict, compare=False, repr=False)  # `bind`'s answers by sizes

    def guards(self) -> list:
        """Every guard recorded on the symbols so far (later passes may add some), as sympy."""
        env = self.fake_mode.shape_env
        self._guards.extend(env.simplify(g.expr) for g in env.guards[len(self._guards):])
        return self._guards

    def describe(self) -> str:
        """`input_0[1] (s0), target_0[1] (s0)`: each symbolic dimension and its size."""
        return ", ".join(f"{d.leaf}[{d.dim}] ({d.size})" for d in self.dims)

    def symbolic(self) -> tuple[SymbolicDim, ...]:
        """The dimensions that stayed symbols (not specialised by a guard)."""
        return tuple(d for d in self.dims if isinstance(d.size, sympy.Symbol))

    def bind(self, leaves: Mapping[str, torch.Tensor]) -> dict[Any, int] | None:
        """Each symbol's value in a microbatch whose tensors are `leaves` (by leaf name), or None
        where this compile does not cover them: two dimensions of one symbol differ, a
        specialised dimension changed, a value lies outside the trace's range, or a guard fails."""
        sizes = tuple(
            int(leaves[d.leaf].shape[d.dim]) if d.leaf in leaves and leaves[d.leaf].dim() > d.dim else None
            for d in self.dims
        )
        key = (sizes, len(self.fake_mode.shape_env.guards))  # a guard added since: asked again
        if key not in self._bound:
            self._bound[key] = self._bind(sizes)
        return self._bound[key]

    def _bind(self, sizes: tuple[int | None, ...]) -> dict[Any, int] | None:
        values: dict[Any, int] = {}
        for d, size in zip(self.dims, sizes):
            if size is None:
                return None
            if isinstance(d.size, sympy.Symbol):
                if values.setdefault(d.size, size) != size:
                    return None
            elif int(d.size) != size:
                return None
        for symbol, value in values.items():
            bounds = self.fake_mode.shape_env.var_to_range.get(symbol)  # what the trace assumed
            if bounds is not None and not bounds.lower <= value <= bounds.upper:
                return None
        substitution = {s: sympy.Integer(v) for s, v in values.items()}
        for guard in self.guards():
            if guard.xreplace(substitution) is not sympy.true:
                return None
        return values

    def sizes(self, values: Mapping[Any, int]) -> dict[str, int]:
        """The size placeholders' values (by placeholder name) for symbol values `values`."""
        return {name: values[symbol] for symbol, name in self.names.items()}

    def values(self, sizes: Mapping[str, Any]) -> dict[Any, int]:
        """The symbol values that `sizes` (a feed holding the size placeholders' values) gives."""
        return {symbol: int(sizes[name]) for symbol, name in self.names.items()}

    def evaluate(self, size: Any, values: Mapping[Any, int]) -> int:
        """A size the compile recorded (an int, or a SymInt of this trace) at `values`."""
        if not isinstance(size, torch.SymInt):
            return int(size)
        return _evaluate(self.fake_mode.shape_env.replace(size.node.expr), tuple(sorted(values.items(), key=str)))

    def scale(self, formula: Any, values: Mapping[Any, int]) -> float:
        """`formula` (a sympy expression of the symbols, a cost) at `values` over its value at the example."""
        at = functools.partial(_evaluate_float, formula)
        reference = at(tuple(sorted(self.example.items(), key=str)))
        return at(tuple(sorted(values.items(), key=str))) / reference if reference else 1.0

    def shape(self, shape: Any, values: Mapping[Any, int]) -> torch.Size:
        """A shape (or strides) the compile recorded, at `values`."""
        return torch.Size(self.evaluate(s, values) for s in shape)


def size_placeholder_name(leaf: str, dim: int) -> str:
    return f"size_{leaf}_{dim}"


def sizes_of(feed: Mapping[str, Any]) -> dict[str, int]:
    """The size placeholders' values in a microbatch's feed (`runtime/parallel/batch.feed`)."""
    return {name: value for name, value in feed.items() if name.startswith("size_")}


def is_symbolic(shape: Any) -> bool:
    return any(isinstance(s, torch.SymInt) for s in shape)


@functools.lru_cache(maxsize=4096)
def _evaluate_float(expr: Any, values: tuple) -> float:
    result = sympy.sympify(expr).xreplace({s: sympy.Integer(v) for s, v in values})
    if not result.is_number:
        raise KeyError(f"the cost {expr} depends on symbols not bound in {dict(values)}")
    return float(result)


@functools.lru_cache(maxsize=4096)
def _evaluate(expr: Any, values: tuple) -> int:
    result = expr.xreplace({s: sympy.Integer(v) for s, v in values})
    if not result.is_number:
        raise KeyError(f"the size {expr} depends on symbols not bound in {dict(values)}")
    return int(result)


def numel_hint(shape: Any) -> int:
    """The number of elements of `shape` (symbolic sizes at the example they were traced with)."""
    result = 1
    for size in shape:
        result *= size_hint(size)
    return result


def introduce_size_placeholders(graph: fx.Graph, fake_mode: Any) -> ShapeSymbols:
    """Give every symbol of the graph's input and target placeholders (role input or target)
    one placeholder of role ROLE_SIZE, appended after the others, and compute every SymInt the
    graph computes from those placeholders (see the module docstring). Raises NotGeneric where a
    size is not arithmetic of the symbols."""
    env = fake_mode.shape_env
    dims, names, placeholders, example = [], {}, {}, {}
    inputs = [n for n in graph.find_nodes(op="placeholder") if n.meta.get("zb_role") in ("input", "target")]
    last = list(graph.find_nodes(op="placeholder"))[-1]
    for node in inputs:
        for dim, size in enumerate(node.meta["val"].shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = env.replace(size.node.expr)
            dims.append(SymbolicDim(node.meta["zb_name"], dim, expr))
            if isinstance(expr, sympy.Symbol) and expr not in names:
                names[expr], example[expr] = size_placeholder_name(node.meta["zb_name"], dim), int(size.node.hint)
                with graph.inserting_after(last):
                    last = placeholders[expr] = graph.placeholder(names[expr])
                last.meta = {"val": size, "zb_role": ROLE_SIZE, "zb_name": names[expr]}
    emitted: dict[Any, Any] = dict(placeholders)
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.SymInt):
            continue
        expr = env.replace(node.meta["val"].node.expr)
        if expr.is_number:
            node.replace_all_uses_with(int(expr))  # a size the trace specialised: a constant
        elif expr in emitted:
            if emitted[expr] is not node:
                node.replace_all_uses_with(emitted[expr])
        elif node.target is torch.ops.aten.sym_size.int:
            with graph.inserting_before(node):
                emitted[expr] = _emit(graph, expr, emitted, node)
            node.replace_all_uses_with(emitted[expr])
        else:
            emitted[expr] = node  # arithmetic on sizes emitted before it
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and isinstance(node.meta.get("val"), torch.SymInt):
            graph.erase_node(node)
    return ShapeSymbols(tuple(dims), names, fake_mode, example)


_OPS = {sympy.Add: operator.add, sympy.Mul: operator.mul}


def _emit(graph: fx.Graph, expr: Any, emitted: dict[Any, Any], like: fx.Node) -> Any:
    """A node (or int) computing `expr` from the size placeholders in `emitted`."""
    if expr in emitted:
        return emitted[expr]
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, ti.FloorDiv):
        op, parts = operator.floordiv, expr.args
    elif type(expr) in _OPS:
        op, parts = _OPS[type(expr)], expr.args
    else:
        raise NotGeneric(f"the size {expr} (of {like.args[0]}) is not arithmetic of the input sizes")
    value = _emit(graph, parts[0], emitted, like)
    for part in parts[1:]:
        operands = (value, _emit(graph, part, emitted, like))
        value = graph.call_function(op, operands)
        value.meta = {"val": op(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in operands))}
    emitted[expr] = value
    return value


@contextlib.contextmanager
def symbolic_tracing() -> Iterator[None]:
    """Around a trace with symbolic dimensions: ops trace with their symbolic-size
    decompositions (torch's Python dispatcher, as torch.compile traces), and `F.linear` of an
    input of more than two dimensions traces as the ops its C++ kernel runs (view, addmm, view),
    which otherwise guards every size of the input under `torch.func.functionalize`."""
    with ti.python_dispatcher(), _SymbolicLinear():
        yield


class _SymbolicLinear(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if bias is not None and x.dim() > 2 and is_symbolic(x.shape):
                if x.is_contiguous():  # at::linear's _flatten_nd_linear
                    flat = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight.t())
                    return flat.view(*x.shape[:-1], weight.shape[0])
                return torch.matmul(x, weight.t()) + bias
        return func(*args, **kwargs)

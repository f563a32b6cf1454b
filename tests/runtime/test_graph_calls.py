"""The runtime's copy of a stage graph (`_torch_internals.boxed_copy`, what `Program.run` runs):
the same bits as the graph, its inputs freed, no `detach` the graph does not return, and each
operator called at its entry point rather than through `OpOverload.__call__`."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from zbcompile import _torch_internals as ti


def _graph():
    def f(x, w):
        h = torch.nn.functional.silu(x @ w)
        return h.detach().sum(0, dtype=torch.float64), h * 2, h.detach()

    x, w = torch.randn(4, 3), torch.randn(3, 5)
    return make_fx(f)(x, w), (x, w)


def test_the_runtime_copy_computes_the_same_bits_with_fewer_ops_called_directly():
    graph, (x, w) = _graph()
    detach = torch.ops.aten.detach.default
    assert sum(n.target is detach for n in graph.graph.nodes) == 2
    boxed = ti.boxed_copy(graph)
    returned = next(n for n in boxed.graph.nodes if n.op == "output").args[0]
    kept = [n for n in boxed.graph.nodes if n.target is detach]
    assert kept == [returned[2]]  # the detach the graph returns stays; the one it reads on is gone
    inputs = [x, w]
    with torch.no_grad():
        got = boxed(inputs)
        want = graph(x, w)
    assert inputs == []  # the list handed over is emptied: the graph frees each input at its last use
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    names = type(boxed).forward.__globals__["torch"]
    assert names.ops.aten.mm.default is torch.ops.aten.mm.default._op
    assert names.ops.aten.silu.default is torch.ops.aten.silu.default._op
    assert names.float64 is torch.float64 and names.ops.aten.relu is torch.ops.aten.relu  # the rest: torch's

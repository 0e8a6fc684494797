"""A step's forward traced by dynamo as one graph, for the tests that prove it does (the CPU's in
tests/model/test_step_graph.py, fake CUDA's in tests/device/test_step_graph_on_device.py).

fullgraph=True turns any graph break into an error: an opaque call dynamo cannot trace (a
pybind kernel, a Triton launch not behind a custom op), or a host read of a device value
(.item(), .tolist(), bool() of a tensor, numpy), which would also synchronize a GPU step."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch import fx

HOST_READS = frozenset({"item", "tolist", "numpy", "_local_scalar_dense", "__bool__", "__int__", "__float__"})
"""Calls that read a device value on the host: torch 2.13's dynamo keeps ``.item()`` in a
fullgraph trace as a node (an unbacked scalar) instead of breaking there, so they are looked for."""


class StepGraphBroken(AssertionError):
    """The step did not trace as one graph free of host reads."""


def trace_one_graph(fn: Callable[..., Any], *args: Any) -> tuple[Any, fx.GraphModule]:
    """Trace and run ``fn(*args)`` as one graph -> (its output, the graph). Raises
    StepGraphBroken at a graph break or a host read."""
    graphs: list[fx.GraphModule] = []

    def record(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward  # the graph as traced, op by op (the eager kernels inside the custom ops)

    torch._dynamo.reset()  # a fresh trace: nothing cached from another model or another patch
    try:
        out = torch.compile(fn, fullgraph=True, dynamic=False, backend=record)(*args)
    except torch._dynamo.exc.TorchDynamoException as e:
        raise StepGraphBroken(f"the step breaks the graph: {e}") from e
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    reads = [n.format_node() for n in graphs[0].graph.nodes if _name(n.target) in HOST_READS]
    if reads:
        raise StepGraphBroken("the step reads device values on the host: " + "; ".join(reads))
    return out, graphs[0]


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def tandem_ops(gm: fx.GraphModule) -> Counter[str]:
    """How many times the graph calls each of tandem's custom ops (``tandem.<name>``)."""
    return Counter(str(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("tandem."))

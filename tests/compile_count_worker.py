"""Run by tests/test_compile_distributed.py in place of ``-m pipeline.cli`` (under torchrun): `grt train` exactly as a
user runs it, with ``train.compile``'s inductor wrapped: every graph dynamo hands it is still compiled by inductor
(``compile_fx``, what ``backend="inductor"`` calls), and for each graph the linear layers in it and its calls, split
by autograd on (training forwards) and off (validation), are recorded. Code dynamo gave up on (a graph break, the
recompile limit) runs eagerly and is in no graph, so linear layers x calls counts the linear calls that ran
compiled. Writes ``{"rank", "graphs": [{"linears", "runs_grad", "runs_no_grad"}, ...], "frames", "graph_breaks"}``
to ``$GRT_TEST_COMPILE_DIR/rank<r>.json`` when training ends.

Usage: torchrun ... tests/compile_count_worker.py train RECIPE [overrides...]
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch

import pipeline.train.parallelize as parallelize
from pipeline.cli import main

graphs = []  # per compiled graph: its linear layers, its calls with autograd on and off


def counting_inductor(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(gm, example_inputs)
    # nested graphs included: a custom autograd.Function (the gate's fp32 Linear) is traced into a subgraph
    linears = sum(n.op == "call_function" and n.target is torch._C._nn.linear
                  for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)
    graph = {"linears": linears, "runs_grad": 0, "runs_no_grad": 0}
    graphs.append(graph)

    def run(*args):
        graph["runs_grad" if torch.is_grad_enabled() else "runs_no_grad"] += 1
        return compiled(*args)
    return run


# parallelize() looks apply_compile up in its module when it runs: the run compiles through the wrapper
parallelize.apply_compile = functools.partial(parallelize.apply_compile, backend=counting_inductor)

if __name__ == "__main__":
    status = main(sys.argv[1:])
    from torch._dynamo.utils import counters

    rank = int(os.environ.get("RANK", 0))
    (Path(os.environ["GRT_TEST_COMPILE_DIR"]) / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "graphs": graphs, "frames": dict(counters["frames"]),
         "graph_breaks": sum(counters["graph_break"].values())}))
    sys.exit(status)

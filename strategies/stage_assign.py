"""Pipeline stages of a traced training step, from ``ap.pipeline_stage`` annotations.

In: a Graph whose nodes carry JAX name scopes (``Node.scope``) and the number of stages. Out:
``Stages``: the stage of every node, and per stage the graph inputs it reads.

Rules, in order:
1. A node traced inside ``ap.pipeline_stage(i)`` is in stage i; so is its derivative, whose
   scope is ``transpose(jvp(autopar_stage<i>))`` (the innermost marker wins).
2. Any other node is in the latest stage among the producers of its inputs: the loss after the
   last annotated block lands in the last stage, a parameter's update in the stage of its
   gradient (the stage that reads the parameter in the forward pass).
3. A node none of whose inputs comes from a staged node (a schedule on the step count, a
   parameter transposed ahead of use) is in the earliest stage that reads it, else stage 0.
4. An unannotated node of the backward pass that reads no derivative (only forward values:
   the slices of a ``lax.scan``'s stacked residuals its transpose reads) is in the latest
   stage of its readers: it is work on forward values, sent where the derivatives need them.

Checks (``PipelineError``): a marker outside 0..stages-1, a stage with no operator, a forward
operator reading the forward output of a later stage, or a derivative reading the derivative of
an earlier stage (either would make the stages wait on each other in a cycle). Nodes that feed
no annotated node (a shared parameter's gradient sum, the updates) run after the micro-batches
and are not checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.annotate import STAGE_SCOPE
from autopar.errors import PipelineError
from autopar.graph import Value

_MARK = re.compile(re.escape(STAGE_SCOPE) + r"(\d+)")


@dataclass(frozen=True)
class Stages:
    count: int
    of_node: tuple  # stage per graph node, in graph order
    inputs: tuple  # per stage: the graph input positions it reads

    @staticmethod
    def of(graph, count: int, of_node) -> Stages:
        """The Stages of a stage per node, each stage reading the graph inputs its nodes read."""
        reads: list[set[int]] = [set() for _ in range(count)]
        pos = {v.id: i for i, v in enumerate(graph.inputs)}
        for s, n in zip(of_node, graph.nodes):
            reads[s] |= {pos[x.id] for x in n.inputs if isinstance(x, Value) and x.id in pos}
        return Stages(count, tuple(of_node), tuple(tuple(sorted(r)) for r in reads))

    def nodes(self, s: int) -> tuple[int, ...]:
        return tuple(k for k, t in enumerate(self.of_node) if t == s)

    def __str__(self) -> str:
        sizes = ", ".join(f"{s}: {len(self.nodes(s))} ops" for s in range(self.count))
        return f"Stages({sizes})"


def assign_stages(graph, count: int) -> Stages:
    index = {n.id: k for k, n in enumerate(graph.nodes)}
    marked = [_MARK.findall(n.scope) for n in graph.nodes]
    if not any(marked):
        raise PipelineError(
            f"pipeline_stages={count} needs the step's blocks wrapped in "
            "`with ap.pipeline_stage(i):` (stages 0..pipeline_stages-1) inside "
            "the loss function."
        )
    stage: list = [None] * len(graph.nodes)
    for k, (n, marks) in enumerate(zip(graph.nodes, marked)):  # rules 1 and 2
        if marks:
            stage[k] = int(marks[-1])
            if stage[k] >= count:
                raise PipelineError(
                    f"{n.name} at {n.source or 'an unknown line'} is in "
                    f"ap.pipeline_stage({stage[k]}) but pipeline_stages={count}; "
                    f"number the stages 0..{count - 1}."
                )
            continue
        prods = [
            stage[index[p.id]]
            for x in n.inputs
            if isinstance(x, Value)
            for p in [graph.producer.get(x.id)]
            if p is not None
        ]
        prods = [s for s in prods if s is not None]
        stage[k] = max(prods) if prods else None
    for k in reversed(range(len(graph.nodes))):  # rule 3
        if stage[k] is None:
            n = graph.nodes[k]
            users = [stage[index[u.id]] for v in n.outputs for u, _ in graph.users.get(v.id, ())]
            users = [s for s in users if s is not None]
            stage[k] = min(users) if users else 0
    forward_only = [False] * len(graph.nodes)  # rule 4
    for k, n in enumerate(graph.nodes):
        if n.backward and not marked[k]:
            prods = [graph.producer.get(x.id) for x in n.inputs if isinstance(x, Value)]
            forward_only[k] = all(
                p is None or not p.backward or forward_only[index[p.id]] for p in prods
            )
    for k in reversed(range(len(graph.nodes))):
        if forward_only[k]:
            users = [
                stage[index[u.id]]
                for v in graph.nodes[k].outputs
                for u, _ in graph.users.get(v.id, ())
            ]
            stage[k] = max(users, default=stage[k])
    missing = sorted(set(range(count)) - set(stage))
    if missing:
        raise PipelineError(
            f"pipeline stages {missing} have no operator; wrap a block of the "
            f"step in `with ap.pipeline_stage(i):` for each of 0..{count - 1}."
        )
    # nodes after the last annotated derivative they feed (shared parameters' gradient sums,
    # updates) run once per step after every micro-batch, so any stage order is fine there
    feeds_marked = [False] * len(graph.nodes)
    for k in reversed(range(len(graph.nodes))):
        n = graph.nodes[k]
        feeds_marked[k] = bool(marked[k]) or any(
            feeds_marked[index[u.id]] for v in n.outputs for u, _ in graph.users.get(v.id, ())
        )
    for k, n in enumerate(graph.nodes):
        for x in n.inputs:
            p = graph.producer.get(x.id) if isinstance(x, Value) else None
            if (
                p is None
                or p.backward != n.backward
                or not feeds_marked[k]
                or forward_only[index[p.id]]
            ):
                continue
            a, b = stage[index[p.id]], stage[k]
            if (b < a) if not n.backward else (b > a):
                what = "derivative" if n.backward else "forward operator"
                raise PipelineError(
                    f"{n.name} at {n.source or 'an unknown line'} (stage {b}) is a {what} reading "
                    f"{p.name} of stage {a}: stages must follow the forward order. Put the block "
                    f"that computes it in stage {min(a, b)} or later blocks in later stages."
                )
    return Stages.of(graph, count, stage)

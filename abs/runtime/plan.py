"""Physical plan: the dataflow cut into tasks (chains of operators) and the channels
between them. Pure data, computed identically in the driver and in every worker.

A *task* starts at a source, at an operator fed by an exchange (key_by, rebalance,
broadcast), or at an operator with several inputs (union); every operator with a single
forward input is chained into its input's task (a task is a tree: a stream consumed twice
feeds two chained operators). Each worker runs subtask ``i`` of every task.

Channels into a task are numbered per input edge: a forward edge has one channel (from
the same subtask), any other edge has one channel per upstream subtask. An iteration head's
feedback edge (``Edge.back``) comes from a task later in the plan (the end of the loop body).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from ..dataflow import FORWARD, Dataflow, Node

__all__ = ["TaskPlan", "OutputPlan", "PhysicalPlan", "compile_plan"]


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    """An exchange leaving a task: records of node ``from_node`` go to input edge
    ``edge_index`` of task ``target_task`` (whose head is ``target_node``)."""

    from_node: int
    target_task: int
    target_node: int
    edge_index: int
    partition: str
    key: object


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    index: int
    head: int  # node index
    nodes: tuple[int, ...]  # chained nodes in topological order, head first
    children: dict  # node index -> tuple of chained consumer node indices
    outputs: tuple[OutputPlan, ...]
    # input edges of the head: (edge_index, upstream task, partition); channel offsets
    inputs: tuple[tuple[int, int, str], ...]
    back_edges: tuple[int, ...] = ()  # edge indices of an iteration head's feedback edge

    @property
    def is_source(self) -> bool:
        return not self.inputs

    def name(self) -> str:
        return f"task{self.index}"

    def num_channels(self, parallelism: int) -> int:
        return sum(1 if p == FORWARD else parallelism for _e, _t, p in self.inputs)

    def back_channels(self, parallelism: int) -> frozenset[int]:
        """The channels of the feedback edge (an iteration head's): not aligned, not bounded."""
        return frozenset(self.channel_of(e, s, parallelism) for e, _t, p in self.inputs if e in self.back_edges
                         for s in range(1 if p == FORWARD else parallelism))

    def channel_of(self, edge_index: int, upstream_subtask: int, parallelism: int) -> int:
        """Channel number at this task for input edge ``edge_index`` from ``upstream_subtask``."""
        offset = 0
        for e, _t, p in self.inputs:
            if e == edge_index:
                return offset + (0 if p == FORWARD else upstream_subtask)
            offset += 1 if p == FORWARD else parallelism
        raise KeyError(edge_index)


@dataclasses.dataclass(frozen=True)
class PhysicalPlan:
    tasks: tuple[TaskPlan, ...]
    task_of: tuple[int, ...]  # node index -> task index

    def task_keys(self, parallelism: int) -> list[str]:
        """Every task instance, as ``task<t>#<subtask>`` (the coordinator's ack set)."""
        return [task_key(t.index, s) for t in self.tasks for s in range(parallelism)]


def task_key(task: int, subtask: int) -> str:
    return f"task{task}#{subtask}"


def _is_head(node: Node) -> bool:
    return node.kind == "source" or len(node.inputs) != 1 or node.inputs[0].partition != FORWARD


def compile_plan(flow: Dataflow) -> PhysicalPlan:
    nodes: Sequence[Node] = flow.nodes
    task_of: list[int] = [-1] * len(nodes)
    heads: list[int] = []
    for n in nodes:  # nodes are in topological order by construction
        if _is_head(n):
            task_of[n.index] = len(heads)
            heads.append(n.index)
        else:
            task_of[n.index] = task_of[n.inputs[0].source]
    tasks = []
    for t, head in enumerate(heads):
        members = tuple(n.index for n in nodes if task_of[n.index] == t)
        children: dict[int, tuple[int, ...]] = {m: () for m in members}
        outputs: list[OutputPlan] = []
        for n in nodes:
            for e_idx, e in enumerate(n.inputs):
                if task_of[e.source] != t:
                    continue
                if task_of[n.index] == t and not _is_head(n):
                    children[e.source] = children[e.source] + (n.index,)
                else:
                    outputs.append(OutputPlan(e.source, task_of[n.index], n.index, e_idx, e.partition, e.key))
        inputs = tuple((i, task_of[e.source], e.partition) for i, e in enumerate(nodes[head].inputs))
        back = tuple(i for i, e in enumerate(nodes[head].inputs) if e.back)
        tasks.append(TaskPlan(t, head, members, children, tuple(outputs), inputs, back))
    return PhysicalPlan(tuple(tasks), tuple(task_of))

"""Per-subtask rates over time (``JobHandle.metrics()["subtasks"]``), made in the driver from
the counters the workers report anyway (:class:`~abs.runtime.messages.WorkerMetrics`, every
half second): nothing is added per record or per batch on the workers.

:func:`counters` takes a reading of those counters, :func:`rates` turns two readings into one
sample (``time``: its end, ``interval``: the seconds it spans): per subtask (``task<t>#<i>``)
the share of the interval it was busy, idle (waiting for input) and backpressured (blocked on
full output channels) and the fill of its input buffers; per operator and subtask the records
in and out per second; per worker the records its sources are behind their input. The driver
takes a last reading when the workers have finished, so that the series adds up to the job's
counts.

Records out are the rows each operator emitted (counted once per batch it emits). Workers
that do not report them (``WorkerMetrics.records_out`` empty) fall back to the records in of
the operator fed in the same subtask (:func:`records_out_sources`): exact for a source and for
an operator chained to its consumer, ``None`` across an exchange. Sinks have no records out.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from ..dataflow import Dataflow
from .plan import PhysicalPlan

__all__ = ["Counters", "counters", "rates", "records_out_sources"]


def records_out_sources(flow: Dataflow, plan: PhysicalPlan) -> dict[str, str | None]:
    """Operator uid -> the uid whose records in, in the same subtask, are its records out
    (itself for a source, a chained consumer), or None where no such count exists (output
    across an exchange); sinks are left out."""
    consumers: dict[int, list[int]] = {}
    for n in flow.nodes:
        for e in n.inputs:
            consumers.setdefault(e.source, []).append(n.index)
    out: dict[str, str | None] = {}
    for n in flow.nodes:
        if n.kind == "source":
            out[n.uid] = n.uid
            continue
        if not consumers.get(n.index):
            continue  # a sink
        chained = plan.tasks[plan.task_of[n.index]].children.get(n.index, ())
        out[n.uid] = flow.nodes[chained[0]].uid if chained else None
    return out


@dataclasses.dataclass(frozen=True)
class Counters:
    """One reading of the workers' cumulative counters at ``time`` (see :func:`counters`)."""

    time: float
    load: Mapping[str, tuple]  # task key -> (seconds since it started, of them idle, of them backpressured)
    records_in: tuple  # per worker: operator uid -> records
    queue_fill: Mapping[str, float]  # task key -> share of its input buffers in use
    lag: tuple  # per worker: records its sources are behind (None: none can tell)
    records_out: tuple = ()  # per worker: operator uid -> rows emitted (empty: not reported)


def counters(time: float, task_load: Mapping[str, tuple], worker_metrics: Mapping[int, object],
             workers: int) -> Counters | None:
    """A reading of workers ``0 .. workers - 1``' newest reports (``task_load``: the driver's
    task key -> (older, newer) load samples); None while one of them has not reported yet."""
    per_worker = [worker_metrics.get(w) for w in range(workers)]
    if any(w is None for w in per_worker):
        return None
    load = {key: newer for key, (_older, newer) in task_load.items() if newer is not None}
    fill = {k: v for w in per_worker for k, v in w.queue_fill.items()}
    return Counters(time, load, tuple(dict(w.records_in) for w in per_worker), fill,
                    tuple(w.lag for w in per_worker),
                    tuple(dict(getattr(w, "records_out", None) or {}) for w in per_worker))


def rates(older: Counters, newer: Counters, out_from: Mapping[str, str | None]) -> dict | None:
    """The sample between two readings (module docstring), or None when they are not
    comparable (another number of workers, no time between them). A counter that went
    backwards (a restart's new workers count from 0) reads as 0 per second."""
    P = len(newer.records_in)
    dt = newer.time - older.time
    if P != len(older.records_in) or dt <= 0:
        return None
    tasks: dict[str, dict] = {}
    for key, (e1, i1, b1) in sorted(newer.load.items()):
        before = older.load.get(key)
        if before is None or e1 <= before[0]:
            continue
        span = e1 - before[0]
        idle = min(max((i1 - before[1]) / span, 0.0), 1.0)
        bp = min(max((b1 - before[2]) / span, 0.0), 1.0 - idle)
        tasks[key] = {"busy": 1.0 - idle - bp, "idle": idle, "backpressured": bp,
                      "queue_fill": newer.queue_fill.get(key)}
    uids = sorted({uid for per in newer.records_in for uid in per})
    records_in = {uid: [max(0, newer.records_in[w].get(uid, 0) - older.records_in[w].get(uid, 0)) / dt
                        for w in range(P)] for uid in uids}
    if newer.records_out and len(older.records_out) == P and all(newer.records_out):
        records_out = {uid: [max(0, newer.records_out[w].get(uid, 0) - older.records_out[w].get(uid, 0)) / dt
                             for w in range(P)] for uid in out_from}
    else:
        records_out = {uid: list(records_in[src]) if src in records_in else None for uid, src in out_from.items()}
    return {"time": newer.time, "interval": dt, "tasks": tasks, "records_in_per_s": records_in, "records_out_per_s": records_out,
            "source_lag": list(newer.lag)}

"""What the dashboard and the Prometheus endpoint show of a running job: one JSON-ready
dict, taken from the driver's own records (:class:`~abs.runtime.results.CheckpointStats`,
failed checkpoints, restarts, records per operator) without stopping it.

The driver's loop thread appends to those records while the dashboard's thread reads them;
every read copies first (a copy of a list is atomic in CPython) and a dict that changed size
while being copied is read again.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Mapping

__all__ = ["job_snapshot", "task_figures", "KEEP_TASK_DETAILS"]

KEEP_TASK_DETAILS = 200
"""Per-task figures are kept for this many recent checkpoints (older ones keep their totals)."""


def task_figures(checkpoint_id: int, acks: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each task's part of checkpoint ``checkpoint_id`` from its ack: alignment, sync and
    async times, bytes and files written, and of its keyed state the bytes written as bases
    (full) and as deltas, and the bytes all its chains reference."""
    out: dict[str, dict[str, Any]] = {}
    for task, ack in acks.items():
        written_base = written_delta = referenced = 0
        seen: set[str] = set()
        for states in (getattr(ack, "keyed", None) or {}).values():
            for chains in states.values():
                for chain in chains.values():
                    for ref in chain:
                        if ref.id in seen:
                            continue
                        seen.add(ref.id)
                        referenced += ref.bytes
                        if ref.checkpoint_id == checkpoint_id:
                            if ref.kind == "delta":
                                written_delta += ref.bytes
                            else:
                                written_base += ref.bytes
        out[task] = {
            "alignment_s": float(getattr(ack, "alignment_time", 0.0)),
            "sync_s": float(getattr(ack, "sync_time", 0.0)),
            "async_s": float(getattr(ack, "async_time", 0.0)),
            "bytes_written": int(getattr(ack, "bytes_written", 0)),
            "files_written": int(getattr(ack, "files_written", 0)),
            "base_bytes_written": written_base,
            "delta_bytes_written": written_delta,
            "state_bytes": referenced,
        }
    return out


def _copied(read: Callable[[], Any], tries: int = 5) -> Any:
    for _ in range(tries - 1):
        try:
            return read()
        except RuntimeError:  # a dict changed size while it was copied: read it again
            continue
    return read()


def _graph(driver: Any) -> dict[str, Any]:
    flow, plan, p = driver.flow, driver.plan, driver.P
    tasks, edges = [], []
    for t in plan.tasks:
        tasks.append({
            "task": t.name(),
            "parallelism": p,
            "operators": [{"uid": flow.nodes[i].uid, "kind": flow.nodes[i].kind} for i in t.nodes],
        })
        for out in t.outputs:
            edges.append({"from": t.name(), "to": plan.tasks[out.target_task].name(), "partition": out.partition})
    return {"tasks": tasks, "edges": edges}


def task_load(samples: Mapping[str, tuple]) -> dict[str, dict[str, float]]:
    """Per subtask (``task<t>#<i>``) the shares of the time between its two latest load
    samples it was busy, idle (waiting for input) and backpressured (blocked on full output
    channels), each 0..1; subtasks with one sample so far are left out."""
    out: dict[str, dict[str, float]] = {}
    for key, (older, newer) in sorted(samples.items()):
        if older is None or newer is None or newer[0] <= older[0]:
            continue
        span = newer[0] - older[0]
        idle = min(max((newer[1] - older[1]) / span, 0.0), 1.0)
        bp = min(max((newer[2] - older[2]) / span, 0.0), 1.0 - idle)
        out[key] = {"busy": 1.0 - idle - bp, "idle": idle, "backpressured": bp}
    return out


def _records(driver: Any) -> dict[str, int]:
    """Records per operator in this attempt: the workers' newest counts, plus what workers
    that left in a live rescale counted (else the total drops when a worker leaves)."""
    total: dict[str, int] = {}
    for uid, n in _copied(lambda: list(dict(getattr(driver, "_retired_records", {})).items())):
        total[uid] = total.get(uid, 0) + int(n)
    for per_worker in _copied(lambda: list(dict(driver._records).values())):
        for uid, n in _copied(lambda: list(dict(per_worker).items())):
            total[uid] = total.get(uid, 0) + int(n)
    return total


def _checkpoint(stats: Any, tasks: Mapping[str, Any] | None) -> dict[str, Any]:
    row = dataclasses.asdict(stats)
    row["status"] = "COMPLETED"
    row["tasks"] = dict(tasks or {})
    return row


def job_snapshot(driver: Any, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, pending: Iterable[int] | None = None,
                 limit: int | None = None) -> dict[str, Any]:
    """The job of ``driver`` (a :class:`~abs.runtime.driver.JobDriver`) as one JSON-ready dict;
    ``limit``: list only the newest this many completed checkpoints (the counts cover all)."""
    completed = list(driver.completed)
    failed = list(driver.failed)
    counts = {"completed": len(completed), "failed": len(failed)}
    if limit is not None:
        completed = completed[-limit:] if limit > 0 else []
        failed = failed[-limit:] if limit > 0 else []
    details = _copied(lambda: dict(getattr(driver, "checkpoint_tasks", {})))
    status = driver.status
    running = status == "RUNNING"
    coord = getattr(driver, "coord", None)
    if pending is None:
        try:
            pending = coord.pending_ids() if coord is not None and running else ()
        except RuntimeError:
            pending = ()
    started = getattr(driver, "t_start", None)
    result = getattr(driver, "result", None)  # set when the job has ended: its uptime stops there
    return {
        "job": driver.flow.name,
        "status": status,
        "parallelism": driver.P,
        "max_parallelism": driver.flow.max_parallelism,
        "checkpointing": bool(driver.checkpointing),
        "storage": driver.storage_url,
        "uptime_s": 0.0 if started is None else result.duration if result is not None else clock() - started,
        "time": wall(),
        "graph": _graph(driver),
        # shares of the last half second: only of a running job's workers (none while it
        # restarts or once it ended, rather than the last figures of workers that are gone)
        "load": task_load(_copied(lambda: dict(getattr(driver, "task_load", {})))) if running else {},
        "records_in": _records(driver),
        "checkpoints": {
            "completed": [_checkpoint(s, details.get(s.checkpoint_id)) for s in completed],
            "failed": [{"checkpoint_id": cid, "reason": why} for cid, why in failed],
            "counts": counts,
            "in_progress": list(pending),
        },
        "restored_from": driver.restored_from,
        "restarts": [dict(r) for r in list(driver.restarts)],
        "assignment": _assignment(driver),
        "reconfigurations": [_reconfiguration(r) for r in _copied(lambda: list(getattr(driver, "reconfigurations", [])))],
        "autoscale": _autoscale(driver),
    }


def _autoscale(driver: Any) -> dict[str, Any]:
    """The autoscaling settings (None when off) and every decision with its reason and outcome."""
    config = getattr(driver, "autoscale", None)
    report = getattr(driver, "autoscale_report", None)
    return {"config": None if config is None else dataclasses.asdict(config),
            "decisions": _copied(report) if report is not None else []}


def _assignment(driver: Any) -> str | None:
    """The key-group assignment in force, as ranges per worker (``Assignment.describe``)."""
    a = getattr(driver, "assignment", None)
    return None if a is None else a.describe()


def _reconfiguration(rec: Any) -> dict[str, Any]:
    """One live reconfiguration (``abs.reconfig.ReconfigurationRecord``) and its steps."""
    return {
        "id": rec.id, "kind": rec.kind, "strategy": rec.strategy, "status": rec.status, "error": rec.error,
        "before": rec.before, "after": rec.after, "duration": rec.duration, "key_groups": len(rec.key_groups),
        "bytes_moved": rec.bytes_moved,
        "steps": [{"step": s.step, "key_groups": list(s.key_groups), "duration": s.duration,
                   "bytes_moved": s.bytes_moved, "bytes_read": s.bytes_read, "full_bytes": s.full_bytes}
                  for s in list(rec.steps)],
    }

"""A job's metrics in Prometheus' text exposition format, through ``prometheus_client``: a
per-job :class:`~prometheus_client.CollectorRegistry` holding one custom collector that reads
the job's snapshot (:func:`abs.observe.snapshot.job_snapshot`) on every scrape.

Names follow Flink's where there is one (``numberOfCompletedCheckpoints`` ->
``abs_job_checkpoints_completed_total``, ``lastCheckpointDuration`` ->
``abs_job_last_checkpoint_duration_seconds``); every series has the label ``job``. The full
list is :data:`METRICS` (and the README's table)."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["JobCollector", "job_registry", "exposition", "METRICS", "PER_CHECKPOINT_SERIES"]

PER_CHECKPOINT_SERIES = 10
"""Per-checkpoint series are exported for this many newest completed checkpoints."""

# name (as exposed), type, labels beyond ``job``, help
METRICS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("abs_job_up", "gauge", ("status",), "1 while the job runs; status: CREATED, RUNNING, FINISHED, FAILED, CANCELED"),
    ("abs_job_uptime_seconds", "gauge", (), "seconds since the job started"),
    ("abs_job_parallelism", "gauge", (), "subtasks per operator"),
    ("abs_job_restarts_total", "counter", (), "restarts of the job (its attempts after the first)"),
    ("abs_job_checkpoints_completed_total", "counter", (), "completed checkpoints"),
    ("abs_job_checkpoints_failed_total", "counter", (), "failed (aborted) checkpoints"),
    ("abs_job_checkpoints_in_progress", "gauge", (), "checkpoints triggered and not yet completed or aborted"),
    ("abs_job_last_checkpoint_id", "gauge", (), "id of the newest completed checkpoint"),
    ("abs_job_last_checkpoint_duration_seconds", "gauge", (), "trigger to commit of the newest completed checkpoint"),
    ("abs_job_last_checkpoint_size_bytes", "gauge", (), "full size of the newest completed checkpoint"),
    ("abs_job_last_checkpoint_written_bytes", "gauge", (), "bytes the newest completed checkpoint wrote (its increment)"),
    ("abs_job_reconfigurations_total", "counter", ("status",),
     "live reconfigurations (JobHandle.move / rebalance) that ended, by status: COMPLETED, FAILED"),
    ("abs_job_reconfigurations_in_progress", "gauge", (), "live reconfigurations running (0 or 1)"),
    ("abs_job_reconfiguration_steps_total", "counter", (), "steps of live reconfigurations started"),
    ("abs_job_reconfiguration_moved_bytes_total", "counter", (), "bytes handed over by live reconfigurations"),
    ("abs_job_autoscale_decisions_total", "counter", ("kind", "outcome"),
     "autoscaling decisions (abs.Autoscale) carried out, by kind (scale_out, scale_in, rebalance) and outcome "
     "(COMPLETED, FAILED)"),
    ("abs_job_autoscale_decisions_in_progress", "gauge", ("kind",), "autoscaling decisions being carried out, by kind"),
    ("abs_operator_records_in_total", "counter", ("operator",), "records an operator received (all its subtasks)"),
    ("abs_operator_records_in_per_second", "gauge", ("operator",),
     "records per second an operator received, between the last two dashboard refreshes or scrapes (at least 1 s "
     "apart); at the first, its mean since the job started"),
    ("abs_checkpoint_duration_seconds", "gauge", ("checkpoint", "status"), "trigger to commit, per recent checkpoint"),
    ("abs_checkpoint_alignment_seconds", "gauge", ("checkpoint", "status"), "longest barrier alignment of a task"),
    ("abs_checkpoint_sync_seconds", "gauge", ("checkpoint", "status"), "longest synchronous part of a task's snapshot"),
    ("abs_checkpoint_async_seconds", "gauge", ("checkpoint", "status"), "longest asynchronous part (encode, upload)"),
    ("abs_checkpoint_written_bytes", "gauge", ("checkpoint", "status"), "bytes written by the checkpoint"),
    ("abs_checkpoint_size_bytes", "gauge", ("checkpoint", "status"), "full size of the checkpoint"),
    ("abs_checkpoint_files_written", "gauge", ("checkpoint", "status"), "files written by the checkpoint"),
    ("abs_task_busy_ratio", "gauge", ("operator", "task", "subtask"),
     "share of the last half second a subtask was busy (neither waiting for input nor blocked on output)"),
    ("abs_task_idle_ratio", "gauge", ("operator", "task", "subtask"), "share of it waiting for input"),
    ("abs_task_backpressured_ratio", "gauge", ("operator", "task", "subtask"),
     "share of it blocked on full output channels (Flink's backPressuredTimeMsPerSecond / 1000)"),
    ("abs_task_checkpoint_alignment_seconds", "gauge", ("operator", "task", "subtask"),
     "barrier alignment of a subtask in the newest completed checkpoint"),
    ("abs_task_checkpoint_sync_seconds", "gauge", ("operator", "task", "subtask"),
     "synchronous snapshot time of a subtask in the newest completed checkpoint"),
    ("abs_task_checkpoint_async_seconds", "gauge", ("operator", "task", "subtask"),
     "asynchronous snapshot time of a subtask in the newest completed checkpoint"),
    ("abs_task_checkpoint_written_bytes", "gauge", ("operator", "task", "subtask"),
     "bytes a subtask wrote in the newest completed checkpoint"),
)

_CHECKPOINT_FIELDS = {
    "abs_checkpoint_duration_seconds": "duration",
    "abs_checkpoint_alignment_seconds": "alignment_time",
    "abs_checkpoint_sync_seconds": "sync_time",
    "abs_checkpoint_async_seconds": "async_time",
    "abs_checkpoint_written_bytes": "bytes_written",
    "abs_checkpoint_size_bytes": "full_size",
    "abs_checkpoint_files_written": "files_written",
}
_TASK_FIELDS = {
    "abs_task_checkpoint_alignment_seconds": "alignment_s",
    "abs_task_checkpoint_sync_seconds": "sync_s",
    "abs_task_checkpoint_async_seconds": "async_s",
    "abs_task_checkpoint_written_bytes": "bytes_written",
}


class JobCollector(Collector):
    """Reads ``snapshot()`` (a job snapshot dict) on each collection."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        job = str(snap["job"])
        fams: dict[str, Any] = {}
        for name, kind, labels, doc in METRICS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            # a counter family is named without its _total suffix; prometheus_client adds it
            fams[name] = cls(name[:-6] if kind == "counter" else name, doc, labels=("job",) + labels)

        def put(name: str, value: Any, *labels: Any) -> None:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                fams[name].add_metric([job, *(str(v) for v in labels)], float(value))

        cps = snap["checkpoints"]
        completed = cps["completed"]
        put("abs_job_up", 1 if snap["status"] == "RUNNING" else 0, snap["status"])
        put("abs_job_uptime_seconds", snap.get("uptime_s"))
        put("abs_job_parallelism", snap.get("parallelism"))
        put("abs_job_restarts_total", len(snap.get("restarts", ())))
        put("abs_job_checkpoints_completed_total", cps["counts"]["completed"])
        put("abs_job_checkpoints_failed_total", cps["counts"]["failed"])
        put("abs_job_checkpoints_in_progress", len(cps.get("in_progress", ())))
        if completed:
            last = completed[-1]
            put("abs_job_last_checkpoint_id", last["checkpoint_id"])
            put("abs_job_last_checkpoint_duration_seconds", last["duration"])
            put("abs_job_last_checkpoint_size_bytes", last["full_size"])
            put("abs_job_last_checkpoint_written_bytes", last["bytes_written"])
        recs = snap.get("reconfigurations", ())
        # a counter never goes down: it counts the reconfigurations that ended, a gauge the one
        # running (counted as RUNNING, it went 1 -> 0 when it ended: a reset to Prometheus' rate)
        for status in ("COMPLETED", "FAILED"):
            put("abs_job_reconfigurations_total", sum(r["status"] == status for r in recs), status)
        put("abs_job_reconfigurations_in_progress", sum(r["status"] == "RUNNING" for r in recs))
        put("abs_job_reconfiguration_steps_total", sum(len(r["steps"]) for r in recs))
        put("abs_job_reconfiguration_moved_bytes_total", sum(r["bytes_moved"] for r in recs))
        decisions = (snap.get("autoscale") or {}).get("decisions", ())
        autoscaling = bool((snap.get("autoscale") or {}).get("config"))
        for kind in ("scale_out", "scale_in", "rebalance"):
            for outcome in ("COMPLETED", "FAILED", "RUNNING"):
                n = sum(d["kind"] == kind and d["outcome"].split(":")[0] == outcome for d in decisions)
                if n or autoscaling:
                    if outcome == "RUNNING":  # the same as above: a gauge, not a counter's label
                        put("abs_job_autoscale_decisions_in_progress", n, kind)
                    else:
                        put("abs_job_autoscale_decisions_total", n, kind, outcome)
        for uid, n in sorted(snap.get("records_in", {}).items()):
            put("abs_operator_records_in_total", n, uid)
        for uid, rate in sorted(snap.get("throughput", {}).items()):
            put("abs_operator_records_in_per_second", rate, uid)
        for cp in completed[-PER_CHECKPOINT_SERIES:]:
            for name, key in _CHECKPOINT_FIELDS.items():
                put(name, cp.get(key), cp["checkpoint_id"], "completed")
        operators = {t["task"]: t["operators"][0]["uid"] for t in snap["graph"]["tasks"]}
        for key, shares in sorted(snap.get("load", {}).items()):
            task, _, subtask = key.partition("#")
            for part in ("busy", "idle", "backpressured"):
                put(f"abs_task_{part}_ratio", shares[part], operators.get(task, task), task, subtask)
        if completed:
            for key, figures in sorted(completed[-1].get("tasks", {}).items()):
                task, _, subtask = key.partition("#")
                for name, field in _TASK_FIELDS.items():
                    put(name, figures.get(field), operators.get(task, task), task, subtask)
        yield from fams.values()


def job_registry(snapshot: Callable[[], dict]) -> CollectorRegistry:
    """A registry of its own for one job (never the process-wide default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(snapshot))
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry's metrics as Prometheus' text format, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST

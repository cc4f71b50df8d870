"""Automatic scaling in the driver: every ``Autoscale.interval`` seconds a
:class:`~abs.autoscale.LoadSample` of the job's first keyed stage is made from what the
workers already report (each task's busy/idle/backpressured time, each operator's records),
fed to the pure :class:`~abs.autoscale.AutoscalePolicy`, and its decisions are carried out with
the live reconfiguration (:meth:`JobHandle.rescale` / ``rebalance``: no restart). A decision
that fails leaves the job where it was (the reconfiguration's own guarantee) and is reported;
the policy may decide again after the cool-down. A restart during one (a worker lost) fails it
too, and the samples start anew: the restored workers count from zero and replay input.

:class:`Autoscaling` is a part of :class:`~abs.runtime.driver.JobDriver`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
from typing import Any

from ..autoscale import Autoscale, AutoscalePolicy, Decision, LoadSample
from . import messages as m
from . import subtask_metrics
from .plan import task_key

log = logging.getLogger(__name__)

__all__ = ["Autoscaling", "SERIES_LENGTH", "sample_dict"]

SERIES_LENGTH = 600
"""How many samples the driver keeps of each series (``JobHandle.metrics()["load"]`` and
``["subtasks"]``)."""


@dataclasses.dataclass
class _Carried:
    decision: Decision
    reply: "queue.Queue[Any]"
    outcome: str = "RUNNING"


def sample_dict(sample: LoadSample) -> dict:
    """``dataclasses.asdict(sample)``, made without its deep copy: the fields are numbers,
    tuples of numbers (shared: they cannot change) and the rates per key group (copied).
    asdict copied the owner of every key group one by one: ~10 ms a sample at 32,768 key
    groups, every second, autoscaling or not."""
    out = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    out["key_group_rates"] = dict(sample.key_group_rates)
    return out


class Autoscaling:
    """The autoscaling part of :class:`~abs.runtime.driver.JobDriver` (module docstring)."""

    def _autoscale_init(self, config: Autoscale | None) -> None:
        self.autoscale = config
        self.load_series: collections.deque = collections.deque(maxlen=SERIES_LENGTH)
        # the same samples as dicts, made once each: metrics() answered with dataclasses.asdict
        # of the whole series, ~2 ms a call at 600 samples of 128 key groups (a poller every
        # 10 ms took a quarter of a core from the job it watched)
        self.load_dicts: collections.deque = collections.deque(maxlen=SERIES_LENGTH)
        self._state_bytes: tuple[int, dict] = (0, {})  # (checkpoint id, state_bytes() of it)
        self.autoscale_decisions: list[_Carried] = []
        self._policy = AutoscalePolicy(config) if config is not None else None
        keyed = [n for n in self.flow.nodes if n.kind in ("process", "reduce", "aggregate")]
        self._scaled = keyed[0] if keyed else None
        self._source_uids = [n.uid for n in self.flow.nodes if n.kind == "source"]
        self._last_sample: tuple | None = None  # (time, per-worker counters) of the previous sample
        self._last_owners: tuple = ()  # the owners of the previous sample
        self._worker_metrics: dict[int, m.WorkerMetrics] = {}  # the latest of each worker
        # every operator and task, per subtask (abs.runtime.subtask_metrics), autoscaling or not
        self.subtask_series: collections.deque = collections.deque(maxlen=SERIES_LENGTH)
        self._out_from = subtask_metrics.records_out_sources(self.flow, self.plan)
        self._last_counters: subtask_metrics.Counters | None = None
        self._sampled_attempt = 0  # the run attempt the samples belong to (a restart starts anew)

    def _sample(self, now: float) -> LoadSample | None:
        """A sample of the first keyed stage since the previous one (None for the first)."""
        node = self._scaled
        if node is None:
            return None
        task = self.plan.task_of[node.index]
        M = self.flow.max_parallelism
        loads, processed, taken, lags = [], [], 0, []
        per_kg = [0] * M
        for w in range(self.P):
            newest = self.task_load.get(task_key(task, w), (None, None))[1]
            metrics = self._worker_metrics.get(w)
            if newest is None or metrics is None:
                return None  # a worker that has not reported yet (e.g. just joined)
            loads.append(newest)
            per_op = metrics.records_in
            processed.append(per_op.get(node.uid, 0))
            taken += sum(per_op.get(uid, 0) for uid in self._source_uids)
            if metrics.lag is not None:
                lags.append(metrics.lag)
            for kg, n in enumerate(metrics.key_group_records.get(node.uid, ())):
                per_kg[kg] += n
        taken += sum(self._retired_records.get(u, 0) for u in self._source_uids)
        counters = (now, loads, processed, taken, per_kg)
        last, self._last_sample = self._last_sample, counters
        if last is None or len(last[1]) != self.P or now <= last[0]:
            return None
        dt = now - last[0]
        busy = []
        for (e0, i0, b0), (e1, i1, b1) in zip(last[1], loads):
            span = e1 - e0
            busy.append(min(1.0, max(0.0, 1.0 - ((i1 - i0) + (b1 - b0)) / span)) if span > 0 else 0.0)
        # per key group: records since the last sample (a key group that moved counts where it
        # is now; its old owner's count stays behind, so a negative difference reads as 0)
        rates = {kg: max(0, b - a) / dt for kg, (a, b) in enumerate(zip(last[4], per_kg)) if b > a}
        owners = tuple(self.assignment.owners)
        if owners == self._last_owners:
            owners = self._last_owners  # one tuple for the samples of one assignment (600 kept, 32,768 long)
        self._last_owners = owners
        return LoadSample(now, tuple(busy), tuple(max(0, b - a) / dt for a, b in zip(last[2], processed)),
                          max(0, taken - last[3]) / dt, float(sum(lags)), rates, owners)

    def _autoscale_tick(self, run: Any) -> None:
        """Every round of the driver's loop: a sample per interval (kept as the job's load
        series, autoscaling or not), and the policy's decision."""
        config = self.autoscale
        now = self.clock()
        interval = config.interval if config is not None else 1.0
        if self._attempt != self._sampled_attempt:
            # a restart: the new workers count from zero (a difference with the counters before
            # would read as an idle stage) and replay from a checkpoint; the load before it
            # says nothing about the load after it
            self._sampled_attempt = self._attempt
            self._last_sample = self._last_counters = None
            if self._policy is not None:
                self._policy.forget()
        if self._last_counters is None or now - self._last_counters.time >= interval:
            self._sample_subtasks(now)
        if self._last_sample is not None and now - self._last_sample[0] < interval:
            self._settle_decisions()
            return
        sample = self._sample(now)
        self._settle_decisions()
        if sample is None:
            return
        self.load_series.append(sample)
        self.load_dicts.append(sample_dict(sample))
        if config is None or self._reconf is not None or run.life.sources_exhausted:
            return  # one reconfiguration at a time; none once the input has ended
        self._policy.observe(sample)
        decision = self._policy.decide(now)
        if decision is None:
            return
        self._policy.decided(now)
        reply: "queue.Queue[Any]" = queue.Queue()
        carried = _Carried(decision, reply)
        self.autoscale_decisions.append(carried)
        log.info(f"[abs] job {self.flow.name!r}: autoscaling: {decision.kind} to {decision.workers} worker(s): "
                 f"{decision.reason}")
        if decision.kind == "rebalance":
            req = m.ReconfigRequest("rebalance", (dict(decision.moves),), config.strategy, config.batch, reply)
        else:
            req = m.ReconfigRequest("rescale", (decision.workers,), config.strategy, config.batch, reply)
        self._serve_reconfig(run, req)
        self._last_sample = None  # the next sample starts after the reconfiguration began
        self._settle_decisions()

    def _sample_subtasks(self, now: float) -> None:
        reading = subtask_metrics.counters(now, self.task_load, self._worker_metrics, self.P)
        if reading is None:
            return
        last, self._last_counters = self._last_counters, reading
        sample = subtask_metrics.rates(last, reading, self._out_from) if last is not None else None
        if sample is not None:
            self.subtask_series.append(sample)

    def _settle_decisions(self) -> None:
        for carried in self.autoscale_decisions:
            if carried.outcome != "RUNNING":
                continue
            try:
                got = carried.reply.get_nowait()
            except queue.Empty:
                continue
            carried.outcome = "COMPLETED" if not isinstance(got, BaseException) else f"FAILED: {got}"
            if isinstance(got, BaseException):
                log.warning(f"job {self.flow.name!r}: autoscaling: {carried.decision.kind} to "
                            f"{carried.decision.workers} worker(s) failed: {got}")

    def state_bytes(self) -> dict:
        """Keyed operator uid -> key group -> bytes of its chains (all states) in the newest
        complete checkpoint (what a key group weighs when it moves)."""
        cid = self._last_completed_id
        if self._state_bytes[0] != cid:
            self._state_bytes = (cid, self._state_bytes_of(self._manifests.get(cid) if cid else None))
        return {uid: dict(per) for uid, per in self._state_bytes[1].items()}  # the caller's to change

    @staticmethod
    def _state_bytes_of(manifest: Any) -> dict:
        out: dict = {}
        if manifest is None:
            return out
        for uid, states in manifest.keyed.items():
            per = out.setdefault(uid, {})
            for by_kg in states.values():
                for kg, chain in by_kg.items():
                    per[kg] = per.get(kg, 0) + sum(ref.bytes for ref in chain)
        return out

    def autoscale_report(self) -> list[dict]:
        """Every decision with its reason and outcome (``JobResult.autoscale_decisions``)."""
        self._settle_decisions()
        return [{"time": c.decision.time - self.t_start, "kind": c.decision.kind, "workers": c.decision.workers,
                 "reason": c.decision.reason, "outcome": c.outcome} for c in self.autoscale_decisions]

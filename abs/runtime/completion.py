"""Completing a checkpoint in the driver: assembling the manifest from the tasks' acks and
committing it (the commit point), the commit record, the CollectSink epochs that become
visible with it, the sources' completion hooks, its :class:`CheckpointStats`, and retention
(GC) as of it. :class:`CheckpointCompletion` is a part of :class:`~abs.runtime.driver.JobDriver`.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from ..observe.snapshot import KEEP_TASK_DETAILS, task_figures
from . import messages as m
from .cleanup import GcRequest
from .restore_setup import collect_key_id
from .results import CheckpointStats

log = logging.getLogger(__name__)

__all__ = ["CheckpointCompletion"]


class CheckpointCompletion:
    """The completion steps of :class:`~abs.runtime.driver.JobDriver` (see the module docstring)."""

    def _commit(self, a: Any, triggered: float) -> None:
        from storage import CheckpointSession, Lineage

        align = sync = asyn = async_cpu = 0.0
        written = files = 0
        for ack in a.acks.values():
            align = max(align, ack.alignment_time)
            sync = max(sync, ack.sync_time)
            asyn = max(asyn, ack.async_time)
            async_cpu += ack.async_cpu
            written += ack.bytes_written
            files += ack.files_written
        now = time.monotonic()
        manifest = CheckpointSession.manifest(
            a.checkpoint_id,
            a.acks.values(),
            job_name=self.flow.name,
            max_parallelism=self.flow.max_parallelism,
            stats={
                "duration_s": now - triggered,
                "alignment_s": align,
                "sync_s": sync,
                "async_s": asyn,
                "async_cpu_s": async_cpu,
                "parallelism": self.P,
                "mode": self.config.mode,
                **({"loop_records": sum(ack.loop_records or 0 for ack in a.acks.values())}
                   if self.flow.has_loops else {}),
                **({"channel_records": sum(ack.channel_records for ack in a.acks.values()),
                    "channel_bytes": sum(r.bytes for ack in a.acks.values() for r in ack.channel_logs)}
                   if self.config.priority_barriers else {}),
            },
            lineage=Lineage.following(self.run_id, self._follows),
            assignment=self.assignment_at.pop(a.checkpoint_id, None),
        )
        offsets, sinks = manifest.source_offsets, manifest.sink_transactions
        stored = self.store.commit(manifest)
        self._follows = stored
        self._manifests[a.checkpoint_id] = stored
        self._last_completed_id = a.checkpoint_id
        if self._record_commits:  # before any sink hears of it (see abs.runtime.restore)
            try:
                self.store.record_committed(a.checkpoint_id)
            except Exception as exc:  # noqa: BLE001 - the checkpoint is complete either way
                log.warning(f"checkpoint {a.checkpoint_id}: writing the commit record failed ({exc}); "
                            "a restore could miss that its output exists if its manifest is lost")
        committed = time.monotonic()
        # CollectSink epochs staged in this driver become visible with the manifest, not when
        # the workers hear of it: a job canceled (or lost) right after the commit keeps them,
        # and a restore in another process, which cannot re-commit them, starts after them
        for uid in self._collect_sinks:
            for txns in sinks.get(uid, {}).values():
                self._on_collect(m.CollectCommit(tuple(txns or ())))
        self.store_gc()
        for uid, source in self._sources():
            try:
                source.driver_checkpoint_complete(a.checkpoint_id, offsets.get(uid, {}))
            except Exception as exc:  # noqa: BLE001 - the checkpoint is complete either way
                log.warning(f"source {uid!r}: checkpoint {a.checkpoint_id} completion hook failed: {exc}")
        self.checkpoint_tasks[a.checkpoint_id] = task_figures(a.checkpoint_id, a.acks)  # for abs.observe
        for old in sorted(self.checkpoint_tasks)[:-KEEP_TASK_DETAILS]:
            del self.checkpoint_tasks[old]
        full = sum(r.bytes for r in manifest.files().values())
        phases = _phases(a.acks.values(), triggered)
        phases.update(acked=now - triggered, committed=committed - triggered)
        self.completed.append(
            CheckpointStats(
                a.checkpoint_id, triggered - self.t_start, now - triggered, align, sync, asyn, written, full, files,
                async_cpu, phases,
            )
        )

    def store_gc(self) -> None:
        """Retention: keep the last ``retained`` checkpoints, plus every file that an in-flight
        checkpoint may build on (the files of its base checkpoint, see ``Barrier.base``). The
        plan is made as of the checkpoint just committed and carried out in the background."""
        in_flight: list = []
        # the checkpoint just committed is still pending in the coordinator, but its manifest
        # now names every file it needs: its base is not live on its account
        live_bases = {self._bases[m] for m in self.coord.pending_ids() if m in self._bases and m != self._last_completed_id}
        live_bases |= self.reconfig_live_bases()  # what new owners read moved key groups from
        for cid in list(self._manifests):
            if cid in live_bases:
                in_flight.extend(self._manifests[cid].files().values())
            elif cid != self._last_completed_id:
                del self._manifests[cid]  # no pending checkpoint builds on it any more
        request = GcRequest(self.store, self.config.retained, tuple(in_flight), self._last_completed_id)
        if str(self.storage_url).startswith("memory://"):
            self._gc.run_now(request)  # see BackgroundGc.run_now
        else:
            self._gc.submit(request)

    def _on_collect(self, msg: "m.Collect | m.CollectCommit") -> None:
        """CollectSink's two-phase commit (see ``operators._CollectWriter``): staged epochs
        survive restarts; a commit makes an epoch visible once."""
        if isinstance(msg, m.Collect):
            self._staged[msg.key] = (msg.uid, msg.batches)
            return
        for key in msg.keys:
            staged = self._staged.pop(key, None)
            if staged is not None:
                self._collected.setdefault(staged[0], []).extend(staged[1])
                self._collected_ids.setdefault(staged[0], []).extend([collect_key_id(key)] * len(staged[1]))


def _phases(acks: Any, triggered: float) -> dict:
    """Of the tasks' acks (``TaskAck.times``), seconds after the trigger at which the sources
    took their snapshots, the barriers reached the other tasks, the last snapshot began, the
    last uploader took its job and the last ack went out (see ``CheckpointStats.phases``)."""
    out: dict = {}

    def latest(name: str, t: float) -> None:
        out[name] = max(out.get(name, 0.0), t - triggered)

    for ack in acks:
        if len(ack.times) != 3:
            continue  # an ack without times (none of its task's snapshot was timed)
        snapshot_at, upload, uploaded = ack.times
        latest("source" if ack.source_offsets else "barrier", snapshot_at - ack.alignment_time)
        latest("snapshot", snapshot_at)
        latest("upload", upload)
        latest("uploaded", uploaded)
    return out

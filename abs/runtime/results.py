"""What a job reports: :class:`JobResult` (returned by :func:`abs.run` and
:meth:`abs.JobHandle.wait`) and one :class:`CheckpointStats` per completed checkpoint."""
from __future__ import annotations

import dataclasses

import pyarrow as pa

__all__ = ["CheckpointStats", "JobResult"]


@dataclasses.dataclass(frozen=True)
class CheckpointStats:
    """One completed checkpoint as the driver saw it."""

    checkpoint_id: int
    trigger_time: float  # seconds since job start
    duration: float  # trigger to manifest committed
    alignment_time: float  # max over tasks
    sync_time: float  # max over tasks: synchronous part of the snapshot
    async_time: float  # max over tasks: encoding + upload
    bytes_written: int
    full_size: int
    files_written: int
    async_cpu: float = 0.0  # sum over tasks: CPU seconds of the asynchronous part (uploader + writer process)
    # where the duration went, in seconds after the trigger (the slowest task's of each step):
    # "source" the trigger reached the sources, "barrier" the barrier reached the other tasks,
    # "snapshot" the last snapshot began, "upload" the last uploader took its snapshot, "uploaded"
    # the last ack went out, "acked" the driver had every ack, "committed" the manifest was stored.
    # The workers' times are on their host's monotonic clock: meaningful on the driver's host only.
    phases: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class JobResult:
    """What :func:`abs.run` returns (and :meth:`abs.JobHandle.wait`)."""

    job_name: str
    status: str  # FINISHED | FAILED | CANCELED
    parallelism: int
    duration: float
    completed_checkpoints: list[CheckpointStats]
    failed_checkpoints: list[tuple[int, str]]
    restarts: list[dict]
    restored_from: int | None
    # operator uid -> records its subtasks received in the last attempt: after a restart the
    # count starts again at the restored checkpoint (records replayed since are counted again)
    records_in: dict[str, int]
    bytes_restored_per_worker: list[int]
    restore_seconds_per_worker: list[float] = dataclasses.field(default_factory=list)
    timings: dict = dataclasses.field(default_factory=dict)  # startup_s, processing_s, finishing_s
    error: str | None = None
    # restores that fell back (see abs.runtime.restore): (id, reason) of each checkpoint skipped,
    # sink uid -> ids whose committed output was rolled back / is published again
    skipped_checkpoints: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    rolled_back: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    repeated_output: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # automatic scaling (abs.Autoscale): each decision, its reason and outcome, seconds from the start
    autoscale_decisions: list[dict] = dataclasses.field(default_factory=list)
    # the uids of the job's CollectSinks (None: not known, e.g. a JobResult made by hand)
    collect_sinks: tuple[str, ...] | None = dataclasses.field(default=None, repr=False)
    _collected: dict[str, list[bytes]] = dataclasses.field(default_factory=dict, repr=False)

    def collected(self, uid: str) -> pa.Table:
        """Every record a :class:`abs.connectors.sinks.CollectSink` with this uid received."""
        from .channels import decode

        if self.collect_sinks is not None and uid not in self.collect_sinks:
            # a misspelt uid, or a sink of another kind, read as an empty table: as if no record came
            from ..errors import ConfigError

            raise ConfigError(f"JobResult.collected({uid!r}): job {self.job_name!r} has no CollectSink {uid!r}; "
                              f"its CollectSinks: {list(self.collect_sinks)}; pass one of those uids")
        batches = [decode(b) for b in self._collected.get(uid, [])]
        if not batches:
            return pa.table({})
        return pa.Table.from_batches(batches).combine_chunks() if len({b.schema for b in batches}) == 1 else pa.concat_tables(
            [pa.Table.from_batches([b]) for b in batches], promote_options="default"
        )

    @property
    def last_checkpoint(self) -> int | None:
        return self.completed_checkpoints[-1].checkpoint_id if self.completed_checkpoints else None

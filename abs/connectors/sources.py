"""Sources: the split-enumerator / split-reader pattern.

A :class:`Source` is a picklable description shipped to every worker. In the driver its
:meth:`Source.splits` enumerates the splits (stable string ids) once at job start; the
driver assigns splits to the source's subtasks (round robin, or from a restored
checkpoint's offsets, redistributed over the new parallelism). In each worker,
:meth:`Source.create_reader` builds a :class:`SourceReader` for the splits of that
subtask, starting at the given offsets.

The runtime calls :meth:`SourceReader.poll` in the source task's loop and injects
checkpoint barriers *between* two polls: the offsets returned by
:meth:`SourceReader.offsets` at that moment are what the checkpoint stores, so a reader
restarted from them must produce exactly the records that follow the barrier.

Offsets are JSON values (numbers, strings, lists, dicts of those).
"""
from __future__ import annotations

import abc
import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import pyarrow as pa

from ..errors import ConfigError  # a ValueError too

__all__ = [
    "Source",
    "SourceReader",
    "SourceContext",
    "END",
    "GeneratorSource",
]

Offset = Any  # a JSON value


class _End:
    """Sentinel returned by :meth:`SourceReader.poll` when every split is exhausted."""

    _instance: "_End | None" = None

    def __new__(cls) -> "_End":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "END"

    def __reduce__(self) -> str:
        return "END"


END = _End()


class SourceReader(abc.ABC):
    """Reads the splits assigned to one source subtask."""

    @abc.abstractmethod
    def poll(self) -> "pa.RecordBatch | None | _End":
        """Return the next batch, ``None`` when nothing is available right now (the runtime
        waits at most :meth:`wait_hint` seconds, handling barriers meanwhile), or
        :data:`END` when every split is exhausted (bounded sources)."""

    @abc.abstractmethod
    def offsets(self) -> dict[str, Offset]:
        """Current position of every assigned split: the next record to be read."""

    def wait_hint(self) -> float:
        """Seconds until :meth:`poll` may return data again after it returned ``None``."""
        return 0.01

    def notify_checkpoint_complete(self, checkpoint_id: int, offsets: Mapping[str, Offset]) -> None:
        """Checkpoint ``checkpoint_id``, which stored ``offsets``, is durable (hook)."""

    def lag(self) -> float | None:
        """Records this reader is behind its input now, when it can tell (``None``: it cannot).
        Read by the worker's metrics thread while the task polls: an estimate, never a lock.
        Autoscaling sizes the job to work a lag off (``abs.Autoscale.catch_up``)."""
        return None

    def close(self) -> None:
        """Release resources."""


class Source(abc.ABC):
    """A picklable source description (see the module docstring)."""

    @abc.abstractmethod
    def splits(self) -> list[str]:
        """Split ids, stable across runs (called once, in the driver)."""

    def initial_offset(self, split: str) -> Offset:
        """Offset at which a never-read split starts."""
        return 0

    @abc.abstractmethod
    def create_reader(self, splits: Mapping[str, Offset], subtask: int, parallelism: int) -> SourceReader:
        """Reader for ``splits`` (split id -> start offset), in the worker."""

    # -- driver-side hooks (the enumerator side of a source; all optional) -------------------
    # A source that must do work in the driver (run a Spark query, plan micro-batches, commit
    # offsets upstream) overrides these. Whatever they start must stay out of the pickled
    # source (``__getstate__``): the same object is shipped to the workers afterwards.

    def driver_open(self, context: "SourceContext") -> None:
        """Called in the driver before the workers of an attempt start (again after every
        restart), with what was restored (``context.restored_offsets``)."""

    def driver_checkpoint_complete(self, checkpoint_id: int, offsets: Mapping[str, Offset]) -> None:
        """Checkpoint ``checkpoint_id`` is complete (its manifest is committed); ``offsets``
        are the split offsets it stores for this source. Called in the driver, in order."""

    def driver_close(self) -> None:
        """Called in the driver when an attempt ends (finished, failed or canceled)."""

    def driver_hold(self) -> Callable[[], None]:
        """Keep every piece of replay data the driver side holds now (delete nothing) until the
        returned function is called: ``JobHandle.savepoint`` holds it from before its
        checkpoint is taken until the savepoint is written. Called from the caller's thread,
        while the job runs."""
        return _nothing

    def driver_savepoint(self, offsets: Mapping[str, Offset], dest: str,
                         dest_options: Mapping[str, Any] | None) -> None:
        """Copy into the savepoint being written at ``dest`` what a restore of ``offsets`` (this
        source's offsets in the savepoint's checkpoint) needs beyond the snapshot, so that the
        savepoint restores after the job's own replay data is gone (called while
        :meth:`driver_hold` holds, before the savepoint's manifest is written). A restore from
        it tells :meth:`driver_open` where it came from (``SourceContext.restored_from``)."""


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class SourceContext:
    """What :meth:`Source.driver_open` is told about the job."""

    uid: str
    job_name: str
    parallelism: int
    storage_url: str | None
    storage_options: Mapping[str, Any] | None
    restored_offsets: Mapping[str, Offset] | None  # split -> offset of the restored checkpoint
    attempt: int
    retained: int  # complete checkpoints kept (CheckpointConfig.retained): older ones may be restored
    # this source's offsets in every complete checkpoint of the storage root, oldest first
    # (None: no storage); a source whose driver keeps replay data must keep what these need
    stored_offsets: tuple[Mapping[str, Offset], ...] | None = None
    # the same for the savepoints in the storage root (pinned: kept until deleted by hand)
    pinned_offsets: tuple[Mapping[str, Offset], ...] = ()
    # the root the restored checkpoint was read from when it is not the job's storage root (a
    # savepoint elsewhere), and its storage options; None otherwise
    restored_from: str | None = None
    restored_from_options: Mapping[str, Any] | None = None


# --------------------------------------------------------------------------- generator


def _default_event(split: int, index: int) -> tuple[int, int]:
    return index, 1


class GeneratorSource(Source):
    """Deterministic, replayable test-data source.

    Split ``s`` (of ``num_splits``) yields records ``i = s, s + num_splits, s + 2*num_splits, ...``
    below ``count`` (``None``: unbounded), as Arrow batches with columns ``key`` (int64,
    ``i % num_keys``), ``value`` (int64, 1) and ``seq`` (int64, ``i``) unless ``make_batch``
    is given: ``make_batch(indices: numpy int64 array) -> pa.RecordBatch`` builds the batch
    for global record indices, and must be a pure function of them (replayability).

    The offset of a split is the number of its records already emitted. ``rate`` limits
    records per second per split (``None``: as fast as possible).
    """

    def __init__(
        self,
        count: int | None,
        *,
        num_keys: int = 1000,
        num_splits: int = 4,
        batch_size: int = 4096,
        rate: float | None = None,
        make_batch: Callable[[Any], pa.RecordBatch] | None = None,
    ) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        if count is not None and not (is_int(count) and count >= 0):
            raise ConfigError(f"GeneratorSource: count must be an int >= 0 or None, got {count!r}")
        for name, v in (("num_splits", num_splits), ("batch_size", batch_size), ("num_keys", num_keys)):
            if not (is_int(v) and v >= 1):
                raise ConfigError(f"GeneratorSource: num_splits, batch_size and num_keys must be ints >= 1, got "
                                  f"{name}={v!r}")
        # NaN passed 'rate <= 0' and failed in the workers ("cannot convert float NaN to integer")
        if rate is not None and not (isinstance(rate, numbers.Real) and not isinstance(rate, bool)
                                     and math.isfinite(rate) and rate > 0):
            raise ConfigError(f"GeneratorSource: rate must be a finite number > 0 (records per second per split) or "
                              f"None, got {rate!r}")
        if make_batch is not None and not callable(make_batch):
            raise ConfigError(f"GeneratorSource: make_batch must be a function (indices) -> pyarrow.RecordBatch or None, "
                              f"got {type(make_batch).__name__}")
        self.count = count
        self.num_keys = num_keys
        self.num_splits = num_splits
        self.batch_size = batch_size
        self.rate = rate
        self.make_batch = make_batch

    def splits(self) -> list[str]:
        return [str(s) for s in range(self.num_splits)]

    def split_length(self, split: int) -> int | None:
        """Number of records split ``split`` holds (``None`` if unbounded)."""
        if self.count is None:
            return None
        return max(0, (self.count - split + self.num_splits - 1) // self.num_splits)

    def build_batch(self, indices: Any) -> pa.RecordBatch:
        """The batch for global record indices (a numpy int64 array)."""
        if self.make_batch is not None:
            return self.make_batch(indices)
        return pa.RecordBatch.from_arrays(
            [pa.array(indices % self.num_keys), pa.array(indices * 0 + 1), pa.array(indices)],
            names=["key", "value", "seq"],
        )

    def records_before(self, offsets: Mapping[str, Offset]) -> Any:
        """Global indices of every record emitted before ``offsets`` (for tests and checks)."""
        import numpy as np

        parts = [int(s) + self.num_splits * np.arange(int(o), dtype=np.int64) for s, o in offsets.items()]
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def create_reader(self, splits: Mapping[str, Offset], subtask: int, parallelism: int) -> SourceReader:
        return _GeneratorReader(self, {str(k): int(v) for k, v in splits.items()})


class _GeneratorReader(SourceReader):
    def __init__(self, source: GeneratorSource, offsets: dict[str, int]) -> None:
        self._src = source
        self._offsets = dict(offsets)
        self._order = sorted(self._offsets, key=int)
        self._lengths = {s: source.split_length(int(s)) for s in self._order}  # None: unbounded
        self._turn = 0
        self._started = time.monotonic()
        self._emitted_since_start = 0
        self._wait = 0.0

    def offsets(self) -> dict[str, int]:
        return dict(self._offsets)

    def wait_hint(self) -> float:
        return self._wait

    def lag(self) -> float | None:
        """With a ``rate``: the records due by now (the rate since the reader started) that
        were not emitted yet, at most what the splits still hold."""
        src = self._src
        if src.rate is None:
            return None
        due = (time.monotonic() - self._started) * src.rate * len(self._order) - self._emitted_since_start
        left = 0
        for s, o in self._offsets.items():
            length = src.split_length(int(s))
            left = None if length is None or left is None else left + max(0, length - o)
        return max(0.0, due if left is None else min(due, left))

    def poll(self) -> "pa.RecordBatch | None | _End":
        import numpy as np

        src = self._src
        lengths, offsets = self._lengths, self._offsets
        live = [s for s in self._order if lengths[s] is None or offsets[s] < lengths[s]]
        if not live:
            return END
        n = src.batch_size
        if src.rate is not None:
            allowed = int((time.monotonic() - self._started) * src.rate * len(self._order)) - self._emitted_since_start
            if allowed <= 0:
                self._wait = min(0.05, 1.0 / (src.rate * len(self._order)))
                return None
            n = min(n, allowed)
        split = live[self._turn % len(live)]
        self._turn += 1
        start = self._offsets[split]
        length = lengths[split]
        if length is not None:
            n = min(n, length - start)
        idx = int(split) + src.num_splits * np.arange(start, start + n, dtype=np.int64)
        self._offsets[split] = start + n
        self._emitted_since_start += n
        return src.build_batch(idx)


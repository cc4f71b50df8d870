"""The producer's side of a batch log (:mod:`abs.connectors.batchlog`): retention (which staged
batches the job may still need: the restored bound, completed checkpoints, holds for a savepoint
being copied) and the backlog bound (the producer stages a batch only while fewer than
``max_pending_batches`` (and ``max_pending_bytes``) are unread by the readers)."""
from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

from ..errors import ConfigError
from .batchlog import _Log, _read_name
from .sources import SourceContext

# --------------------------------------------------------------------------- retention


class _Retention:
    """Driver-side bookkeeping of completed checkpoints, for the deletion rule."""

    def __init__(self) -> None:
        self.entries: list[int] = []  # consumed-batch bound B of each known completed checkpoint
        self.unknown_older = False
        self.retained = 1
        self.floor: int | None = None  # lowest bound of a savepoint in the storage root
        self.holds = 0  # savepoints being written: nothing is deleted meanwhile
        self.lock = threading.Lock()

    def hold(self) -> Callable[[], None]:
        """Delete nothing until the returned function is called (``Source.driver_hold``)."""
        with self.lock:
            self.holds += 1
        released = []

        def release() -> None:
            with self.lock:
                if not released:
                    released.append(True)
                    self.holds -= 1

        return release

    def opened(self, context: SourceContext, restored_bound: int | None, fresh: bool, lanes: list[str]) -> None:
        self.retained = max(1, int(context.retained))
        pins = [b for b in (_bound(o, lanes) for o in context.pinned_offsets) if b is not None]
        self.floor = min(pins) if pins and not fresh else None
        if fresh:
            self.entries, self.unknown_older = [], False
        elif context.stored_offsets is not None:
            # the driver read every complete checkpoint of the root: retention is exact, also
            # in a new driver process
            bounds = [b for b in (_bound(o, lanes) for o in context.stored_offsets) if b is not None]
            self.entries = bounds[-self.retained:] or ([restored_bound] if restored_bound is not None else [])
            self.unknown_older = False
        elif restored_bound is not None and not self.entries:
            # restored in a new driver: older retained checkpoints are unknown to us
            self.entries, self.unknown_older = [restored_bound], True

    def completed(self, bound: int) -> int | None:
        """Record a completed checkpoint; returns the batch id below which nothing is needed."""
        self.entries.append(bound)
        self.entries = self.entries[-self.retained:]
        with self.lock:
            if self.holds:
                return None  # a savepoint is copying; the next checkpoint after it deletes
        if self.unknown_older and len(self.entries) < self.retained:
            return None
        self.unknown_older = False
        return min(self.entries) if self.floor is None else min(min(self.entries), self.floor)


def _check_bound(what: str, name: str, value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{what}: {name} must be an int >= 1 or None (no bound), got {value!r}")
    return value


class _Backlog:
    """Driver-side view of how far the lanes have read, for the bound on staged-but-unread
    batches (module docstring, "Back-pressure")."""

    def __init__(self) -> None:
        self.lanes: dict[str, int] = {}
        self.token: str | None = None
        self.lock = threading.Lock()
        self.throttled = threading.Event()  # set whenever the producer finds itself held back
        self.waits = 0  # times the producer was held back (for inspection and tests)

    def opened(self, lanes: list[str], restored: Mapping[str, Any] | None, token: str) -> None:
        with self.lock:
            self.token = token
            self.lanes = {}
            for lane in lanes:
                try:
                    self.lanes[lane] = int((restored or {})[lane]["batch"])
                except (KeyError, TypeError, ValueError):
                    self.lanes[lane] = 0

    def checkpointed(self, offsets: Mapping[str, Any]) -> None:
        """A completed checkpoint stored these offsets: its lanes read at least that far."""
        with self.lock:
            for lane, value in offsets.items():
                try:
                    b = int(value["batch"])
                except (KeyError, TypeError, ValueError):
                    continue
                if lane in self.lanes:
                    self.lanes[lane] = max(self.lanes[lane], b)

    def refresh(self, log: _Log) -> None:
        """Read the lanes' progress files (those of this attempt)."""
        for lane in list(self.lanes):
            got = log.read_json(log.path(_read_name(lane)))
            if not isinstance(got, dict) or got.get("gen") != self.token:
                continue
            with self.lock:
                self.lanes[lane] = max(self.lanes[lane], int(got["batch"]))

    def unread_from(self) -> int:
        with self.lock:
            return min(self.lanes.values()) if self.lanes else 0

    def wait_for_room(
        self, log: _Log, next_batch: int, max_batches: int | None, max_bytes: int | None,
        staged_bytes: Callable[[int, int], int] | None, wait: Callable[[float], bool],
    ) -> bool:
        """Block until batch ``next_batch`` may be appended; ``False`` if ``wait(seconds)``
        says to stop (it returns ``True`` then)."""
        if max_batches is None and max_bytes is None:
            return True

        def room() -> bool:
            low = self.unread_from()
            if max_batches is not None and next_batch - low >= max_batches:
                return False
            if max_bytes is not None and staged_bytes is not None and next_batch > low:
                return staged_bytes(low, next_batch) < max_bytes
            return True

        if room():
            return True
        delay = 0.02
        while True:
            self.refresh(log)
            if room():
                return True
            self.waits += 1
            self.throttled.set()
            if wait(delay):
                return False
            delay = min(0.5, delay * 2)


def _bound(offsets: Mapping[str, Any], lanes: list[str]) -> int | None:
    """``min(batch)`` over every lane: batches below it are fully consumed by all lanes."""
    if not lanes or set(offsets) != set(lanes):
        return None
    try:
        return min(int(offsets[lane]["batch"]) for lane in lanes)
    except (TypeError, KeyError, ValueError):
        return None


def _check_restored_lanes(what: str, restored: Mapping[str, Any] | None, lanes: list[str]) -> None:
    if restored and set(restored) != set(lanes):
        raise ConfigError(
            f"{what}: the restored checkpoint has lanes {sorted(restored, key=str)}, this source has "
            f"{lanes} (num_splits={len(lanes)}); restore with the num_splits the checkpoint was taken with"
        )



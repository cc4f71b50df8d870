"""Pins: leases that hold checkpoints against garbage collection while something copies them.

A savepoint copies a checkpoint's files while the job goes on checkpointing and its GC
deletes the files of checkpoints that left retention. A *pin* is a small JSON file under
``pins/`` of the root that every GC honours, in this process or another one (see
``storage/FORMAT.md``, "Pins"):

``{"pin_version": 1, "from": 42, "to": 42, "created_at": ..., "expires_at": ..., "holder": "..."}``

holds every checkpoint with ``from <= id <= to`` (``to`` null: no upper bound) until
``expires_at`` (epoch seconds): its manifest is retained and every file it references is
kept, as are unreferenced files of those ids (a checkpoint still in flight). The holder
renews a long lease (a new pin, then the old one deleted) and deletes the pin when done; an
expired pin is ignored and deleted by the next GC, so a holder killed with ``kill -9`` holds
nothing for longer than its lease.

The decisions are pure (:class:`PinRecord`, :func:`holds`); :class:`PinLease` (built by
:meth:`SnapshotStore.pin`) and :func:`read_pins` do the I/O.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .errors import CorruptManifestError
from .manifest import MAX_INT
from .paths import StoragePaths, new_token

if TYPE_CHECKING:
    from .backend import RootIO

__all__ = ["PinRecord", "PinLease", "DEFAULT_PIN_TTL", "holds", "parse_pin", "read_pins"]

PIN_VERSION = 1
DEFAULT_PIN_TTL = 600.0
"""Seconds a pin lasts unless renewed; a holder renews when a third of it is left. Clocks of
the hosts that pin and collect must agree to well within this."""
_MAX_PIN_BYTES = 64 << 10


@dataclass(frozen=True)
class PinRecord:
    """A pin as stored: it holds checkpoints ``first .. last`` (``last`` ``None``: every id
    from ``first`` on) until ``expires_at``."""

    first: int
    last: int | None
    created_at: float
    expires_at: float
    holder: str = ""
    path: str = ""

    def __post_init__(self) -> None:
        for name in ("first", "last"):
            value = getattr(self, name)
            if value is None and name == "last":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_INT:
                raise ValueError(f"pin {name}={str(value)[:30]!r} is not a checkpoint id")
        if self.last is not None and self.last < self.first:
            raise ValueError(f"pin holds checkpoints {self.first}..{self.last}: an empty range")
        for name in ("created_at", "expires_at"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"pin {name}={str(value)[:30]!r} is not a time")

    def live(self, now: float) -> bool:
        return now < self.expires_at

    def covers(self, checkpoint_id: int) -> bool:
        return self.first <= checkpoint_id and (self.last is None or checkpoint_id <= self.last)

    def describe(self) -> str:
        ids = f"checkpoint {self.first}" if self.last == self.first else \
            f"checkpoints {self.first}..{'' if self.last is None else self.last}"
        return f"{self.path or 'pin'} ({ids}, {self.holder or 'no holder named'})"

    def to_json(self) -> bytes:
        return json.dumps({"pin_version": PIN_VERSION, "from": self.first, "to": self.last,
                           "created_at": self.created_at, "expires_at": self.expires_at,
                           "holder": self.holder}, indent=1).encode()


def parse_pin(raw: bytes, path: str) -> PinRecord:
    """Parse a pin file; :class:`CorruptManifestError` names it when it is not a pin."""
    try:
        if len(raw) > _MAX_PIN_BYTES:
            raise ValueError(f"{len(raw)} bytes, more than a pin has")
        doc: Any = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("pin_version") != PIN_VERSION:
            raise ValueError(f"not a version {PIN_VERSION} pin")
        holder = doc.get("holder", "")
        return PinRecord(doc["from"], doc["to"], doc["created_at"], doc["expires_at"],
                         holder if isinstance(holder, str) else "", path)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CorruptManifestError(f"pin {path}: {str(exc)[:200]}; the pin is ignored; delete it",
                                   reason="unreadable pin") from None


def holds(pins: Iterable[PinRecord], checkpoint_id: int, now: float) -> bool:
    """Whether a live pin among ``pins`` holds ``checkpoint_id``."""
    return any(p.live(now) and p.covers(checkpoint_id) for p in pins)


def read_pins(io: "RootIO", paths: Iterable[str]) -> tuple[list[PinRecord], dict[str, str]]:
    """The pins among ``paths`` of the root (parsed), and the pin files that do not read
    (path -> reason). A pin released while they are read is skipped."""
    pins: list[PinRecord] = []
    bad: dict[str, str] = {}
    for path in sorted(paths):
        parsed = StoragePaths.parse(path)
        if parsed is None or parsed.category != "pin":
            continue
        try:
            pins.append(parse_pin(io.get_document(path, _MAX_PIN_BYTES), path))
        except FileNotFoundError:
            continue  # released meanwhile
        except CorruptManifestError as exc:
            bad[path] = exc.reason
    return pins, bad


class PinLease:
    """A pin held by this process: renew it while copying, release it when done (also as a
    context manager). Build with :meth:`SnapshotStore.pin`."""

    def __init__(self, io: "RootIO", clock: Callable[[], float], first: int, last: int | None, *,
                 ttl: float, holder: str) -> None:
        if not (isinstance(ttl, (int, float)) and ttl > 0):
            raise ValueError(f"pin ttl={ttl!r}: pass a number of seconds > 0")
        self._io = io
        self._clock = clock
        self.ttl = float(ttl)
        self.holder = holder
        self.record: PinRecord | None = None
        self._write(first, last)

    def _write(self, first: int, last: int | None) -> None:
        now = self._clock()
        token = new_token()
        record = PinRecord(first, last, now, now + self.ttl, self.holder, StoragePaths.pin(token))
        self._io.put_new(record.path, record.to_json(), StoragePaths.pin_temp(token))
        old, self.record = self.record, record
        if old is not None:
            self._io.delete(old.path)

    def retarget(self, first: int, last: int | None) -> None:
        """Hold ``first .. last`` instead: the new pin is written before the old one goes."""
        self._write(first, last)

    def renew(self) -> None:
        """Extend the lease when a third of it or less is left (cheap to call often)."""
        record = self.record
        if record is not None and record.expires_at - self._clock() < self.ttl / 3:
            self._write(record.first, record.last)

    def release(self) -> None:
        """Delete the pin (idempotent)."""
        record, self.record = self.record, None
        if record is not None:
            self._io.delete(record.path)

    def __enter__(self) -> "PinLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

"""The replayable batch log: a durable, immutable log of numbered batches that a driver-side
producer appends to and barrier-injecting readers in the workers replay by batch id.

It carries the Spark sources (:mod:`abs.connectors.spark_stream`,
:mod:`abs.connectors.spark_microbatch`) and imports no Spark itself. A reader's offset is
*(batch id, unit inside the batch, row inside the unit)*. A crash anywhere therefore replays
exactly: the restored offsets name batches that are still in the log, and a batch never
changes once it is visible.

Log / staging layout (any fsspec URL the workers can reach; default
``<storage>/sources/<uid>/``)::

    batch-000000000007.json        SparkStreamSource: one immutable file per planned batch
    batch-000000000007/            SparkMicroBatchSource: part-*.parquet, then _manifest.json
    _end.json                      bounded mode: {"batches": n}; readers end after batch n-1
    _error.json                    the producer failed (readers raise; the job restarts)
    _committed.json / _consumed.json   what was committed upstream / deleted
    _read-<lane>.json              readers: the lane's first batch not fully read (back-pressure)
    _staged.json                   SparkMicroBatchSource: rows staged per lane so far (the readers' lag)
    _spark_checkpoint/             SparkMicroBatchSource: Spark's checkpointLocation (default)

Every file is made visible atomically: temp file + link/rename on local disks, a single PUT
(create-if-absent for batch files) on object stores. ``memory://`` is refused: fsspec's
memory file system is private to one process and the workers are other processes.

Lanes and offsets
    Split ids are lanes ``"0" .. str(num_splits - 1)`` (fixed for a job's life: changing
    ``num_splits`` needs a fresh start). Unit ``j`` (an InputPartition, or a Parquet part) of
    batch ``b`` belongs to lane ``(b + j) % num_splits``, so one-unit batches still spread
    over all lanes. A lane's offset is ``{"batch": b, "partition": j, "row": r}``
    (``"part"`` instead of ``"partition"`` for the micro-batch source): the next row to read
    is row ``r`` of unit ``j`` of batch ``b``; every batch below ``b`` is fully consumed by
    that lane. A reader restored at ``r > 0`` re-reads the unit and skips ``r`` rows.
    Bounded logs end with ``_end.json``; a lane at ``batch == n`` has returned END.

Commit rule
    ``B`` of a completed checkpoint is ``min(lane["batch"])`` over the lanes it stores: the
    batches below it are consumed by every lane and covered by that checkpoint. What reaches
    a Spark data source's ``commit(end)`` and when: see :mod:`abs.connectors.spark_stream`
    (``SparkStreamSource``), which owns that rule.

Deletion rule
    Log batches below ``min(B)`` over the last ``retained`` completed checkpoints
    (``SourceContext.retained``, the checkpoints storage retention keeps and a restart may
    restore) are deleted; the newest logged batch of a SparkStreamSource is always kept (the
    planner continues after it). The driver passes the offsets of every complete checkpoint
    and savepoint of the storage root (``SourceContext.stored_offsets`` / ``pinned_offsets``),
    so this also holds after a restore in a new driver process, and batches a savepoint in the
    root needs are kept. Nothing is deleted while ``JobHandle.savepoint`` writes a savepoint.

Savepoints
    ``JobHandle.savepoint(path)`` copies what its checkpoint needs of the log into
    ``<path>/sources/<uid>/``: the batches from its ``min(lane["batch"])`` on, the markers
    (``_end``, ``_committed``, ``_consumed``), for SparkMicroBatchSource Spark's checkpoint
    (copied while no micro-batch is being staged, so that every batch Spark committed is in
    the copy), and last ``_savepoint.json`` (the offsets it was made for). A job restored
    from that savepoint (``restore=path``) replaces its log with the copy (and Spark's
    checkpoint location with the copied checkpoint) before its readers start, so the
    savepoint restores exactly however long ago the job's own log dropped those batches,
    into any storage root. A savepoint without a copy (taken offline, or by an earlier
    release) restores only while the log still holds its batches.

Restarts
    ``driver_open`` runs before every attempt. A fresh start (first attempt, nothing restored)
    empties the log/staging (and Spark's default checkpoint location): the stream starts over
    from ``initialOffset()`` / the query's start. After a restart the log is kept: logged
    batches are replayed, not re-planned, and the planner continues after the last logged
    batch; the micro-batch query resumes from Spark's checkpoint (a batch id replayed by Spark
    after its staged copy was consumed and deleted is not staged again).

Bounded mode
    A bounded producer writes ``_end.json`` (``{"batches": n}``) durably when it is done;
    readers return END after batch ``n - 1``. How each source decides it is done:
    :mod:`abs.connectors.spark_stream`, :mod:`abs.connectors.spark_microbatch`.

Back-pressure (the bound on staged-but-unread batches)
    A batch is *unread* until every lane has read past it. The producer (the planner of a
    SparkStreamSource, the ``foreachBatch`` function of a SparkMicroBatchSource) appends batch
    ``b`` only while fewer than ``max_pending_batches`` batches are unread (``b - u <
    max_pending_batches``, ``u`` the lowest batch a lane still has to read) and, for the
    micro-batch source, while the staged bytes of the unread batches are below
    ``max_pending_bytes`` (one batch is always allowed, however large); otherwise it waits,
    looking again with a backoff up to 0.5 s. A waiting ``foreachBatch`` holds Spark's query
    back (Spark plans the next micro-batch only after it returns), so the backlog stays
    upstream, in the stream's own storage. ``None`` turns a bound off.
    The producer learns how far the lanes are from ``_read-<lane>.json``, which a reader
    rewrites when a lane moves to a new batch (at most every 0.2 s while it reads, at once
    when it runs out of staged batches), tagged with the attempt (a reader of an attempt that
    ended cannot move the bound), and from the offsets of completed checkpoints; it may see
    a lane a little later than it moved, never earlier, so the bound holds. Storage also
    holds the read batches that completed checkpoints still need (the deletion rule).

Costs and limits
    A lane waiting for the next batch looks for it (and for the end/error markers) with a
    backoff up to 0.2 s: a few small reads per second per waiting reader, also on S3; a
    reading lane writes one small file per new batch, at most five a second per reader.
"""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
from typing import Any, Callable, Iterator, Mapping

import pyarrow as pa

from ..errors import AbsError, ConfigError
from .fs import Files, absolute, open_fs
from .sources import END, SourceContext, SourceReader

__all__ = ["SparkSourceError"]

_BATCH_FILE = re.compile(r"^batch-(\d{12})\.json$")
_BATCH_DIR = re.compile(r"^batch-(\d{12})$")
_READ_FILE = re.compile(r"^_read-(\d+)\.json$")
_MARKERS = ("_end.json", "_error.json", "_committed.json", "_consumed.json", "_staged.json")


class SparkSourceError(AbsError, RuntimeError):
    """A Spark source cannot go on: its driver-side producer failed (the data source's
    planner raised, the Spark query failed), a batch the restored offsets need is missing
    from the log, or ``read()`` returned data that does not fit the schema.

    Remedy: the message names the log and the cause. Producer failures make the job restart
    (with a restart strategy); fix the data source or query if they repeat.
    """


# --------------------------------------------------------------------------- log files


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class _Log:
    """A directory of log files on any fsspec file system (picklable: the file system is
    opened lazily in each process). Its writes follow the store contract of
    :mod:`abs.connectors.fs`."""

    def __init__(self, url: str, options: Mapping[str, Any] | None) -> None:
        self.url = url
        self.options = dict(options or {})
        self._files: Files | None = None
        self._root: str | None = None

    def __getstate__(self) -> dict:
        return {"url": self.url, "options": self.options, "_files": None, "_root": None}

    def _open(self) -> tuple[Files, str]:
        if self._files is None or self._root is None:
            fs, self._root = open_fs(self.url, self.options, what="batch log")
            self._files = Files(fs)
        return self._files, self._root

    @property
    def fs(self) -> Any:
        return self._open()[0].fs

    @property
    def root(self) -> str:
        return self._open()[1]

    @property
    def local(self) -> bool:
        return self._open()[0].local

    def path(self, *names: str) -> str:
        return "/".join([self.root, *names])

    def read(self, path: str) -> bytes | None:
        """The file's bytes, ``None`` if it does not exist (no listing cache involved)."""
        return self._open()[0].read(path)

    def read_json(self, path: str) -> Any:
        return self._open()[0].read_json(path)

    def put(self, path: str, data: bytes) -> None:
        """Write ``path`` atomically (readers see the old file or the new one, whole)."""
        self._open()[0].put(path, data)

    def create(self, path: str, data: bytes) -> bool:
        """Write ``path`` atomically if it does not exist; ``False`` if it already did."""
        return self._open()[0].create(path, data)

    def delete(self, path: str, recursive: bool = False) -> None:
        self._open()[0].delete(path, recursive=recursive)

    def names(self) -> list[str]:
        """Names directly below the root (``[]`` if it does not exist)."""
        files, root = self._open()
        return files.list_names(root)

    def wipe(self, extra: tuple[str, ...] = ()) -> None:
        """Delete what this module wrote below the root (batch files and directories, markers,
        temp files) and the names in ``extra``; anything else is left alone."""
        for name in self.names():
            if (_BATCH_FILE.match(name) or _BATCH_DIR.match(name) or _READ_FILE.match(name) or name in _MARKERS
                    or name.startswith(".tmp-") or name in extra):
                self.delete(self.path(name), recursive=True)


def _resolve_log_url(
    what: str, given: str | None, options: Mapping[str, Any] | None, context: SourceContext, param: str
) -> _Log:
    if given is not None:
        url, opts = given, options
    elif context.storage_url is not None:
        url = f"{context.storage_url.rstrip('/')}/sources/{urllib.parse.quote(context.uid, safe='')}"
        opts = options if options is not None else context.storage_options
        if url.startswith("memory:"):
            raise ConfigError(
                f"{what}: its {param} defaults to {url!r}, below the job's storage on fsspec's memory file system, "
                f"which is private to the driver process; the worker processes cannot read it. Pass {param}= a "
                "local directory, file:// or s3:// URL (or use such a storage=)"
            )
    else:
        raise ConfigError(
            f"{what} {context.uid!r}: no place for its log: run the job with storage=... or pass {param}=<URL> "
            "(a directory every worker can reach)"
        )
    _check_reachable(what, url, param)
    return _Log(absolute(url), opts)



def _check_reachable(what: str, url: str, param: str) -> None:
    if url.startswith("memory:"):
        raise ConfigError(
            f"{what}: {param}={url!r} is on fsspec's memory file system, which is private to one process; "
            f"the worker processes cannot read it. Pass {param}= a local directory, file:// or s3:// URL"
        )


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


def _read_name(lane: str) -> str:
    return f"_read-{int(lane)}.json"


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


def _lane_offset(value: Any, lane: str, num_splits: int, key: str, what: str) -> tuple[int, int, int]:
    try:
        b, j, r = int(value["batch"]), int(value[key]), int(value["row"])
    except (TypeError, KeyError, ValueError):
        raise SparkSourceError(
            f"{what}: lane {lane!r} has offset {value!r}; expected {{'batch': b, {key!r}: j, 'row': r}} "
            "(was the checkpoint written by another source?)"
        ) from None
    if b < 0 or j < 0 or r < 0 or (b + j) % num_splits != int(lane) % num_splits:
        raise SparkSourceError(
            f"{what}: lane {lane!r} has offset {value!r}, which does not belong to lane {lane} of "
            f"{num_splits}; was num_splits changed? Restore with the num_splits the checkpoint was taken with"
        )
    return b, j, r


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


# --------------------------------------------------------------------------- savepoint copies

_COPY_MARKER = "_savepoint.json"
_COPIED_MARKERS = ("_end.json", "_committed.json", "_consumed.json")


def _savepoint_log(dest: str, options: Mapping[str, Any] | None, uid: str) -> _Log:
    """Where a savepoint at ``dest`` keeps its copy of source ``uid``'s log."""
    return _Log(absolute(f"{dest.rstrip('/')}/sources/{urllib.parse.quote(uid, safe='')}"), options)


def _files_below(log: _Log, name: str) -> list[str]:
    """Paths relative to directory ``name`` of the log (``""``: its root) of the files below
    it, sorted; ``[]`` if it does not exist."""
    base = log.path(name) if name else log.root
    files, _root = log._open()
    files.refresh(base)
    try:
        found = log.fs.find(base)
    except FileNotFoundError:
        return []
    strip = base.split("://", 1)[-1].rstrip("/")
    out = []
    for path in found:
        rel = str(path).split("://", 1)[-1][len(strip):].lstrip("/")
        if rel:
            out.append(rel)
    return sorted(out)


def _copy_files(src: _Log, dst: _Log, paths: list[str], what: str) -> None:
    """Copy the files ``paths`` (relative to the roots) from ``src`` to ``dst``, in this order."""
    for rel in paths:
        data = src.read(src.path(rel))
        if data is None:
            raise SparkSourceError(
                f"{what}: {src.path(rel)} disappeared while the savepoint copied the log; take the savepoint again"
            )
        dst.put(dst.path(rel), data)


def _copy_tree(src: _Log, name: str, dst: _Log, dst_name: str, what: str, *, temporary: bool = False) -> None:
    """Copy directory ``name`` of ``src`` (``""``: its root) to ``dst_name`` of ``dst``, a
    ``_manifest.json`` last (a partial copy never reads as a staged batch). ``temporary``:
    files may come and go meanwhile (Spark's temporary files): skip those."""
    files = _files_below(src, name)
    files.sort(key=lambda p: p.endswith("_manifest.json"))
    for rel in files:
        if temporary and rel.endswith(".tmp"):
            continue
        path = src.path(name, rel) if name else src.path(rel)
        data = src.read(path)
        if data is None and temporary:
            continue
        if data is None:
            raise SparkSourceError(
                f"{what}: {path} disappeared while the savepoint copied the log; take the savepoint again"
            )
        dst.put(dst.path(dst_name, rel) if dst_name else dst.path(rel), data)


def _write_copy_marker(dst: _Log, offsets: Mapping[str, Any], batches: list[int]) -> None:
    body = {"v": 1, "offsets": dict(offsets), "batches": batches, "copied_at": time.time()}
    dst.put(dst.path(_COPY_MARKER), json.dumps(body).encode())


def _savepoint_copy(what: str, context: SourceContext, restored: Mapping[str, Any]) -> _Log | None:
    """The log copy of the savepoint this attempt restores, if it has one made for exactly
    these offsets (``None``: restore from the job's own log)."""
    if not restored or context.restored_from is None:
        return None
    options = context.restored_from_options if context.restored_from_options is not None else context.storage_options
    copy = _savepoint_log(context.restored_from, options, context.uid)
    marker = copy.read_json(copy.path(_COPY_MARKER))
    if marker is None:
        return None
    if _canonical(marker.get("offsets")) != _canonical(dict(restored)):
        raise SparkSourceError(
            f"{what}: the log copy in {copy.url} was made for other offsets than the checkpoint restored from "
            f"{context.restored_from} ({marker.get('offsets')} != {dict(restored)}); was the savepoint's "
            "directory mixed with another one? Restore a savepoint as JobHandle.savepoint wrote it"
        )
    return copy


# --------------------------------------------------------------------------- lane reader


class _LaneReader(SourceReader):
    """Reads the lanes assigned to one source subtask from a batch log."""

    unit_key = "partition"

    def __init__(self, log: _Log, splits: Mapping[str, Any], num_splits: int, what: str,
                 progress_token: str | None = None) -> None:
        self._log = log
        self._token = progress_token  # the attempt's tag of the _read-<lane>.json files (None: none written)
        self._dirty: set[str] = set()
        self._progress_at = 0.0
        self._n = num_splits
        self._what = what
        self._cursors: dict[str, list[int]] = {}
        for lane, value in splits.items():
            self._cursors[str(lane)] = list(_lane_offset(value, str(lane), num_splits, self.unit_key, what))
        self._order = sorted(self._cursors, key=int)
        self._iters: dict[str, Iterator[pa.RecordBatch] | None] = {lane: None for lane in self._order}
        self._ended: set[str] = set()
        self._cache: dict[int, Any] = {}
        self._end: int | None = None
        self._gap_checked: set[int] = set()
        self._missing: set[int] = set()
        self._turn = 0
        self._wait = 0.01

    # -- to implement
    def _fetch(self, batch: int) -> Any:
        """The batch's units (a list), or ``None`` if the batch is not (yet) in the log."""
        raise NotImplementedError

    def _open_unit(self, batch: int, units: Any, unit: int, skip: int) -> Iterator[pa.RecordBatch]:
        raise NotImplementedError

    def _exists(self, batch: int) -> bool:
        raise NotImplementedError

    # -- SourceReader
    def offsets(self) -> dict[str, dict]:
        return {lane: {"batch": b, self.unit_key: j, "row": r} for lane, (b, j, r) in self._cursors.items()}

    def wait_hint(self) -> float:
        return self._wait

    def poll(self) -> "pa.RecordBatch | None | Any":
        if len(self._ended) == len(self._order):
            return END
        self._missing: set[int] = set()  # batches not in the log at this poll (looked up once per poll)
        n = len(self._order)
        for k in range(n):
            lane = self._order[(self._turn + k) % n]
            if lane in self._ended:
                continue
            got = self._poll_lane(lane)
            if got is END:
                self._ended.add(lane)
                continue
            if got is not None:
                self._turn = (self._turn + k + 1) % n
                self._wait = 0.01
                self._report(idle=False)
                return got
        self._report(idle=True)
        if len(self._ended) == len(self._order):
            return END
        self._wait = min(0.2, self._wait * 2)
        return None

    def _report(self, idle: bool) -> None:
        """Tell the producer how far the lanes have read (see "Back-pressure"): lanes that
        moved to a new batch, at most every 0.2 s while reading, at once when idle."""
        if not self._dirty or self._token is None:
            return
        now = time.monotonic()
        if not idle and now - self._progress_at < 0.2:
            return
        self._progress_at = now
        for lane in sorted(self._dirty, key=int):
            body = {"batch": self._cursors[lane][0], "gen": self._token}
            self._log.put(self._log.path(_read_name(lane)), json.dumps(body).encode())
        self._dirty.clear()

    def close(self) -> None:
        self._iters = {lane: None for lane in self._order}
        self._cache.clear()

    # -- internals
    def _batch(self, b: int) -> Any:
        if b in self._cache:
            return self._cache[b]
        if self._end is not None and b >= self._end:
            return END
        if b in self._missing:
            return None
        units = self._fetch(b)
        if units is not None:
            for old in [k for k in self._cache if k < min(c[0] for c in self._cursors.values())]:
                del self._cache[old]
            self._cache[b] = units
            return units
        end = self._log.read_json(self._log.path("_end.json"))
        if end is not None:
            self._end = int(end["batches"])
            if b >= self._end:
                return END
        error = self._log.read_json(self._log.path("_error.json"))
        if error is not None:
            raise SparkSourceError(f"{self._what}: the driver-side producer failed: {error.get('error')}")
        if b not in self._gap_checked:
            self._gap_checked.add(b)
            if self._exists(b + 1) or (self._end is not None and b < self._end):
                raise SparkSourceError(
                    f"{self._what}: batch {b} is missing from {self._log.url} although later batches exist; "
                    "something deleted it (or a checkpoint older than the log's retention was restored). "
                    "Restore a newer checkpoint or start the job fresh"
                )
        self._missing.add(b)
        return None

    def _poll_lane(self, lane: str) -> Any:
        cur = self._cursors[lane]
        for _ in range(10_000):  # bounded work per poll (skipping empty batches)
            it = self._iters[lane]
            if it is None:
                units = self._batch(cur[0])
                if units is END or units is None:
                    return units
                if cur[1] >= len(units):
                    cur[0] += 1
                    self._dirty.add(lane)
                    cur[1] = (int(lane) - cur[0]) % self._n
                    cur[2] = 0
                    continue
                it = self._open_unit(cur[0], units, cur[1], cur[2])
                self._iters[lane] = it
            chunk = next(it, None)
            if chunk is None:
                self._iters[lane] = None
                cur[1] += self._n
                cur[2] = 0
                continue
            if chunk.num_rows == 0:
                continue
            cur[2] += chunk.num_rows
            return chunk
        return None


def _batch_name(b: int) -> str:
    return f"batch-{b:012d}.json"


def _stage_dir(b: int) -> str:
    return f"batch-{b:012d}"


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
import time
import urllib.parse
from typing import Any, Iterator, Mapping

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


# --------------------------------------------------------------------------- lanes


def _read_name(lane: str) -> str:
    return f"_read-{int(lane)}.json"


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


"""Verification of checkpoints: manifests parse (and match their own checksum), chains are
well formed, every referenced file exists with the recorded size, checksum (with the algorithm
its manifest names) and row count and decodes within the root's decode limits (its decoded
size read from its headers, as a reader checks it before decoding), and each manifest follows
its recorded predecessor where that is still in the root (lineage).

The structural checks are pure (:func:`structural_problems`, :func:`lineage_problems`);
:func:`check_files` does the I/O.
"""
from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Mapping

import pyarrow as pa

from abscore.ids import id_ranges
from abscore.progress import ProgressCallback, Tracker
from abscore.units import human_bytes

from .decode_limits import DEFAULT_DECODE_LIMITS, DecodeLimits, beyond_limits
from .errors import CorruptFileError
from .format import checksum_hex
from .ids import CheckpointId
from .manifest import FileRef, Manifest, manifest_problems

__all__ = ["Problem", "ProblemKind", "VerifyReport", "structural_problems", "lineage_problems", "check_files",
           "count_rows", "removed_meanwhile"]

ProblemKind = Literal["manifest", "chain", "missing", "size", "checksum", "unreadable", "rows", "decoded_size",
                      "lineage", "removed"]
_FILE_MAGIC = b"ARROW1"


@dataclass(frozen=True)
class Problem:
    """One thing wrong, naming the checkpoints it breaks and the file (if any)."""

    kind: ProblemKind
    checkpoints: tuple[CheckpointId, ...]
    path: str | None
    message: str

    def __str__(self) -> str:
        ids = ", ".join(str(c) for c in self.checkpoints)
        where = f"checkpoint{'s' if len(self.checkpoints) > 1 else ''} {ids}"
        return f"{where}: {self.path + ': ' if self.path else ''}{self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`SnapshotStore.verify`."""

    checkpoints: tuple[CheckpointId, ...]
    files_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def removed(self) -> tuple[CheckpointId, ...]:
        """Checkpoints whose manifest was deleted while they were verified (by a GC: the
        retention of a job writing the root): gone, not damaged (see :func:`removed_meanwhile`)."""
        return tuple(sorted({c for p in self.problems if p.kind == "removed" for c in p.checkpoints}))

    @property
    def damaged(self) -> bool:
        """Whether a problem is in the data (any problem but a checkpoint removed meanwhile)."""
        return any(p.kind != "removed" for p in self.problems)

    @property
    def broken(self) -> tuple[CheckpointId, ...]:
        """Checkpoints affected by at least one problem."""
        return tuple(sorted({c for p in self.problems for c in p.checkpoints}))

    @property
    def latest_intact(self) -> CheckpointId | None:
        """Newest checked checkpoint without problems (what to restore from)."""
        bad = set(self.broken)
        intact = [c for c in self.checkpoints if c not in bad]
        return max(intact) if intact else None

    def lines(self) -> list[str]:
        out = [str(p) for p in self.problems if p.kind != "removed"]
        problems = [p for p in self.problems if p.kind != "removed"]
        broken = sorted({c for p in problems for c in p.checkpoints})
        verdict = "OK" if not problems else f"{len(problems)} problem(s) in checkpoints {broken}"
        action = ""
        if problems:
            action = (f"; restore from checkpoint {self.latest_intact}" if self.latest_intact is not None
                      else "; no checked checkpoint is intact")
        removed = self.removed
        if removed:
            out.append(f"checkpoint(s) {list(removed)} removed while verifying (deleted by a GC meanwhile, e.g. the "
                       "retention of a job writing this root): gone, not damaged; not counted")
        out.append(
            f"verified {len(self.checkpoints) - len(removed)} checkpoint(s), {self.files_checked} file(s), "
            f"{human_bytes(self.bytes_checked)}: {verdict}{action}"
        )
        return out


def structural_problems(manifests: Mapping[int, Manifest], unreadable: Mapping[int, str]) -> list[Problem]:
    """Problems visible without reading data files (pure)."""
    problems = [
        Problem("manifest", (CheckpointId(cid),), None, f"manifest unreadable: {reason}")
        for cid, reason in sorted(unreadable.items())
    ]
    for cid, manifest in sorted(manifests.items()):
        for path, message in manifest_problems(manifest):
            problems.append(Problem("chain", (CheckpointId(cid),), path, message))
    return problems


def lineage_problems(checked: Mapping[int, Manifest], present: Mapping[int, Manifest]) -> list[Problem]:
    """Manifests among ``checked`` whose recorded predecessor is in ``present`` (the root's
    readable manifests) with another checksum: not of this root's lineage (copied from another
    run, or the predecessor was replaced). A predecessor no longer there is not checked (pure)."""
    problems = []
    for cid, manifest in sorted(checked.items()):
        lineage = manifest.lineage
        if lineage is None or lineage.previous_id is None:
            continue
        prev = present.get(lineage.previous_id)
        if prev is None or prev.checksum is None or prev.checksum == lineage.previous_checksum:
            continue
        problems.append(Problem(
            "lineage", (CheckpointId(cid),), None,
            f"not of this root's lineage: it records that it follows checkpoint {lineage.previous_id} with manifest "
            f"checksum {str(lineage.previous_checksum)[:12]}..., but checkpoint {lineage.previous_id} here has "
            f"{prev.checksum[:12]}... (a manifest copied from another run of the job, or checkpoint "
            f"{lineage.previous_id} was replaced); do not restore from it",
        ))
    return problems


def removed_meanwhile(problems: list[Problem], gone: Iterable[int]) -> list[Problem]:
    """``problems`` of checked checkpoints, ``gone`` those among them whose manifest was deleted
    while they were verified (a GC: the retention of a job writing the root deletes a dropped
    checkpoint's files first, its manifest last; :meth:`SnapshotStore.dropped_meanwhile`), so
    the files they missed are no fault of the data. Their problems are replaced by one of kind
    ``"removed"`` each; a problem shared with checkpoints still present names those only (pure)."""
    gone = sorted(gone)
    if not gone:
        return problems
    out = []
    for p in problems:
        left = tuple(c for c in p.checkpoints if c not in gone)
        if left:
            out.append(p if left == p.checkpoints else Problem(p.kind, left, p.path, p.message))
    out.extend(Problem("removed", (CheckpointId(cid),), None,
                       "removed while verifying (its manifest was deleted by a GC meanwhile, e.g. the retention of a "
                       "job writing this root); it is no checkpoint any more")
               for cid in gone)
    return out


def count_rows(data: bytes | memoryview) -> int:
    """Rows of an encoded file: of an Arrow IPC stream, the sum of its record batches' lengths
    read from their message headers (nothing is decompressed: the bodies' bytes are covered
    by the checksum, and a restore decodes them, naming the file if that fails); of a format 1
    IPC file, decoding one column batch by batch. ``ValueError`` or an Arrow error when the
    messages do not parse."""
    buf = pa.py_buffer(data)
    if bytes(memoryview(data)[:len(_FILE_MAGIC)]) == _FILE_MAGIC:
        options = pa.ipc.IpcReadOptions(use_threads=False, included_fields=[0])
        reader = pa.ipc.open_file(pa.BufferReader(buf), options=options)
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    rows = 0
    schema = False
    for message in pa.ipc.MessageReader.open_stream(pa.BufferReader(buf)):
        if not schema:
            if message.type != "schema":
                raise ValueError(f"the stream starts with a {message.type} message, not its schema")
            schema = True
        elif message.type == "record batch":
            rows += _batch_length(message.metadata.to_pybytes())
    if not schema:
        raise ValueError("the stream holds no schema message")
    return rows


def _batch_length(meta: bytes) -> int:
    """``RecordBatch.length`` of an IPC message's flatbuffer (Arrow's ``Message.fbs``: the root
    table ``Message``, its field 2 ``header`` a ``RecordBatch`` table whose field 0 is the
    int64 ``length``)."""
    try:
        message = _U32.unpack_from(meta, 0)[0]
        at = _field(meta, message, 2)
        if at is None:
            raise ValueError("a record batch message without a header")
        header = at + _U32.unpack_from(meta, at)[0]
        at = _field(meta, header, 0)
        length = 0 if at is None else _I64.unpack_from(meta, at)[0]
    except struct.error as exc:
        raise ValueError(f"a record batch message header is cut short ({exc})") from None
    if length < 0:
        raise ValueError(f"a record batch message says it holds {length} rows")
    return length


def _field(buf: bytes, table: int, index: int) -> int | None:
    """Position of field ``index`` of the flatbuffer table at ``table`` (None: absent, its
    default)."""
    vtable = table - _I32.unpack_from(buf, table)[0]
    size = _U16.unpack_from(buf, vtable)[0]
    slot = 4 + 2 * index
    offset = _U16.unpack_from(buf, vtable + slot)[0] if slot + 2 <= size else 0
    return table + offset if offset else None


_U16, _U32, _I32, _I64 = (struct.Struct(f) for f in ("<H", "<I", "<i", "<q"))


def _ranges(refs: list[FileRef]) -> list[list[FileRef]]:
    """The references of one file grouped by the bytes they read and what they expect of them:
    the key groups of one shared range form one group (checked and reported once), any other
    reference a group of its own."""
    groups: dict[tuple, list[FileRef]] = {}
    for ref in refs:
        key = ref.id if not ref.shared else (ref.offset, ref.read_size, ref.checksum_algorithm, ref.checksum,
                                             ref.range_rows)
        groups.setdefault(key, []).append(ref)
    return list(groups.values())


def _holding(group: list[FileRef]) -> str:
    """The key groups a range holds, for messages: ``key group 3``, ``key groups 3-9, 12``."""
    kgs = sorted({r.key_group for r in group if r.key_group is not None})
    return f"key group{'s' if len(kgs) > 1 else ''} {id_ranges(kgs)}"


def _where(group: list[FileRef]) -> str:
    """The bytes a group reads: a reference's own :attr:`FileRef.where`, or a shared range's
    bytes when it holds several key groups."""
    ref = group[0]
    if len(group) == 1:
        return ref.where
    return f"{ref.path} bytes [{ref.offset}, {ref.offset + ref.read_size})"  # type: ignore[operator]


def _subject(group: list[FileRef]) -> str:
    """What a group's problem is about: a reference's id (``path#kg-NNNN`` for a range), or the
    packed file of a range shared by several key groups (the message names them)."""
    return group[0].id if len(group) == 1 else group[0].path


def check_files(
    manifests: Mapping[int, Manifest],
    listing: Mapping[str, int],
    read: Callable[[str], bytes],
    *,
    workers: int = 8,
    progress: ProgressCallback | None = None,
    limits: DecodeLimits = DEFAULT_DECODE_LIMITS,
) -> tuple[list[Problem], int, int]:
    """Check existence, size, checksum, row count and decoded size of every distinct referenced
    file; a packed file is read once and each referenced range of it checked on its own (a
    problem in one range names only the checkpoints that reference that range; a range shared
    by several key groups is checked, and a problem in it reported, once, naming its key groups).

    Returns (problems, files checked, bytes read). ``read`` fetches a file by relative path;
    ``progress`` hears of each file checked (stage ``verify``); ``limits``: the decode limits
    the store reads with, so that a file its readers would refuse (e.g. a compression bomb)
    does not verify.
    """
    users: dict[str, list[CheckpointId]] = {}  # by FileRef.id
    by_path: dict[str, dict[str, FileRef]] = {}
    for cid, manifest in sorted(manifests.items()):
        for ref_id, ref in manifest.files().items():
            users.setdefault(ref_id, []).append(CheckpointId(cid))
            by_path.setdefault(ref.path, {}).setdefault(ref_id, ref)

    def who(refs: list[FileRef]) -> tuple[CheckpointId, ...]:
        return tuple(sorted({c for ref in refs for c in users[ref.id]}))

    def check(path: str) -> tuple[list[Problem], int]:
        refs = sorted(by_path[path].values(), key=lambda r: r.offset or 0)
        first = refs[0]
        if path not in listing:
            return [Problem("missing", who(refs), path, f"file (written by checkpoint {first.checkpoint_id}) is missing")], 0
        size = listing[path]
        problems: list[Problem] = []
        if first.offset is None:
            if size != first.bytes:
                return [Problem("size", who(refs), path,
                                f"size {size} bytes, the manifest says {first.bytes}: torn or altered write")], 0
        ranges = _ranges(refs)
        if first.offset is not None:
            short = [group for group in ranges if group[0].offset + group[0].read_size > size]  # type: ignore[operator]
            problems.extend(
                Problem("size", who(group), _subject(group), f"the packed file has {size} bytes, {_holding(group)}'s "
                        f"range ends at {group[0].offset + group[0].read_size}: torn or truncated write")  # type: ignore[operator]
                for group in short
            )
            ranges = [group for group in ranges if group not in short]
            if not ranges:
                return problems, 0
        refs = [ref for group in ranges for ref in group]
        try:
            data = read(path)
        except FileNotFoundError:
            return [Problem("missing", who(refs), path,
                            f"file (written by checkpoint {first.checkpoint_id}) vanished while verifying")], 0
        except OSError as exc:
            return [Problem("unreadable", who(refs), path, f"cannot be read: {exc}")], 0
        for group in ranges:  # a range shared by several key groups is checked, and reported, once
            ref = group[0]
            subject = _subject(group)
            start = ref.offset or 0
            part = memoryview(data)[start:start + ref.read_size]
            if len(part) != ref.read_size:
                problems.append(Problem("size", who(group), subject, f"read {len(part)} bytes of {_where(group)}, "
                                        f"the manifest says {ref.read_size}: torn or altered write"))
                continue
            digest = checksum_hex(part, ref.checksum_algorithm)
            if digest != ref.checksum:
                what = "corrupt file" if ref.offset is None else f"corrupt range of {_holding(group)} ({ref.where})"
                if len(group) > 1:  # the problem names the file: the message, the bytes of it
                    what = f"corrupt shared range of {_holding(group)} (bytes [{start}, {start + ref.read_size}))"
                problems.append(Problem("checksum", who(group), subject, f"{ref.checksum_algorithm} {digest[:12]}..., "
                                        f"the manifest says {ref.checksum[:12]}...: {what}"))
                continue
            try:
                rows = count_rows(part)
            except (pa.ArrowException, OSError, ValueError) as exc:
                problems.append(Problem("unreadable", who(group), subject,
                                        f"not a readable Arrow IPC stream ({str(exc)[:200]})"))
                continue
            try:
                reason = beyond_limits(part, limits, source=_where(group))
            except CorruptFileError as exc:  # headers that count rows but do not add up to a size
                problems.append(Problem("unreadable", who(group), subject,
                                        f"not a readable Arrow IPC stream ({str(exc.__cause__ or exc)[:200]})"))
                continue
            if reason is not None:
                problems.append(Problem("decoded_size", who(group), subject, reason))
                continue
            want = ref.rows if ref.range_rows is None else ref.range_rows
            if rows != want:
                problems.append(Problem("rows", who(group), subject, f"holds {rows} rows, the manifest says {want}"
                                        f"{' (its shared range)' if ref.shared else ''}: the manifest or the file was altered"))
        return problems, len(data)

    paths = sorted(by_path)
    tracker = Tracker(progress, "verify", len(paths), "files")

    def check_counted(path: str) -> tuple[list[Problem], int]:
        try:
            return check(path)
        finally:
            tracker.advance()

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(check_counted, paths))
    problems = [p for ps, _ in results for p in ps]
    return problems, len(paths), sum(n for _, n in results)

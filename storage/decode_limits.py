"""Decode limits: how far one encoded state file may expand when decoded
(:class:`DecodeLimits`), and its decoded size read from the Arrow IPC message headers before
anything is decompressed (:func:`decoded_size`), so that a compression bomb fails with an
error naming the file instead of exhausting memory.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from .errors import CorruptFileError, StorageConfigError

__all__ = [
    "DecodeLimits",
    "DEFAULT_DECODE_LIMITS",
    "beyond_limits",
    "decoded_size",
]

_FILE_MAGIC = b"ARROW1"  # format 1: IPC file; format 2 files start with an IPC stream message


def _unreadable(source: str, exc: Exception) -> CorruptFileError:
    return CorruptFileError(f"{source}: not a readable Arrow IPC stream or file ({exc}); the file is corrupt; "
                            "restore from an earlier checkpoint or a savepoint")


@dataclass(frozen=True)
class DecodeLimits:
    """How far one state file may expand when decoded, so that a hostile or corrupt file (a
    compression bomb: a few KiB of zstd that inflate to gigabytes) fails with an error naming
    it instead of exhausting memory.

    A file of ``n`` encoded bytes may decode to ``max(min_bytes, max_ratio * n)`` bytes of
    Arrow buffers, and never more than ``max_bytes`` (``None``: no absolute limit). The
    defaults (1000 times, at least 256 MiB, at most 16 GiB) leave room for any state file the
    toolkit writes short of an almost constant column of hundreds of MiB in one key group;
    raise them with ``SnapshotStore.open(..., decode_limits=DecodeLimits.fixed(n))`` or
    ``abs-snapshot --max-decoded-bytes N``. The decoded size is read from the IPC message
    headers (each compressed buffer states its uncompressed length) before anything is
    decompressed.
    """

    max_ratio: float = 1000.0
    min_bytes: int = 256 << 20
    max_bytes: int | None = 16 << 30

    def __post_init__(self) -> None:
        if not (isinstance(self.max_ratio, (int, float)) and self.max_ratio >= 0):
            raise StorageConfigError(f"DecodeLimits.max_ratio={self.max_ratio!r}: use a number >= 0")
        if type(self.min_bytes) is not int or self.min_bytes < 0:
            raise StorageConfigError(f"DecodeLimits.min_bytes={self.min_bytes!r}: use an integer >= 0")
        if self.max_bytes is not None and (type(self.max_bytes) is not int or self.max_bytes < 0):
            raise StorageConfigError(f"DecodeLimits.max_bytes={self.max_bytes!r}: use an integer >= 0 or None")

    @classmethod
    def fixed(cls, limit: int) -> "DecodeLimits":
        """Every file may decode to ``limit`` bytes, whatever its encoded size."""
        return cls(max_ratio=0.0, min_bytes=limit, max_bytes=limit)

    def allowed(self, encoded_bytes: int) -> int:
        """How many decoded bytes a file of ``encoded_bytes`` may have."""
        ratio = self.max_ratio * encoded_bytes
        allowed = max(self.min_bytes, int(ratio) if math.isfinite(ratio) else 1 << 62)
        return allowed if self.max_bytes is None else min(allowed, self.max_bytes)

    def describe(self) -> str:
        if self.max_ratio == 0 and self.min_bytes == self.max_bytes:
            return f"the decode limit of {self.min_bytes} bytes"
        most = "" if self.max_bytes is None else f", at most {self.max_bytes} bytes"
        return f"the decode limit ({self.max_ratio:g} times the encoded size, at least {self.min_bytes} bytes{most})"


DEFAULT_DECODE_LIMITS = DecodeLimits()


# IPC message headers are flatbuffers (Arrow's format/Message.fbs). Reading the few fields
# needed to add up a record batch's buffer sizes takes a dozen struct reads; pyarrow decodes
# (and decompresses) a batch only as a whole.
_U16, _U32, _I32, _I64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<q")
_BUFFER = struct.Struct("<qq")
_HEADER_DICTIONARY_BATCH, _HEADER_RECORD_BATCH = 2, 3


def _fb_field(buf: bytes, table: int, slot: int) -> int | None:
    """Position of field ``slot`` of the flatbuffer table at ``table``, or ``None`` if absent."""
    vtable = table - _I32.unpack_from(buf, table)[0]
    if 4 + 2 * slot + 2 > _U16.unpack_from(buf, vtable)[0]:
        return None
    at = _U16.unpack_from(buf, vtable + 4 + 2 * slot)[0]
    return table + at if at else None


def _fb_ref(buf: bytes, pos: int) -> int:
    return pos + _U32.unpack_from(buf, pos)[0]


def _batch_decoded_size(buf: bytes, batch: int, body: int, body_size: int) -> int:
    """Bytes the buffers of the RecordBatch table at ``batch`` take once decompressed, and at
    least one per row (a column of the null type has rows but no buffers, and a reader still
    walks them); its message body is ``buf[body:body + body_size]``."""
    rows_at = _fb_field(buf, batch, 0)  # length: long
    rows = _I64.unpack_from(buf, rows_at)[0] if rows_at is not None else 0
    if rows < 0:
        raise ValueError(f"a record batch states {rows} rows")
    return max(rows, _buffers_size(buf, batch, body, body_size))


def _buffers_size(buf: bytes, batch: int, body: int, body_size: int) -> int:
    at = _fb_field(buf, batch, 2)  # buffers: [Buffer{offset: long, length: long}]
    if at is None:
        return 0
    vector = _fb_ref(buf, at)
    count = _U32.unpack_from(buf, vector)[0]
    compressed = _fb_field(buf, batch, 3) is not None  # BodyCompression: every buffer has a length prefix
    total = 0
    for i in range(count):
        offset, length = _BUFFER.unpack_from(buf, vector + 4 + 16 * i)
        if length <= 0:
            continue
        if offset < 0 or offset + length > body_size:
            raise ValueError(f"buffer {i} [{offset}, {offset + length}) lies outside the message body of {body_size} bytes")
        if not compressed:
            total += length
            continue
        if length < 8:
            raise ValueError(f"compressed buffer {i} has {length} bytes, fewer than its 8-byte length prefix")
        size = _I64.unpack_from(buf, body + offset)[0]
        if size < -1:
            raise ValueError(f"compressed buffer {i} states a negative uncompressed length {size}")
        total += length - 8 if size == -1 else size
    return total


def decoded_size(data: bytes | memoryview, *, source: str) -> int:
    """Bytes of Arrow buffers ``data`` (an encoded state file) decodes to, read from its
    message headers without decompressing anything (a few microseconds)."""
    try:
        return _decoded_size(data)
    except (ValueError, struct.error, IndexError) as exc:
        raise _unreadable(source, exc) from exc


def _decoded_size(data: bytes | memoryview) -> int:
    end = len(data)
    pos = 8 if data[:len(_FILE_MAGIC)] == _FILE_MAGIC else 0  # an IPC file holds a stream after its magic
    total = 0
    while pos + 4 <= end:
        size = _I32.unpack_from(data, pos)[0]
        pos += 4
        if size == -1:  # continuation marker, then the metadata length
            if pos + 4 > end:
                break
            size = _I32.unpack_from(data, pos)[0]
            pos += 4
        if size == 0:  # end of stream
            break
        if size < 0 or pos + size > end:
            raise ValueError(f"a message header of {size} bytes at byte {pos} does not fit in the file")
        root = _fb_ref(data, pos)
        at = _fb_field(data, root, 3)  # Message.bodyLength
        body_size = _I64.unpack_from(data, at)[0] if at is not None else 0
        body = pos + size
        if body_size < 0 or body + body_size > end:
            raise ValueError(f"a message body of {body_size} bytes at byte {body} does not fit in the file")
        type_at, header_at = _fb_field(data, root, 1), _fb_field(data, root, 2)
        if type_at is not None and header_at is not None:
            kind, header = data[type_at], _fb_ref(data, header_at)
            if kind == _HEADER_DICTIONARY_BATCH:
                batch_at = _fb_field(data, header, 1)
                if batch_at is not None:
                    total += _batch_decoded_size(data, _fb_ref(data, batch_at), body, body_size)
            elif kind == _HEADER_RECORD_BATCH:
                total += _batch_decoded_size(data, header, body, body_size)
        pos = body + body_size
    return total


def beyond_limits(data: bytes | memoryview, limits: DecodeLimits | None, *, source: str) -> str | None:
    """Why ``data`` (an encoded state file) may not be decoded within ``limits`` (default:
    :data:`DEFAULT_DECODE_LIMITS`), or ``None`` when it may: what a reader refuses, for
    verification to report before any reader meets it. Decompresses nothing; a file whose
    headers do not parse raises :class:`CorruptFileError` naming ``source``."""
    limits = DEFAULT_DECODE_LIMITS if limits is None else limits
    allowed = limits.allowed(len(data))
    size = decoded_size(data, source=source)
    if size <= allowed:
        return None
    return (f"{len(data)} encoded bytes would decode to {size} bytes, beyond {limits.describe()}; "
            "refusing to decode it (a corrupt or hostile file, e.g. a compression bomb); if you trust this root, "
            "raise the limit (abs-snapshot --max-decoded-bytes N, or SnapshotStore.open(..., "
            "decode_limits=DecodeLimits.fixed(N)))")


def _check_decoded_size(data: bytes, source: str, limits: DecodeLimits | None) -> None:
    reason = beyond_limits(data, limits, source=source)
    if reason is not None:
        raise CorruptFileError(f"{source}: {reason}")

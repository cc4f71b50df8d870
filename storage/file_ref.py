"""File references: a file of a snapshot (or a range of a packed file) as a manifest
records it, validated on construction, with its JSON form."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from abscore.keygroups import MAX_MAX_PARALLELISM as _MAX_MAX_PARALLELISM

from .checksums import CHECKSUM_ALGORITHMS, is_checksum
from .errors import InvalidPathError
from .ids import CheckpointId, KeyGroup
from .manifest_json import MAX_INT, _short
from .paths import FileKind, ParsedPath, StoragePaths, validate_relative_path

__all__ = ["FileRef", "KEYED_KINDS"]

KEYED_KINDS = ("base", "delta")
_FILE_KINDS = ("base", "delta", "opstate", "channel")


@dataclass(frozen=True)
class FileRef:
    """A file of a snapshot as the manifest records it.

    ``path`` is relative to the root (validated: relative POSIX, no ``..``, and its name must
    match ``kind`` and ``checkpoint_id``); ``checksum`` is the lower-case hex digest of the
    whole file with ``checksum_algorithm`` (``sha256`` in format 1 manifests, which do not name
    it); ``bytes`` its size; ``rows`` the number of rows of the Arrow table in it.

    A *range* of a packed file (``state/<op>/<state>/packed/...``) has ``offset`` and
    ``key_group`` set: the key group's file is the ``bytes`` bytes at ``offset`` of ``path``,
    and ``checksum`` covers exactly those bytes. Several references then share one ``path``;
    :attr:`id` tells them apart.

    A range may hold the rows of several key groups (format 6: the small files of a
    checkpoint share one Arrow stream, a *shared range*): ``row_offset``, ``range_rows`` and
    ``range_bytes`` are then set. The range is the ``range_bytes`` bytes at ``offset``, its
    stream holds ``range_rows`` rows, of which rows ``[row_offset, row_offset + rows)`` are the
    key group's; ``checksum`` covers the whole range, and ``bytes`` is the key group's share of
    it (the shares of a range's key groups add up to ``range_bytes``), so that sums of
    ``bytes`` count a shared range once. :attr:`read_size` is what reading the reference reads.
    """

    path: str
    kind: FileKind
    checkpoint_id: CheckpointId
    rows: int
    bytes: int
    checksum: str
    checksum_algorithm: str = "sha256"
    offset: int | None = None
    key_group: int | None = None
    row_offset: int | None = None
    range_rows: int | None = None
    range_bytes: int | None = None

    def __post_init__(self) -> None:
        validate_relative_path(self.path)
        if self.kind not in _FILE_KINDS:
            raise InvalidPathError(f"file {self.path}: kind {self.kind!r} is not one of {_FILE_KINDS}")
        for name in ("checkpoint_id", "rows", "bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
                raise InvalidPathError(f"file {self.path}: {name}={_short(value)} is not an integer in [0, 2**63)")
        if self.checksum_algorithm not in CHECKSUM_ALGORITHMS:
            raise InvalidPathError(
                f"file {self.path}: checksum algorithm {self.checksum_algorithm!r} is not one of {sorted(CHECKSUM_ALGORITHMS)}"
            )
        if not is_checksum(self.checksum, self.checksum_algorithm):
            raise InvalidPathError(f"file {self.path}: checksum {self.checksum!r} is not a {self.checksum_algorithm} hex digest")
        if (self.offset is None) != (self.key_group is None):
            raise InvalidPathError(
                f"file {self.path}: offset={self.offset!r} and key_group={self.key_group!r}: a range of a packed file "
                "has both, a file of its own neither; refusing the reference"
            )
        if self.offset is not None:
            for name, top in (("offset", MAX_INT - self.bytes), ("key_group", _MAX_MAX_PARALLELISM - 1)):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
                    raise InvalidPathError(f"file {self.path}: {name}={_short(value)} is not an integer in [0, {top}]")
        shared = (self.row_offset, self.range_rows, self.range_bytes)
        if any(v is None for v in shared) and any(v is not None for v in shared):
            raise InvalidPathError(
                f"file {self.path}: row_offset={self.row_offset!r}, range_rows={self.range_rows!r}, "
                f"range_bytes={self.range_bytes!r}: a key group's rows in a shared range need all three; "
                "refusing the reference"
            )
        if self.row_offset is not None:
            if self.offset is None:
                raise InvalidPathError(f"file {self.path}: row_offset, range_rows and range_bytes are set, but the "
                                       "reference is not a range of a packed file (no offset); refusing the reference")
            for name in ("row_offset", "range_rows", "range_bytes"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
                    raise InvalidPathError(f"file {self.path}: {name}={_short(value)} is not an integer in [0, 2**63)")
            if self.row_offset + self.rows > self.range_rows:
                raise InvalidPathError(
                    f"file {self.path}: key group {self.key_group}'s rows [{self.row_offset}, "
                    f"{self.row_offset + self.rows}) end past the {self.range_rows} rows of its shared range; "
                    "refusing the reference"
                )
            if self.bytes > self.range_bytes or self.offset > MAX_INT - self.range_bytes:  # type: ignore[operator]
                raise InvalidPathError(
                    f"file {self.path}: key group {self.key_group}'s share of {self.bytes} bytes exceeds its shared "
                    f"range of {self.range_bytes} bytes, or the range ends past 2**63; refusing the reference"
                )
        parsed = StoragePaths.parse(self.path)
        category = "packed" if self.packed else self.kind
        if (parsed is None or parsed.category != category or parsed.checkpoint_id != self.checkpoint_id
                or (self.packed and self.kind not in ("base", "delta"))):
            what = f"packed file of checkpoint {self.checkpoint_id} holding a {self.kind}" if self.packed \
                else f"{self.kind} file of checkpoint {self.checkpoint_id}"
            raise InvalidPathError(f"file {self.path}: the name does not denote a {what}; refusing the reference")

    @property
    def packed(self) -> bool:
        """Whether this is a range of a packed file rather than a file of its own."""
        return self.offset is not None

    @property
    def shared(self) -> bool:
        """Whether this is a key group's rows in a range shared with other key groups (format 6)."""
        return self.row_offset is not None

    @property
    def range_id(self) -> tuple[str, int]:
        """The bytes this reference reads, as ``(path, offset)``: equal for the references of
        one shared range."""
        return (self.path, -1 if self.offset is None else self.offset)

    @property
    def read_size(self) -> int:
        """The bytes reading this reference reads: ``bytes``, or of a shared range the whole
        range (``range_bytes``)."""
        return self.bytes if self.range_bytes is None else self.range_bytes

    @property
    def id(self) -> str:
        """Unique among a root's references: the path, plus ``#kg-NNNN`` for a range of a packed file."""
        return self.path if self.key_group is None else StoragePaths.range_id(self.path, self.key_group)

    @property
    def where(self) -> str:
        """The file, and for a range of a packed file the bytes of it (for messages and listings)."""
        if self.offset is None:
            return self.path
        rows = f" rows [{self.row_offset}, {self.row_offset + self.rows})" if self.row_offset is not None else ""
        return f"{self.path} bytes [{self.offset}, {self.offset + self.read_size}){rows}"

    def in_range(self, key_group: int, *, row_offset: int | None = None, rows: int | None = None,
                 share: int | None = None) -> "FileRef":
        """This reference to a whole range of a packed file, as key group ``key_group``'s: all of
        the range, or (``row_offset``, ``rows``, its ``share`` of the bytes) its rows of a shared
        range. Only what differs is checked (the range was checked when this reference was
        built): reading a manifest builds one reference per key group and chain position."""
        if not self.packed or self.shared:
            raise ValueError(f"file {self.where}: in_range needs a reference to a whole range of a packed file")
        # the key of the chain that holds the reference: one outside [0, max_parallelism) is the
        # manifest's structural problem, named by manifest_problems (verify, restore plans)
        if type(key_group) is not int or not 0 <= key_group <= MAX_INT:
            raise InvalidPathError(f"file {self.path}: key_group={_short(key_group)} is not an integer in [0, 2**63)")
        fields = dict(self.__dict__, key_group=key_group)
        if row_offset is not None:
            if rows is None or share is None or not 0 <= row_offset <= row_offset + rows <= self.rows \
                    or not 0 <= share <= self.bytes:
                raise InvalidPathError(f"file {self.where}: rows [{row_offset}, +{rows}) or share {share} do not fit "
                                       "the range; refusing the reference")
            fields.update(rows=rows, bytes=share, row_offset=row_offset, range_rows=self.rows, range_bytes=self.bytes)
        ref = object.__new__(FileRef)
        ref.__dict__.update(fields)  # a frozen dataclass: built as __init__ would, without its checks
        return ref

    def location(self) -> ParsedPath:
        """Operator / state / key group / subtask / task encoded in the path (the key group of a
        range of a packed file comes from the reference)."""
        parsed = StoragePaths.parse(self.path)
        assert parsed is not None  # validated in __post_init__
        if self.key_group is not None:
            return dataclasses.replace(parsed, category=self.kind, key_group=KeyGroup(self.key_group))
        return parsed

    def to_dict(self) -> dict[str, Any]:
        out = {
            "path": self.path,
            "kind": self.kind,
            "checkpoint_id": self.checkpoint_id,
            "rows": self.rows,
            "bytes": self.bytes,
            "checksum": self.checksum,
            "checksum_algorithm": self.checksum_algorithm,
        }
        if self.offset is not None:
            out["offset"] = self.offset
            out["key_group"] = self.key_group
        if self.row_offset is not None:
            out["row_offset"] = self.row_offset
            out["range_rows"] = self.range_rows
            out["range_bytes"] = self.range_bytes
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FileRef":
        if not isinstance(data, Mapping):
            raise InvalidPathError(f"file reference {data!r} is not an object")
        missing = {"path", "kind", "checkpoint_id", "rows", "bytes", "checksum"} - set(data)
        if missing:
            raise InvalidPathError(f"file reference {data.get('path', '?')!r} lacks {sorted(missing)}")
        return cls(
            path=data["path"], kind=data["kind"], checkpoint_id=CheckpointId(data["checkpoint_id"]),
            rows=data["rows"], bytes=data["bytes"], checksum=data["checksum"],
            checksum_algorithm=data.get("checksum_algorithm", "sha256"),
            offset=data.get("offset"), key_group=data.get("key_group"),
            row_offset=data.get("row_offset"), range_rows=data.get("range_rows"), range_bytes=data.get("range_bytes"),
        )

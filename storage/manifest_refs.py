"""The reference tables of a manifest (format 7): every file it names once (``files``), every
range of those files once (``ranges``), and each file reference as a short array of indexes
into them (see "Reference tables" in ``storage/FORMAT.md``).

Format 6 and older spelled out every reference in full (path, checksum, algorithm, sizes) in
every key group's chain, and every manifest repeats every chain: a checkpoint that changed 1 %
of its keys wrote a delta of 6 KB and a manifest of 100 KB. A range is now named once, and a
reference costs a few bytes: ``[range]`` (all of the range's rows) or ``[range, row_offset,
rows]`` (a key group's rows of a shared range). Pure: no I/O.
"""
from __future__ import annotations

from typing import Any

from .file_ref import FileRef
from .ids import CheckpointId
from .manifest_json import MAX_INT, _short
from .paths import StoragePaths, validate_relative_path

__all__ = ["RANGE_FIELDS", "MAX_REFERENCES", "RefTables", "RefReader", "share_of_range"]

RANGE_FIELDS = ("file", "kind", "offset", "bytes", "rows", "checksum_algorithm", "checksum")
"""The fields of a range entry, in order (a JSON array)."""

MAX_REFERENCES = 1 << 22
"""Most references (and most ranges, and most files) a manifest may hold. A reference of
format 7 costs some 6 bytes of JSON, so the size limit alone would let a manifest of
256 MiB expand into tens of millions of references in memory; 4 Mi is more than a job of
32,768 key groups with a dozen states of chains of ten files needs."""


def share_of_range(range_bytes: int, range_rows: int, row_offset: int, rows: int) -> int:
    """A key group's share of a shared range's bytes, by rows: the shares of a range's key
    groups add up to ``range_bytes`` (see "Packed files" in ``storage/FORMAT.md``)."""
    end = row_offset + rows
    return range_bytes * end // range_rows - range_bytes * row_offset // range_rows if range_rows else 0


class RefTables:
    """Builds ``files`` and ``ranges`` while references are turned into entries (writing)."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.ranges: list[list[Any]] = []
        self._file_index: dict[str, int] = {}
        self._range_index: dict[tuple[str, int], int] = {}
        self._known: dict[tuple, int] = {}  # a range's fields -> its index

    def entry(self, ref: FileRef) -> list[int]:
        """The entry of ``ref``: ``[range]`` or ``[range, row_offset, rows]``. ``ValueError``
        when two references to one range disagree about it, or a shared reference's ``bytes``
        is not its share of the range (neither happens to references this code writes)."""
        row_offset, range_rows, range_bytes = ref.row_offset, ref.range_rows, ref.range_bytes
        # a range already named with the same fields: its index (one dictionary look-up per
        # reference; a manifest of 32,768 key groups has that many)
        known = (ref.path, ref.offset, ref.kind, ref.bytes if range_bytes is None else range_bytes,
                 ref.rows if range_rows is None else range_rows, ref.checksum_algorithm, ref.checksum)
        index = self._known.get(known)
        if index is None:
            index = self._known[known] = self._new_entry(ref)
        if row_offset is None:
            return [index]
        if ref.bytes != share_of_range(range_bytes, range_rows, row_offset, ref.rows):  # type: ignore[arg-type]
            raise ValueError(f"file {ref.where}: bytes={ref.bytes} is not the key group's share of its shared range")
        return [index, row_offset, ref.rows]

    def _new_entry(self, ref: FileRef) -> int:
        """The index of ``ref``'s range, named in ``ranges`` (and its file in ``files``) if it is not yet."""
        file = self._file_index.get(ref.path)
        if file is None:
            file = self._file_index[ref.path] = len(self.files)
            self.files.append(ref.path)
        offset = 0 if ref.offset is None else ref.offset
        rows = ref.rows if ref.range_rows is None else ref.range_rows
        described = [file, ref.kind, offset, ref.read_size, rows, ref.checksum_algorithm, ref.checksum]
        key = (ref.path, offset)
        index = self._range_index.get(key)
        if index is None:
            index = self._range_index[key] = len(self.ranges)
            self.ranges.append(described)
        elif self.ranges[index] != described:
            raise ValueError(f"file {ref.where}: references to this range disagree about its kind, size, rows or "
                             "checksum")
        return index


class RefReader:
    """Turns the entries of a parsed manifest back into :class:`FileRef` values (reading).

    Every structural problem is a ``ValueError`` naming the entry; the manifest parser
    reports it as a corrupt manifest. Each range is validated once (as a reference to the
    whole range), each entry then only for what it adds.
    """

    def __init__(self, files: Any, ranges: Any) -> None:
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise ValueError("files is not a list of paths")
        if not isinstance(ranges, list):
            raise ValueError("ranges is not a list")
        for name, table in (("files", files), ("ranges", ranges)):
            if len(table) > MAX_REFERENCES:
                raise ValueError(f"{name} has {len(table)} entries, more than the {MAX_REFERENCES} a manifest may hold")
        self._files = files
        self._ranges = ranges
        self._whole: list[FileRef | None] = [None] * len(ranges)
        self._count = 0

    def _range(self, index: Any, where: str) -> FileRef:
        if type(index) is not int or not 0 <= index < len(self._ranges):
            raise ValueError(f"{where}: range {_short(index)} is not an index into ranges (0..{len(self._ranges) - 1})")
        whole = self._whole[index]
        if whole is not None:
            return whole
        entry = self._ranges[index]
        if not isinstance(entry, list) or len(entry) != len(RANGE_FIELDS):
            raise ValueError(f"ranges[{index}] is not an array of {len(RANGE_FIELDS)} fields {list(RANGE_FIELDS)}")
        file, kind, offset, size, rows, algorithm, checksum = entry
        if type(file) is not int or not 0 <= file < len(self._files):
            raise ValueError(f"ranges[{index}]: file {_short(file)} is not an index into files (0..{len(self._files) - 1})")
        path = validate_relative_path(self._files[file])  # a path outside the root: its own message
        parsed = StoragePaths.parse(path)
        if parsed is None or parsed.checkpoint_id is None:
            raise ValueError(f"files[{file}]: {_short(path)} is not the path of a file this format writes")
        packed = parsed.category == "packed"
        if not packed and offset != 0:
            raise ValueError(f"ranges[{index}]: offset {_short(offset)} in {path}, a file of its own (must be 0)")
        if type(algorithm) is not str or type(checksum) is not str:
            raise ValueError(f"ranges[{index}]: checksum_algorithm and checksum are not strings")
        whole = FileRef(path=path, kind=kind, checkpoint_id=CheckpointId(parsed.checkpoint_id), rows=rows, bytes=size,
                        checksum=checksum, checksum_algorithm=algorithm, offset=offset if packed else None,
                        key_group=0 if packed else None)
        self._whole[index] = whole
        return whole

    def ref(self, entry: Any, where: str, key_group: int | None = None) -> FileRef:
        """The reference of ``entry``; ``key_group``: the key group whose chain holds it (``None``
        outside ``keyed``, where a range of a packed file does not belong)."""
        self._count += 1
        if self._count > MAX_REFERENCES:
            raise ValueError(f"more than {MAX_REFERENCES} references; refusing to expand them")
        if not isinstance(entry, list) or len(entry) not in (1, 3):
            raise ValueError(f"{where}: reference {_short(entry)} is not [range] or [range, row_offset, rows]")
        whole = self._range(entry[0], where)
        if not whole.packed:
            if len(entry) != 1:
                raise ValueError(f"{where}: a reference to rows of {whole.path}, a file of its own (only [range] is)")
            return whole
        if key_group is None:
            raise ValueError(f"{where}: {whole.path} is a packed file; only chains of keyed state reference those")
        if len(entry) == 1:
            return whole.in_range(key_group)
        row_offset, rows = entry[1], entry[2]
        for name, value in (("row_offset", row_offset), ("rows", rows)):
            if type(value) is not int or not 0 <= value <= MAX_INT:
                raise ValueError(f"{where}: {name} {_short(value)} is not an integer in [0, 2**63)")
        if row_offset + rows > whole.rows:
            raise ValueError(f"{where}: rows [{row_offset}, {row_offset + rows}) end past the {whole.rows} rows of "
                             f"{whole.where}")
        share = share_of_range(whole.bytes, whole.rows, row_offset, rows)
        return whole.in_range(key_group, row_offset=row_offset, rows=rows, share=share)

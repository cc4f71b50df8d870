"""Checkpoint manifests and their lineage, with their JSON form (format versions 1 to 7), and
the structural checks of a manifest (pure).

File references (:mod:`storage.file_ref`), the reference tables of format 7
(:mod:`storage.manifest_refs`) and the bounded JSON documents with the manifest checksum
(:mod:`storage.manifest_json`) live next door and are handed on from here.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

from abscore.gcpause import gc_paused
from abscore.keygroups import MAX_MAX_PARALLELISM as _MAX_MAX_PARALLELISM

from .checksums import WRITE_CHECKSUM_ALGORITHM, is_checksum
from .errors import CorruptManifestError, StateNotFoundError, UnsupportedFormatError
from .file_ref import KEYED_KINDS, FileRef
from .ids import CheckpointId
from .manifest_json import (
    MAX_INT,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    _short,
    json_depth_exceeds,
    layout_json,
    manifest_checksum,
    parse_json_document,
)
from .manifest_refs import RefReader, RefTables
from .paths import StoragePaths

__all__ = [
    "FORMAT_VERSION",
    "FileRef",
    "Lineage",
    "Manifest",
    "MAX_MANIFEST_BYTES",
    "MAX_JSON_DEPTH",
    "manifest_checksum",
    "parse_json_document",
    "ManifestKind",
    "KEYED_KINDS",
    "chain_problems",
    "manifest_problems",
]

FORMAT_VERSION = 8
"""Version of the on-disk format (manifests, ``_job.json``, file layout) this code writes; it
reads every version from 1 up to this one. Version 2: file references name their checksum
algorithm, data files are Arrow IPC streams. Version 3: a reference may be a range of a packed
file (``offset``, ``key_group``). Version 4: the delta right after a chain's base may be a
*values image* (no ``key`` column; the values of the base's rows). Version 5: a manifest
carries a checksum of its own content and a lineage; pins (``pins/``) hold checkpoints
against GC. Version 6: the small files of a checkpoint's packed file share one Arrow stream
(a reference's ``row_offset``, ``range_rows``, ``range_bytes``). Version 7: a manifest names
each file and each range of a file once (``files``, ``ranges``) and its references are short
arrays of indexes into them. Version 8: a values image's numeric columns may be stored
byte-stream split (``fixed_size_binary`` with field metadata ``abs.byte_stream_split``). See
``storage/FORMAT.md``."""

TABLES_VERSION = 7
"""The first format whose manifests hold reference tables (:mod:`storage.manifest_refs`)."""

ManifestKind = Literal["checkpoint", "savepoint"]
_FREE_FORM = ("source_offsets", "sink_transactions", "stats")  # a manifest's parts the runtime fills with JSON values


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class Lineage:
    """Where a checkpoint's manifest comes from: ``run_id`` of the driver run that wrote it,
    and the checkpoint of the same root it follows (``previous_id`` and that manifest's
    checksum ``previous_checksum``; both ``None`` for a fresh start and a restore from another
    root). Savepoints have no lineage."""

    run_id: str
    previous_id: int | None = None
    previous_checksum: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not 1 <= len(self.run_id) <= 64:
            raise ValueError(f"lineage run_id {_short(self.run_id)} is not a string of 1 to 64 characters")
        if (self.previous_id is None) != (self.previous_checksum is None):
            raise ValueError("lineage previous: checkpoint_id and checksum go together")
        if self.previous_id is not None:
            if not isinstance(self.previous_id, int) or isinstance(self.previous_id, bool) \
                    or not 1 <= self.previous_id <= MAX_INT:
                raise ValueError(f"lineage previous checkpoint_id {_short(self.previous_id)} is invalid")
            if not isinstance(self.previous_checksum, str) or len(self.previous_checksum) > 128:
                raise ValueError(f"lineage previous checksum {_short(self.previous_checksum)} is invalid")

    @classmethod
    def following(cls, run_id: str, previous: "Manifest | None") -> "Lineage":
        """The lineage of a checkpoint written by run ``run_id`` after ``previous`` (a manifest
        as stored, i.e. with its checksum; ``None``: follows nothing)."""
        if previous is None or previous.checksum is None:
            return cls(run_id)
        return cls(run_id, previous.checkpoint_id, previous.checksum)

    def to_dict(self) -> dict[str, Any]:
        prev = None if self.previous_id is None else {"checkpoint_id": self.previous_id,
                                                       "checksum": self.previous_checksum}
        return {"run_id": self.run_id, "previous": prev}

    @classmethod
    def from_dict(cls, data: Any) -> "Lineage":
        if not isinstance(data, dict) or not isinstance(data.get("previous"), (dict, type(None))):
            raise ValueError("lineage is not an object with run_id and previous")
        prev = data.get("previous") or {}
        return cls(data.get("run_id"), prev.get("checkpoint_id"), prev.get("checksum"))  # type: ignore[arg-type]


@dataclass(kw_only=True)
class Manifest:
    """Everything needed to restore checkpoint ``checkpoint_id``; its existence in storage
    is the commit point.

    - ``keyed[operator][state][key_group]``: the chain (a base, then deltas, oldest first).
    - ``operator_state[operator][subtask]``: one file per subtask; ``operator_state_rules[operator]``
      names its redistribution rule (``"split"``, ``"union"``, ``"broadcast"``, ...).
    - ``channel_logs``: logged in-flight records of iteration heads.
    - ``source_offsets[operator][split_id]`` and ``sink_transactions[operator]``: JSON values.
    - ``stats``: free-form JSON; :meth:`SnapshotStore.commit` adds the storage figures
      (see :func:`storage.stats.storage_stats`).
    - ``assignment``: the subtask that owned each key group when the checkpoint was taken,
      when live reconfiguration had moved key groups (``None``: the contiguous ranges of
      the job's parallelism). Optional; readers that do not know it ignore it.
    """

    checkpoint_id: CheckpointId
    job_name: str
    max_parallelism: int
    kind: ManifestKind = "checkpoint"
    format_version: int = FORMAT_VERSION
    created_at: float = field(default_factory=_now)
    keyed: dict[str, dict[str, dict[int, list[FileRef]]]] = field(default_factory=dict)
    operator_state: dict[str, dict[int, FileRef]] = field(default_factory=dict)
    operator_state_rules: dict[str, str] = field(default_factory=dict)
    channel_logs: list[FileRef] = field(default_factory=list)
    source_offsets: dict[str, dict[str, Any]] = field(default_factory=dict)
    sink_transactions: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    lineage: Lineage | None = None
    assignment: tuple[int, ...] | None = None
    checksum: str | None = field(default=None, compare=False)
    """The manifest's own checksum as stored (set when read or committed; ``None`` for a
    manifest not yet committed and for manifests of format 4 and older)."""
    checksum_algorithm: str | None = field(default=None, compare=False)

    # ------------------------------------------------------------------ access
    def iter_refs(self) -> Iterator[FileRef]:
        """Every file reference, in manifest order (a shared file may appear more than once)."""
        for states in self.keyed.values():
            for chains in states.values():
                for chain in chains.values():
                    yield from chain
        for subtasks in self.operator_state.values():
            yield from subtasks.values()
        yield from self.channel_logs

    def files(self) -> dict[str, FileRef]:
        """Distinct references by :attr:`FileRef.id` (a range of a packed file is one entry)."""
        return {ref.id: ref for ref in self.iter_refs()}

    def paths(self) -> set[str]:
        """Distinct files the manifest needs (a packed file once, however many ranges of it)."""
        return {ref.path for ref in self.iter_refs()}

    def chains(self, operator: str, state: str) -> dict[int, list[FileRef]]:
        """Chains by key group of one keyed state; :class:`StateNotFoundError` if absent."""
        if operator not in self.keyed:
            raise StateNotFoundError(
                f"checkpoint {self.checkpoint_id}: no keyed state for operator {operator!r} "
                f"(operators: {sorted(self.keyed)}); check the operator uid"
            )
        states = self.keyed[operator]
        if state not in states:
            raise StateNotFoundError(
                f"checkpoint {self.checkpoint_id}: operator {operator!r} has no state {state!r} "
                f"(states: {sorted(states)}); check the state name"
            )
        return states[state]

    @property
    def pinned(self) -> bool:
        """Savepoints are pinned: GC keeps them and their files regardless of retention."""
        return self.kind == "savepoint"

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The manifest's JSON document without its checksum (see :meth:`to_json`), in the form
        of its ``format_version``: from version 7 on, references are entries of the reference
        tables ``files`` and ``ranges``; before, each is spelled out (:meth:`FileRef.to_dict`).
        ``ValueError`` if references to one range disagree about it."""
        out: dict[str, Any] = {
            "format_version": self.format_version,
            "checkpoint_id": self.checkpoint_id,
            "kind": self.kind,
            "job_name": self.job_name,
            "max_parallelism": self.max_parallelism,
            "created_at": self.created_at,
        }
        if self.format_version >= TABLES_VERSION:
            tables = RefTables()
            entry = tables.entry
            # filled in by the entries below, but written before them: a reader meets the tables first
            out["files"], out["ranges"] = tables.files, tables.ranges
        else:
            entry = FileRef.to_dict  # type: ignore[assignment]
        out.update({
            "keyed": {
                op: {
                    st: {str(kg): [entry(r) for r in chain] for kg, chain in sorted(chains.items())}
                    for st, chains in states.items()
                }
                for op, states in self.keyed.items()
            },
            "operator_state": {
                op: {str(i): entry(ref) for i, ref in sorted(subtasks.items())}
                for op, subtasks in self.operator_state.items()
            },
            "operator_state_rules": dict(self.operator_state_rules),
            "channel_logs": [entry(r) for r in self.channel_logs],
            "source_offsets": self.source_offsets,
            "sink_transactions": self.sink_transactions,
            "stats": self.stats,
        })
        if self.lineage is not None:
            out["lineage"] = self.lineage.to_dict()
        if self.assignment is not None:
            out["assignment"] = list(self.assignment)
        return out

    def to_json(self, algorithm: str = WRITE_CHECKSUM_ALGORITHM) -> str:
        """The manifest as stored: :meth:`to_dict` plus ``checksum_algorithm`` and ``checksum``
        (of the document as a reader parses it back, see :func:`manifest_checksum`)."""
        return self._encode(algorithm)[0]

    def _encode(self, algorithm: str = WRITE_CHECKSUM_ALGORITHM) -> tuple[str, str]:
        """(JSON text, checksum)."""
        with gc_paused():  # lists and strings per key group: no garbage among them
            return self._encode_unpaused(algorithm)

    def _encode_unpaused(self, algorithm: str) -> tuple[str, str]:
        try:
            doc = self.to_dict()
        except ValueError as exc:  # references to one range disagree
            raise CorruptManifestError(
                f"checkpoint {self.checkpoint_id}: {str(exc)[:300]}; refusing to commit the manifest; pass the "
                "references the store's writes returned, unchanged", reason="inconsistent references") from None
        try:
            # the runtime's JSON values are the only parts that may nest deep (the rest has a fixed depth)
            if json_depth_exceeds({k: doc[k] for k in _FREE_FORM if k in doc}, MAX_JSON_DEPTH):
                raise ValueError(f"arrays or objects nest deeper than {MAX_JSON_DEPTH} levels")
            parsed = _as_parsed(doc)  # exactly what a reader will parse and hash
            digest = manifest_checksum(parsed, algorithm)
            stored = {"format_version": parsed.pop("format_version"), "checksum_algorithm": algorithm,
                      "checksum": digest, **parsed}
            return layout_json(stored), digest
        except (TypeError, ValueError, RecursionError) as exc:
            raise CorruptManifestError(
                f"checkpoint {self.checkpoint_id}: the manifest is not JSON-serialisable ({str(exc)[:200]}); "
                "refusing to commit it; make source offsets, sink transactions and stats plain JSON values"
            ) from None

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "manifest") -> "Manifest":
        """Parse a manifest and check its checksum; ``source`` names it in error messages.
        Size, nesting and numbers are bounded (see :func:`parse_json_document`)."""
        with gc_paused():  # a reference per key group and chain position: no garbage among them
            return cls.from_dict(parse_json_document(text, source=source), source=source, stored=True)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "manifest", stored: bool = False) -> "Manifest":
        """Build a manifest from its JSON document. The checksum is checked when the document
        has one; a ``stored`` document (read from a root) of format 5 or later must have one
        (:meth:`to_dict` of a manifest in memory has none)."""
        if not isinstance(data, dict):
            raise CorruptManifestError(f"{source}: is not a JSON object; the checkpoint is corrupt; restore from "
                                       "another checkpoint", reason="not a JSON object")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CorruptManifestError(f"{source}: format_version {_short(version)} is invalid; the manifest is corrupt; "
                                       "restore from another checkpoint", reason="invalid format_version")
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{source}: written with storage format version {version}, this toolkit reads up to "
                f"{FORMAT_VERSION}; upgrade to a release that supports format version {version}"
            )
        try:
            # version 2 only adds FileRef.checksum_algorithm, version 3 FileRef.offset / key_group,
            # version 7 the reference tables
            manifest = cls._from_dict_v1(data, tables=version >= TABLES_VERSION)
            if version < 3 and any(ref.packed for ref in manifest.iter_refs()):
                raise ValueError(f"a format {version} manifest references a range of a packed file (format 3 and later)")
            if version < 6 and any(ref.shared for ref in manifest.iter_refs()):
                raise ValueError(f"a format {version} manifest references a key group's rows in a shared range "
                                 "(row_offset, range_rows, range_bytes: format 6 and later)")
        except CorruptManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            what = f"lacks field {exc}" if isinstance(exc, KeyError) else str(exc)[:300]
            raise CorruptManifestError(
                f"{source}: {what}; the manifest is corrupt or names files outside the root; "
                "do not restore from it, use another checkpoint", reason=what[:120]
            ) from None
        # after the structure: a malformed manifest is named by what is wrong with it
        manifest.checksum, manifest.checksum_algorithm = cls._check_checksum(data, version if stored else 0, source)
        return manifest

    @staticmethod
    def _check_checksum(data: dict[str, Any], version: int, source: str) -> tuple[str | None, str | None]:
        checksum, algorithm = data.get("checksum"), data.get("checksum_algorithm")
        if checksum is None and algorithm is None:
            if version >= 5:
                raise CorruptManifestError(
                    f"{source}: a format {version} manifest without its checksum (removed by hand?); the manifest "
                    "cannot be trusted; do not restore from it, use another checkpoint", reason="checksum missing")
            return None, None
        if not is_checksum(checksum, algorithm):
            raise CorruptManifestError(
                f"{source}: checksum {_short(checksum)} is not a {_short(algorithm)} hex digest; the manifest is "
                "corrupt; do not restore from it, use another checkpoint", reason="malformed checksum")
        try:
            actual = manifest_checksum(data, algorithm)
        except ValueError as exc:  # NaN or an infinite number (which json.loads accepts)
            raise CorruptManifestError(
                f"{source}: holds a number JSON does not allow ({str(exc)[:100]}); the manifest is corrupt; do not "
                "restore from it, use another checkpoint", reason="NaN or infinite number") from None
        if actual != checksum:
            raise CorruptManifestError(
                f"{source}: content does not match its {algorithm} checksum (recorded {checksum[:12]}..., content "
                f"{actual[:12]}...): the manifest was edited or damaged after it was written; do not restore from "
                "it, use another checkpoint", reason="checksum mismatch (edited or damaged)")
        return checksum, algorithm

    @classmethod
    def _from_dict_v1(cls, data: dict[str, Any], *, tables: bool = False) -> "Manifest":
        reader = RefReader(data["files"], data["ranges"]) if tables else None

        def refs_of(items: Any, section: str, kinds: tuple[str, ...], key_group: int | None = None) -> list[FileRef]:
            if not isinstance(items, list):
                raise ValueError(f"{section} is not a list")
            if reader is None:
                out = [FileRef.from_dict(item) for item in items]
            else:
                out = [reader.ref(item, section, key_group) for item in items]
            for ref in out:
                if ref.kind not in kinds:
                    raise ValueError(f"{section}: file {ref.path} of kind {ref.kind} does not belong there")
            return out

        def int_key(key: str, what: str) -> int:
            if not isinstance(key, str) or not key.isdigit() or len(key) > 18:
                raise ValueError(f"{what} {_short(key)} is not a non-negative integer")
            return int(key)

        cid = data["checkpoint_id"]
        if not isinstance(cid, int) or isinstance(cid, bool) or not 1 <= cid <= MAX_INT:
            raise ValueError(f"checkpoint_id {_short(cid)} is invalid")
        kind = data.get("kind", "checkpoint")
        if kind not in ("checkpoint", "savepoint"):
            raise ValueError(f"kind {_short(kind)} is not 'checkpoint' or 'savepoint'")
        max_par = data["max_parallelism"]
        if not isinstance(max_par, int) or isinstance(max_par, bool) or not 1 <= max_par <= _MAX_MAX_PARALLELISM:
            raise ValueError(f"max_parallelism {_short(max_par)} is not in 1..{_MAX_MAX_PARALLELISM}")
        created = data.get("created_at", 0.0)
        if not isinstance(created, (int, float)) or not math.isfinite(created):
            raise ValueError(f"created_at {_short(created)} is invalid")
        keyed = {
            str(op): {
                str(st): {
                    int_key(kg, "key group"): refs_of(chain, f"keyed/{op}/{st}/{kg}", KEYED_KINDS,
                                                      int_key(kg, "key group") if tables else None)
                    for kg, chain in chains.items()
                }
                for st, chains in states.items()
            }
            for op, states in data.get("keyed", {}).items()
        }
        operator_state = {
            str(op): {
                int_key(i, "subtask"): refs_of([ref], f"operator_state/{op}/{i}", ("opstate",))[0]
                for i, ref in subtasks.items()
            }
            for op, subtasks in data.get("operator_state", {}).items()
        }
        rules = data.get("operator_state_rules", {})
        if not isinstance(rules, dict) or not all(isinstance(v, str) for v in rules.values()):
            raise ValueError("operator_state_rules is not an object of strings")
        for name in ("source_offsets", "sink_transactions", "stats"):
            if not isinstance(data.get(name, {}), dict):
                raise ValueError(f"{name} is not an object")
        job_name = data["job_name"]
        if not isinstance(job_name, str):
            raise ValueError(f"job_name {_short(job_name)} is not a string")
        lineage = None if data.get("lineage") is None else Lineage.from_dict(data["lineage"])
        assignment = data.get("assignment")
        if assignment is not None:
            if (not isinstance(assignment, list) or len(assignment) != max_par
                    or not all(type(w) is int and 0 <= w < max_par for w in assignment)):
                raise ValueError(f"assignment is not a list of {max_par} subtask indexes (one per key group)")
            assignment = tuple(assignment)
        return cls(
            format_version=data["format_version"],
            checkpoint_id=CheckpointId(cid),
            kind=kind,
            job_name=job_name,
            max_parallelism=max_par,
            created_at=float(created),
            keyed=keyed,
            operator_state=operator_state,
            operator_state_rules=dict(rules),
            channel_logs=refs_of(data.get("channel_logs", []), "channel_logs", ("channel",)),
            source_offsets=data.get("source_offsets", {}),
            sink_transactions=data.get("sink_transactions", {}),
            stats=data.get("stats", {}),
            lineage=lineage,
            assignment=assignment,
        )


def _as_parsed(doc: dict[str, Any]) -> dict[str, Any]:
    """``json.loads(json.dumps(doc))``: the document as a reader parses it back. Its ``keyed``
    part, the chains by key group (the bulk of a manifest at a large max_parallelism), is
    already in that form when its operator and state names are strings (:meth:`Manifest.to_dict`
    builds the rest of it of strings, integers and lists): it is taken as is, in its place."""
    keyed = doc.get("keyed")
    if not (isinstance(keyed, dict) and all(type(op) is str and type(states) is dict and all(type(st) is str for st in states)
                                             for op, states in keyed.items())):
        return json.loads(json.dumps(doc, allow_nan=False))
    parsed = json.loads(json.dumps({**doc, "keyed": {}}, allow_nan=False))
    parsed["keyed"] = keyed
    return parsed


def chain_problems(chain: list[FileRef], *, operator: str, state: str, key_group: int,
                   max_checkpoint_id: int | None = None) -> list[tuple[str | None, str]]:
    """Structural problems of one key group's chain, as ``(path or None, message)`` pairs.

    A chain is non-empty, starts with a base, continues with deltas, never goes back in
    checkpoint ids, and every file lives in the directory of (operator, state, key_group) or is
    a range of that key group in a packed file of (operator, state).
    """
    return _chain_problems(chain, operator, state, key_group, max_checkpoint_id,
                           StoragePaths.packed_dir(operator, state) + "/")


def _chain_problems(chain: list[FileRef], operator: str, state: str, key_group: int, max_checkpoint_id: int | None,
                    packed_dir: str) -> list[tuple[str | None, str]]:
    """:func:`chain_problems` with the packed directory of (operator, state) given (a manifest's
    key groups share it); an empty list, without a message built, for a sound chain."""
    if not chain:
        return [(None, f"{operator}/{state}/kg {key_group}: empty chain")]
    expected_dir = None
    last = 0
    sound = chain[0].kind == "base"
    for i, ref in enumerate(chain):
        if ref.offset is not None:
            placed = ref.key_group == key_group and ref.path.startswith(packed_dir)
        else:
            if expected_dir is None:
                expected_dir = StoragePaths.key_group_dir(operator, state, key_group) + "/"
            placed = ref.path.startswith(expected_dir)
        cid = ref.checkpoint_id
        if not placed or (i > 0 and ref.kind != "delta") or cid < last \
                or (max_checkpoint_id is not None and cid > max_checkpoint_id):
            sound = False
            break
        last = cid
    if sound and (len(chain) == 1 or len({r.id for r in chain}) == len(chain)):
        return []
    problems: list[tuple[str | None, str]] = []
    where = f"{operator}/{state}/kg {key_group}"
    if chain[0].kind != "base":
        problems.append((chain[0].path, f"{where}: chain starts with a {chain[0].kind}, not a base"))
    expected_dir = StoragePaths.key_group_dir(operator, state, key_group) + "/"
    last = 0
    for i, ref in enumerate(chain):
        if i > 0 and ref.kind != "delta":
            problems.append((ref.id, f"{where}: position {i} is a {ref.kind}, only deltas may follow the base"))
        if not (ref.path.startswith(packed_dir) and ref.key_group == key_group if ref.packed
                else ref.path.startswith(expected_dir)):
            problems.append((ref.id, f"{where}: file belongs to another operator/state/key group"))
        if ref.checkpoint_id < last:
            problems.append((ref.id, f"{where}: checkpoint ids go backwards along the chain"))
        if max_checkpoint_id is not None and ref.checkpoint_id > max_checkpoint_id:
            problems.append((ref.id, f"{where}: file of checkpoint {ref.checkpoint_id} is newer than the manifest"))
        last = ref.checkpoint_id
    if len({r.id for r in chain}) != len(chain):
        problems.append((None, f"{where}: the same file appears twice in the chain"))
    return problems


def manifest_problems(manifest: Manifest) -> list[tuple[str | None, str]]:
    """Structural problems of a manifest (pure; no I/O): chains, key-group range, placement."""
    problems: list[tuple[str | None, str]] = []
    cid = manifest.checkpoint_id
    for op, states in manifest.keyed.items():
        for st, chains in states.items():
            packed_dir = StoragePaths.packed_dir(op, st) + "/"
            for kg, chain in chains.items():
                if not 0 <= kg < manifest.max_parallelism:
                    problems.append((None, f"{op}/{st}: key group {kg} outside [0, {manifest.max_parallelism})"))
                found = _chain_problems(chain, op, st, kg, cid, packed_dir)
                if found:
                    problems.extend(found)
    for op, subtasks in manifest.operator_state.items():
        for i, ref in subtasks.items():
            loc = ref.location()
            if loc.operator != op or loc.subtask != i:
                problems.append((ref.path, f"operator state of {op}[{i}] points at a file of {loc.operator}[{loc.subtask}]"))
            if ref.checkpoint_id > cid:
                problems.append((ref.path, f"operator state file of checkpoint {ref.checkpoint_id} is newer than the manifest"))
    for ref in manifest.channel_logs:
        if ref.checkpoint_id > cid:
            problems.append((ref.path, f"channel log of checkpoint {ref.checkpoint_id} is newer than the manifest"))
    return problems

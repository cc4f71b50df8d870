"""The one place that formats and parses storage paths (relative to a snapshot root).

Layout (see ``storage/FORMAT.md``)::

    _job.json
    checkpoints/chk-00000042.json                               manifest (commit point)
    checkpoints/.chk-00000042.json.<token>.tmp                  manifest being committed
    state/<operator>/<state>/kg-0037/00000042-delta-<token>.arrow
    state/<operator>/<state>/kg-0037/00000040-base-<token>.arrow
    state/<operator>/<state>/packed/00000042-<token>.arrow       ranges of many key groups
    opstate/<operator>/00000042-<subtask>-<token>.arrow
    channels/00000042/<task>-<token>.arrow
    ._probe.<token>                                             a driver's "can every worker see this root" probe
    pins/pin-<token>.json                                       a pin: checkpoints GC must keep
    checkpoints/.sp-00000042.incomplete                          a savepoint being copied

Checkpoint ids are zero-padded to 8 digits, key groups to 4 (wider numbers simply use more
digits). ``<token>`` is 32 lower-case hex digits (a uuid4), so two attempts never collide.

Names (operator uids, state names, task names) are encoded reversibly with
:func:`encode_name`: UTF-8 bytes outside ``[A-Za-z0-9_.-]`` become ``%XX`` (upper-case hex),
and a leading ``.`` becomes ``%2E`` (no hidden files, no ``.``/``..``).
"""
from __future__ import annotations

import functools
import re
import uuid
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

from .errors import InvalidPathError
from .ids import CheckpointId, KeyGroup, OperatorUid, StateName, SubtaskIndex

__all__ = [
    "FileKind",
    "PathCategory",
    "ParsedPath",
    "StoragePaths",
    "encode_name",
    "decode_name",
    "validate_relative_path",
    "new_token",
]

FileKind = Literal["base", "delta", "opstate", "channel"]
PathCategory = Literal["job", "commit_record", "job_tmp", "probe", "manifest", "manifest_tmp", "base", "delta", "packed", "opstate",
                       "channel", "pin", "pin_tmp", "savepoint_incomplete"]

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_MAX_SEGMENT = 255
_TOKEN = r"[0-9a-f]{32}"
_ID = r"\d{8,}"


def new_token() -> str:
    """A fresh random token for file names (uuid4 hex)."""
    return uuid.uuid4().hex


def encode_name(name: str) -> str:
    """Encode an operator uid / state name / task name as one safe path segment (reversible)."""
    if not isinstance(name, str) or not name:
        raise InvalidPathError(f"name {name!r} cannot be stored: names must be non-empty strings; rename it")
    return _encode(name)


@functools.lru_cache(maxsize=4096)  # a job has few names, encoded again for every file reference
def _encode(name: str) -> str:
    out = []
    for i, byte in enumerate(name.encode("utf-8")):
        if byte in _SAFE and not (i == 0 and byte == ord(".")):
            out.append(chr(byte))
        else:
            out.append(f"%{byte:02X}")
    segment = "".join(out)
    if len(segment) > _MAX_SEGMENT:
        raise InvalidPathError(
            f"name {name[:40]!r}... encodes to {len(segment)} characters, more than the {_MAX_SEGMENT} a path "
            "segment may have; use a shorter uid or state name"
        )
    return segment


def decode_name(segment: str) -> str:
    """Inverse of :func:`encode_name`; raises :class:`InvalidPathError` for non-canonical input."""
    try:
        name = unquote(segment, errors="strict")
    except UnicodeDecodeError as exc:
        raise InvalidPathError(f"path segment {segment!r} is not a valid encoded name") from exc
    if not name or encode_name(name) != segment:
        raise InvalidPathError(f"path segment {segment!r} is not a canonically encoded name")
    return name


def validate_relative_path(path: str) -> str:
    """Return ``path`` if it is a plain relative POSIX path inside a root, else raise."""
    if not isinstance(path, str) or not path:
        raise InvalidPathError(f"storage path {path!r} is empty or not a string; refusing it")
    return _validate_relative_path(path)


@functools.lru_cache(maxsize=1 << 16)  # a manifest names a packed file once per range of it
def _validate_relative_path(path: str) -> str:
    if path.startswith("/") or "\\" in path or ":" in path or "\x00" in path:
        raise InvalidPathError(
            f"storage path {path!r} is absolute, has a scheme, a backslash or a NUL; "
            "only paths relative to the root are allowed; refusing it"
        )
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise InvalidPathError(
                f"storage path {path!r} has an empty, '.' or '..' segment and could point outside the root; refusing it"
            )
    return path


@dataclass(frozen=True)
class ParsedPath:
    """What a storage path denotes; fields that do not apply are ``None``."""

    category: PathCategory
    checkpoint_id: CheckpointId | None = None
    operator: OperatorUid | None = None
    state: StateName | None = None
    key_group: KeyGroup | None = None
    subtask: SubtaskIndex | None = None
    task: str | None = None


_MANIFEST_RE = re.compile(rf"^checkpoints/chk-({_ID})\.json$")
_MANIFEST_TMP_RE = re.compile(rf"^checkpoints/\.chk-({_ID})\.json\.{_TOKEN}\.tmp$")
_JOB_TMP_RE = re.compile(rf"^\._job\.json\.{_TOKEN}\.tmp$")
_PROBE_RE = re.compile(rf"^\._probe\.{_TOKEN}$")
_STATE_RE = re.compile(rf"^state/([^/]+)/([^/]+)/kg-(\d{{4,}})/({_ID})-(base|delta)-{_TOKEN}\.arrow$")
_PACKED_RE = re.compile(rf"^state/([^/]+)/([^/]+)/packed/({_ID})-{_TOKEN}\.arrow$")
_OPSTATE_RE = re.compile(rf"^opstate/([^/]+)/({_ID})-(\d+)-{_TOKEN}\.arrow$")
_CHANNEL_RE = re.compile(rf"^channels/({_ID})/([^/]+)-{_TOKEN}\.arrow$")
_PIN_RE = re.compile(rf"^pins/pin-{_TOKEN}\.json$")
_PIN_TMP_RE = re.compile(rf"^pins/\.pin-{_TOKEN}\.json\.{_TOKEN}\.tmp$")
_INCOMPLETE_RE = re.compile(rf"^checkpoints/\.sp-({_ID})\.incomplete$")


class StoragePaths:
    """Formats and parses every path in a snapshot root. All paths are relative POSIX paths."""

    JOB = "_job.json"
    COMMIT_RECORD = "_committed.json"
    """The newest checkpoint whose completion sinks were told of (see
    ``SnapshotStore.record_committed``); overwritten per checkpoint; GC keeps it like ``_job.json``."""
    CHECKPOINTS_DIR = "checkpoints"
    STATE_DIR = "state"
    OPSTATE_DIR = "opstate"
    CHANNELS_DIR = "channels"
    PINS_DIR = "pins"

    @staticmethod
    def _cid(checkpoint_id: int) -> str:
        if not isinstance(checkpoint_id, int) or isinstance(checkpoint_id, bool) or checkpoint_id < 1:
            raise InvalidPathError(f"checkpoint id {checkpoint_id!r} is invalid: ids are integers >= 1")
        return f"{checkpoint_id:08d}"

    @classmethod
    def job_temp(cls, token: str | None = None) -> str:
        return f".{cls.JOB}.{token or new_token()}.tmp"

    @staticmethod
    def probe(token: str) -> str:
        """The probe file a driver writes at start and every worker reads (same root?)."""
        return f"._probe.{token}"

    @classmethod
    def manifest(cls, checkpoint_id: int) -> str:
        return f"{cls.CHECKPOINTS_DIR}/chk-{cls._cid(checkpoint_id)}.json"

    @classmethod
    def manifest_temp(cls, checkpoint_id: int, token: str | None = None) -> str:
        return f"{cls.CHECKPOINTS_DIR}/.chk-{cls._cid(checkpoint_id)}.json.{token or new_token()}.tmp"

    @classmethod
    def key_group_dir(cls, operator: str, state: str, key_group: int) -> str:
        if not isinstance(key_group, int) or key_group < 0:
            raise InvalidPathError(f"key group {key_group!r} is invalid: key groups are integers >= 0")
        return f"{cls.STATE_DIR}/{encode_name(operator)}/{encode_name(state)}/kg-{key_group:04d}"

    @classmethod
    def state_file(
        cls, checkpoint_id: int, operator: str, state: str, key_group: int, kind: Literal["base", "delta"],
        token: str | None = None,
    ) -> str:
        if kind not in ("base", "delta"):
            raise InvalidPathError(f"state file kind {kind!r} is invalid: use 'base' or 'delta'")
        return f"{cls.key_group_dir(operator, state, key_group)}/{cls._cid(checkpoint_id)}-{kind}-{token or new_token()}.arrow"

    @classmethod
    def packed_dir(cls, operator: str, state: str) -> str:
        return f"{cls.STATE_DIR}/{encode_name(operator)}/{encode_name(state)}/packed"

    @classmethod
    def packed_file(cls, checkpoint_id: int, operator: str, state: str, token: str | None = None) -> str:
        """A file holding the files of several key groups of one state back to back."""
        return f"{cls.packed_dir(operator, state)}/{cls._cid(checkpoint_id)}-{token or new_token()}.arrow"

    @staticmethod
    def range_id(path: str, key_group: int) -> str:
        """How a key group's range of a packed file is named in messages and listings."""
        return f"{path}#kg-{key_group:04d}"

    @classmethod
    def opstate_file(cls, checkpoint_id: int, operator: str, subtask: int, token: str | None = None) -> str:
        if not isinstance(subtask, int) or subtask < 0:
            raise InvalidPathError(f"subtask {subtask!r} is invalid: subtask indexes are integers >= 0")
        return f"{cls.OPSTATE_DIR}/{encode_name(operator)}/{cls._cid(checkpoint_id)}-{subtask}-{token or new_token()}.arrow"

    @classmethod
    def channel_file(cls, checkpoint_id: int, task: str, token: str | None = None) -> str:
        return f"{cls.CHANNELS_DIR}/{cls._cid(checkpoint_id)}/{encode_name(task)}-{token or new_token()}.arrow"

    @classmethod
    def pin(cls, token: str) -> str:
        """A pin (see ``storage/pins.py``); ``token`` names it."""
        return f"{cls.PINS_DIR}/pin-{token}.json"

    @classmethod
    def pin_temp(cls, token: str) -> str:
        return f"{cls.PINS_DIR}/.pin-{token}.json.{new_token()}.tmp"

    @classmethod
    def savepoint_incomplete(cls, checkpoint_id: int) -> str:
        """The marker of a savepoint being copied into a root under ``checkpoint_id``; it is
        deleted after the savepoint's manifest is committed."""
        return f"{cls.CHECKPOINTS_DIR}/.sp-{cls._cid(checkpoint_id)}.incomplete"

    @staticmethod
    def parse(path: str) -> ParsedPath | None:
        """Parse a relative path; ``None`` when it is not a file this format writes."""
        return _parse(path)


@functools.lru_cache(maxsize=1 << 16)  # paths of a manifest are parsed on load and again on read
def _parse(path: str) -> ParsedPath | None:
    if path == StoragePaths.JOB:
        return ParsedPath("job")
    if path == StoragePaths.COMMIT_RECORD:
        return ParsedPath("commit_record")
    if _JOB_TMP_RE.match(path):
        return ParsedPath("job_tmp")
    if _PROBE_RE.match(path):
        return ParsedPath("probe")
    try:
        if m := _MANIFEST_RE.match(path):
            return ParsedPath("manifest", CheckpointId(int(m[1])))
        if m := _MANIFEST_TMP_RE.match(path):
            return ParsedPath("manifest_tmp", CheckpointId(int(m[1])))
        if m := _STATE_RE.match(path):
            return ParsedPath(
                m[5],  # type: ignore[arg-type]
                CheckpointId(int(m[4])),
                operator=OperatorUid(decode_name(m[1])),
                state=StateName(decode_name(m[2])),
                key_group=KeyGroup(int(m[3])),
            )
        if m := _PACKED_RE.match(path):
            return ParsedPath(
                "packed", CheckpointId(int(m[3])), operator=OperatorUid(decode_name(m[1])),
                state=StateName(decode_name(m[2])),
            )
        if m := _OPSTATE_RE.match(path):
            return ParsedPath(
                "opstate", CheckpointId(int(m[2])), operator=OperatorUid(decode_name(m[1])),
                subtask=SubtaskIndex(int(m[3])),
            )
        if m := _CHANNEL_RE.match(path):
            return ParsedPath("channel", CheckpointId(int(m[1])), task=decode_name(m[2]))
        if _PIN_RE.match(path):
            return ParsedPath("pin")
        if _PIN_TMP_RE.match(path):
            return ParsedPath("pin_tmp")
        if m := _INCOMPLETE_RE.match(path):
            return ParsedPath("savepoint_incomplete", CheckpointId(int(m[1])))
    except InvalidPathError:
        return None
    return None

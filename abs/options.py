"""Typed options of :func:`abs.run` and :func:`abs.submit`.

:class:`Restore` says what a job restores (``restore=``); the strings, ids and paths that
``restore=`` took before keep working and turn into one with :meth:`Restore.parse`.
:class:`RuntimeOptions` holds the knobs of the runtime itself that tests and drills turn
(``runtime=``): failure injection and the timeouts of worker supervision.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Union

from .errors import ConfigError

__all__ = ["Restore", "RestoreValue", "RESTORE_KEYWORDS", "RuntimeOptions"]

# restore= values that are words, not savepoint paths
RESTORE_KEYWORDS = ("latest", "latest-if-any", "fresh")

RestoreKind = Literal["none", "latest", "latest-if-any", "fresh", "checkpoint", "savepoint"]

_EXPECTED = "None, 'latest', 'latest-if-any', 'fresh', a checkpoint id or a savepoint path"


@dataclass(frozen=True)
class Restore:
    """What a job restores. Build one with a constructor:

    - :meth:`none`: empty state; refused when the storage root already holds checkpoints of
      the job (what ``restore=None`` means);
    - :meth:`latest`: the newest checkpoint that can be restored, walking back past broken
      ones; refused when there is none;
    - :meth:`latest_if_any`: the same, or a fresh start when the root holds no checkpoint;
    - :meth:`fresh`: empty state on purpose; new checkpoint ids continue above the existing ones;
    - :meth:`checkpoint`: exactly checkpoint ``id`` of the job's storage root;
    - :meth:`savepoint`: the savepoint at ``path`` (a path or fsspec URL);

    or from any value ``restore=`` takes with :meth:`parse`.
    """

    kind: RestoreKind
    checkpoint_id: int | None = None
    path: str | None = None

    def __post_init__(self) -> None:  # a Restore(...) built by hand obeys the constructors' rules
        if self.kind in ("none", *RESTORE_KEYWORDS):
            if self.checkpoint_id is not None or self.path is not None:
                raise ConfigError(f"Restore(kind={self.kind!r}) takes neither a checkpoint id nor a path; "
                                  f"use Restore.{self.kind.replace('-', '_')}()")
        elif self.kind == "checkpoint":
            if self.checkpoint_id is None:
                raise ConfigError("Restore(kind='checkpoint') needs a checkpoint id; use Restore.checkpoint(id)")
            _check_id(self.checkpoint_id)
            if self.path is not None:
                raise ConfigError("Restore(kind='checkpoint') takes no path; use Restore.checkpoint(id)")
        elif self.kind == "savepoint":
            if self.path is None:
                raise ConfigError("Restore(kind='savepoint') needs a path; use Restore.savepoint(path)")
            _check_path(self.path)
            if self.checkpoint_id is not None:
                raise ConfigError("Restore(kind='savepoint') takes no checkpoint id; use Restore.savepoint(path)")
        else:
            raise ConfigError(f"Restore kind {self.kind!r} is unknown; use one of the Restore constructors "
                              "(Restore.latest(), .latest_if_any(), .fresh(), .none(), .checkpoint(id), .savepoint(path))")

    @classmethod
    def none(cls) -> "Restore":
        return cls("none")

    @classmethod
    def latest(cls) -> "Restore":
        return cls("latest")

    @classmethod
    def latest_if_any(cls) -> "Restore":
        return cls("latest-if-any")

    @classmethod
    def fresh(cls) -> "Restore":
        return cls("fresh")

    @classmethod
    def checkpoint(cls, checkpoint_id: int) -> "Restore":
        return cls("checkpoint", checkpoint_id=checkpoint_id)

    @classmethod
    def savepoint(cls, path: str) -> "Restore":
        return cls("savepoint", path=path)

    @classmethod
    def parse(cls, value: Any) -> "Restore":
        """A :class:`Restore` from any value ``restore=`` takes: ``None``, ``"latest"``,
        ``"latest-if-any"``, ``"fresh"``, a checkpoint id (int >= 1), a savepoint path, or a
        :class:`Restore` (returned as is). Anything else raises :class:`abs.ConfigError`."""
        if isinstance(value, Restore):
            return value
        if value is None:
            return cls.none()
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"restore must be {_EXPECTED}, got {value!r}")
        if isinstance(value, int):
            return cls.checkpoint(value)
        if value in RESTORE_KEYWORDS:
            return cls(value)  # type: ignore[arg-type]
        return cls.savepoint(value)

    @property
    def value(self) -> None | int | str:
        """The plain value of ``restore=`` this stands for (``None``, a keyword, an id or a
        path): what the runtime takes; ``Restore.parse(r.value) == r``."""
        if self.kind == "none":
            return None
        if self.kind == "checkpoint":
            return self.checkpoint_id
        if self.kind == "savepoint":
            return self.path
        return self.kind

    def __str__(self) -> str:
        return f"restore={self.value!r}"


RestoreValue = Union[Restore, None, int, str]


def _check_id(checkpoint_id: Any) -> None:
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise ConfigError(f"restore must be {_EXPECTED}, got {checkpoint_id!r}")
    if checkpoint_id < 1:
        raise ConfigError(
            f"restore={checkpoint_id!r}: checkpoint ids are integers >= 1; pass one 'abs-snapshot ls ROOT' lists")


def _check_path(path: Any) -> None:
    if not isinstance(path, str):
        raise ConfigError(f"restore must be {_EXPECTED}, got {path!r}")
    if not path:
        raise ConfigError(f"restore='': pass {_EXPECTED.replace('None, ', '')}")
    if path in RESTORE_KEYWORDS:
        raise ConfigError(
            f"Restore.savepoint({path!r}): {path!r} is a restore keyword, not a path; pass './{path}' for a "
            f"savepoint in a directory of that name, or Restore.{path.replace('-', '_')}()")


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime supervises a job's workers; passed as ``abs.run(..., runtime=...)``.

    ``heartbeat_timeout``: seconds of silence after which a worker (running or still
    starting) counts as hung. ``startup_timeout``: seconds a worker may take to start and
    restore. ``faults``: failure injection for tests and drills, :class:`abs.faults.Fault`
    objects or ``(point, task, nth[, attempt[, action]])`` tuples: the worker running
    ``task`` (``"task<t>#<subtask>"`` or ``"*"``) kills itself hard at the ``nth`` hit of
    ``point``. ``progress``: how a restore's progress is shown: ``None`` (default) draws a
    bar on stderr when it is a terminal, ``False`` never, or a callable that receives
    :class:`abscore.progress.ProgressEvent` values (stage ``"restore"``, bytes read of the
    bytes the restore plan assigned, summed over the workers).
    """

    heartbeat_timeout: float = 30.0
    startup_timeout: float = 120.0
    faults: Iterable[Any] = ()
    progress: Any = None

    def __post_init__(self) -> None:
        for name in ("heartbeat_timeout", "startup_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"RuntimeOptions({name}={value!r}): expected a number of seconds > 0; "
                                  f"pass e.g. {name}={getattr(RuntimeOptions, name)}")
        if isinstance(self.faults, (str, bytes)) or not isinstance(self.faults, Iterable):
            raise ConfigError(f"RuntimeOptions(faults={self.faults!r}): expected a sequence of abs.faults.Fault "
                              "objects or (point, task, nth) tuples; pass faults=() for none")
        if not (self.progress is None or self.progress is False or callable(self.progress)):
            raise ConfigError(f"RuntimeOptions(progress={self.progress!r}): expected None (bars on a terminal), "
                              "False (none) or a callable taking abscore.progress.ProgressEvent")
        from .faults import normalize_faults

        try:
            faults = normalize_faults(self.faults)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"RuntimeOptions(faults={self.faults!r}): {exc}; pass abs.faults.Fault objects or "
                              "(point, task, nth[, attempt[, action]]) tuples") from exc
        object.__setattr__(self, "faults", faults)  # a tuple of Fault: frozen, hashable, comparable

"""What a job restores, and what its sinks must undo first.

The ``restore=`` option of :func:`abs.run`:

``None``
    Start from empty state. Refused when the storage root already holds checkpoints of this
    job (new checkpoints would continue their ids and a later ``"latest"`` would mix runs).
``"latest"``
    The newest checkpoint that can be restored, walking back past broken ones (each skip is
    logged with its reason and listed in ``JobResult.skipped_checkpoints``). Refused when the
    root holds no checkpoint at all.
``"latest-if-any"``
    As ``"latest"`` when the root holds a checkpoint, else a fresh start (logged).
``"fresh"``
    Start from empty state on purpose in a root that may hold checkpoints; new checkpoint ids
    continue above the existing ones (logged).
a checkpoint id, a savepoint path
    Exactly that checkpoint.

Output committed after the checkpoint restored
    Sinks publish a checkpoint's output once its manifest is committed. Restoring checkpoint
    ``c`` replays every record after ``c``: output that checkpoints above ``c`` committed would
    appear twice. What the driver knows of such checkpoints (:func:`committed_evidence`):
    manifest files above ``c`` (parsing or not), the root's commit record
    (``_committed.json``, written after each manifest by jobs with a sink that cannot roll back,
    so a *deleted* newest manifest is still seen), checkpoints the sinks that can roll back hold
    output of (a :class:`abs.FileSink` reads it from its file names), and checkpoints committed
    by this driver. :func:`plan_output` (pure) decides per sink: roll back (``Sink.rollback``),
    drop what this driver collected (:class:`abs.CollectSink`), or repeat — which refuses with
    :class:`abs.RepeatedOutputError` unless ``allow_repeated_output=True``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Sequence

from abscore.ids import id_ranges
from ..errors import ConfigError
from ..options import RESTORE_KEYWORDS, Restore

__all__ = [
    "RESTORE_KEYWORDS",
    "check_restore_option",
    "SinkView",
    "OutputPlan",
    "plan_output",
    "committed_evidence",
    "id_ranges",
    "savepoint_origin",
]


def check_restore_option(restore: Any, storage: str | None) -> None:
    """Refuse a ``restore=`` value that cannot work, naming what to pass instead (the value
    itself: :meth:`abs.Restore.parse`; here: what it needs of ``storage``)."""
    restore = Restore.parse(restore).value
    if restore is None:
        return
    if storage is None and (restore in RESTORE_KEYWORDS or isinstance(restore, int)):
        what = f"checkpoint {restore}" if isinstance(restore, int) else f"restore={restore!r}"
        raise ConfigError(
            f"{what} needs storage= (the path or fsspec URL of the root whose checkpoints to restore); "
            "pass storage=..., or restore=<savepoint path> to restore a savepoint"
        )


@dataclass(frozen=True)
class SinkView:
    """A sink as the plan sees it. ``kind``: ``"rollback"`` (``Sink.supports_rollback``),
    ``"collect"`` (a CollectSink: the driver holds what it collected in this process) or
    ``"none"`` (cannot take output back)."""

    uid: str
    kind: Literal["rollback", "collect", "none"]
    type_name: str = ""


@dataclass(frozen=True)
class OutputPlan:
    """What to undo before restoring checkpoint ``target`` (or starting fresh on a restart,
    ``target`` = the id before the run's first checkpoint).

    - ``rollback``: uids of sinks to call ``rollback(target)`` on;
    - ``drop_collected``: CollectSink uid -> ids whose rows this driver drops;
    - ``repeated``: sink uid -> ids whose committed output will be published again;
    - ``above``: id -> how it is known that checkpoint committed (for messages).
    """

    target: int
    rollback: tuple[str, ...] = ()
    drop_collected: dict[str, tuple[int, ...]] = field(default_factory=dict)
    repeated: dict[str, tuple[int, ...]] = field(default_factory=dict)
    above: dict[int, str] = field(default_factory=dict)
    sinks: dict[str, SinkView] = field(default_factory=dict)

    def describe(self, ids: Sequence[int]) -> str:
        """``"41-42 (42: manifest missing; 41: ...)"`` for the ids given."""
        reasons = "; ".join(f"{i}: {self.above[i]}" for i in sorted(ids, reverse=True) if i in self.above)
        return f"{id_ranges(ids)}" + (f" ({reasons})" if reasons else "")

    def refusal(self, job: str, restoring: str) -> str | None:
        """The error message when output would be repeated; ``None`` when nothing is."""
        if not self.repeated:
            return None
        parts = []
        for uid, ids in sorted(self.repeated.items()):
            view = self.sinks.get(uid)
            why = ("it is a CollectSink whose output went to an earlier process" if view and view.kind == "collect"
                   else f"{view.type_name if view else 'it'} cannot roll back (Sink.supports_rollback is False)")
            parts.append(f"sink {uid!r} already committed output of checkpoint(s) {self.describe(ids)} and {why}")
        return (
            f"job {job!r}: {restoring} would publish that output again: {'; '.join(parts)}; refusing to restore; "
            "repair the newer checkpoint or restore it (abs-snapshot verify ROOT lists what is broken), write to a "
            "sink that can roll back (e.g. abs.FileSink), or pass allow_repeated_output=True to accept the "
            "repeated output"
        )


def plan_output(
    target: int,
    above: Mapping[int, str],
    sinks: Sequence[SinkView],
    committed_here: Iterable[int] = (),
) -> OutputPlan:
    """Decide, without I/O, what each sink must undo to restore checkpoint ``target``.

    ``above``: ids known to have committed (id -> how it is known); only those above
    ``target`` count. ``committed_here``: ids this driver committed (a CollectSink holds their
    rows and can drop them; output of any other id above ``target`` went elsewhere).
    """
    ids = tuple(sorted(i for i in above if i > target))
    here = {i for i in committed_here if i > target}
    rollback: list[str] = []
    drop: dict[str, tuple[int, ...]] = {}
    repeated: dict[str, tuple[int, ...]] = {}
    for s in sinks:
        if s.kind == "rollback":
            rollback.append(s.uid)
        elif s.kind == "collect":
            if here:
                drop[s.uid] = tuple(sorted(here))
            elsewhere = tuple(i for i in ids if i not in here)
            if elsewhere:
                repeated[s.uid] = elsewhere
        elif ids:
            repeated[s.uid] = ids
    return OutputPlan(
        target=target, rollback=tuple(rollback), drop_collected=drop, repeated=repeated,
        above={i: above[i] for i in ids}, sinks={s.uid: s for s in sinks},
    )


def savepoint_origin(manifest: Any) -> int | None:
    """The id of the checkpoint a savepoint's manifest copied (its ``stats.savepoint_of``), or
    None for a checkpoint's own manifest (or a savepoint that does not record it)."""
    origin = manifest.stats.get("savepoint_of") if isinstance(manifest.stats, Mapping) else None
    cid = origin.get("checkpoint_id") if isinstance(origin, Mapping) else None
    return cid if isinstance(cid, int) and not isinstance(cid, bool) else None


def committed_evidence(
    manifest_ids: Iterable[int],
    recorded: int | None,
    sink_ids: Mapping[str, Iterable[int]],
    committed_here: Iterable[int] = (),
) -> dict[int, str]:
    """Every checkpoint id known to have committed, with how it is known (pure)."""
    out: dict[int, str] = {}
    for cid in committed_here:
        out.setdefault(cid, "committed in this run")
    for cid in manifest_ids:
        out.setdefault(cid, "its manifest exists")
    if recorded is not None:
        out.setdefault(recorded, "the root's commit record names it")
    for uid, ids in sink_ids.items():
        for cid in ids:
            out.setdefault(cid, f"sink {uid!r} holds output committed by it")
    return out

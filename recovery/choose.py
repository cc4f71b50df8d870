"""Which checkpoint to restore: the latest one whose files verify, or an explicit one.

:func:`choose_restore` walks back from the newest checkpoint and says why it skipped each
newer one (:class:`SkippedCheckpoint`); :func:`choose_checkpoint` is its older, shorter form.
A checkpoint counts as a candidate when its manifest file exists (parsing or not) or when the
caller knows it was committed (``known_committed``: e.g. the root's commit record, or a sink
that holds output committed by it): so a newest manifest that was deleted, truncated or
garbled is *skipped with a reason*, never passed over in silence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Union

from storage import CheckpointId, SnapshotStore
from storage.errors import CheckpointNotFoundError, CorruptManifestError
from storage.verify import VerifyReport

from .check import latest_intact_before
from .errors import CheckpointUnusableError, NoUsableCheckpointError, RecoveryError

__all__ = ["choose_checkpoint", "choose_restore", "RestoreChoice", "SkippedCheckpoint"]

Requested = Union[Literal["latest"], int]


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint newer than the one chosen that cannot be restored, and why (``reason``:
    e.g. ``"manifest missing (...)"``, ``"corrupt manifest (...)"``, or the first broken
    file)."""

    checkpoint_id: int
    reason: str


@dataclass(frozen=True)
class RestoreChoice:
    """What :func:`choose_restore` picked: ``checkpoint_id`` (``None``: nothing to restore,
    only with ``allow_empty``) and the newer checkpoints it skipped, newest first."""

    checkpoint_id: CheckpointId | None
    skipped: tuple[SkippedCheckpoint, ...] = ()
    url: str = ""

    @property
    def warnings(self) -> list[str]:
        """One line per skipped checkpoint, naming the next one tried."""
        out = []
        for pos, s in enumerate(self.skipped):
            if pos + 1 < len(self.skipped):
                nxt = f"trying checkpoint {self.skipped[pos + 1].checkpoint_id}"
            elif self.checkpoint_id is not None:
                nxt = f"trying checkpoint {self.checkpoint_id}"
            else:
                nxt = "no older checkpoint left"
            out.append(f"{self.url}: checkpoint {s.checkpoint_id} skipped: {s.reason}; {nxt}")
        return out


def _first_problem(report: VerifyReport) -> str:
    p = report.problems[0]
    more = f" (and {len(report.problems) - 1} more problem(s))" if len(report.problems) > 1 else ""
    return f"{'file ' + p.path + ': ' if p.path else ''}{p.message}{more}"


def choose_checkpoint(
    store: SnapshotStore,
    requested: Requested = "latest",
    *,
    verify: bool = True,
    allow_empty: bool = False,
) -> tuple[CheckpointId | None, list[str]]:
    """Pick the checkpoint to restore; returns ``(checkpoint id, warnings)``.

    ``"latest"``: the newest complete checkpoint (savepoints included) whose files verify,
    walking back past broken ones; each skipped checkpoint adds a warning naming it and its
    broken file. ``int``: exactly that checkpoint; if it does not verify,
    :class:`CheckpointUnusableError` names the broken file and the fallback (storage's
    :class:`~storage.errors.CheckpointNotFoundError` if it does not exist). ``verify=False``
    skips reading files (only manifests are read).

    When nothing is usable, :class:`NoUsableCheckpointError` names the root, except that with
    ``allow_empty=True`` a root without any complete checkpoint yields ``(None, [])`` (a fresh
    start, like Flink's "latest" with no checkpoint yet). A manifest of a newer storage format
    raises :class:`~storage.errors.UnsupportedFormatError` rather than being skipped.
    """
    if requested == "latest":
        choice = choose_restore(store, "latest", verify=verify, allow_empty=allow_empty)
        return choice.checkpoint_id, choice.warnings
    if type(requested) is not int or requested < 1:
        raise RecoveryError(
            f"{store.url}: restore={requested!r} is not 'latest' or a checkpoint id >= 1; nothing chosen; "
            "pass 'latest' or one of the ids 'abs-snapshot ls ROOT' lists"
        )
    cid = CheckpointId(requested)
    store.read_manifest(cid)  # CheckpointNotFoundError / UnsupportedFormatError / CorruptManifestError
    if not verify:
        return cid, []
    report = store.verify(cid)
    if report.ok:
        return cid, []
    fallback = latest_intact_before(store, cid)
    action = (f"restore from checkpoint {fallback} instead (its files verify)" if fallback is not None
              else "no older checkpoint verifies; restore from a savepoint")
    raise CheckpointUnusableError(
        f"{store.url}: checkpoint {cid}: {_first_problem(report)}; the checkpoint cannot be restored; {action}",
        checkpoint_id=cid, problems=report.problems, fallback=fallback,
    )


def choose_restore(
    store: SnapshotStore,
    requested: Requested = "latest",
    *,
    verify: bool = True,
    allow_empty: bool = False,
    known_committed: Mapping[int, str] | None = None,
    exclude: Mapping[int, str] | None = None,
    min_id: int | None = None,
    allow_none_usable: bool = False,
) -> RestoreChoice:
    """Pick the checkpoint to restore and say what was skipped (see :func:`choose_checkpoint`
    for ``requested``, ``verify`` and ``allow_empty``).

    For ``"latest"`` the candidates are every manifest file (parsing or not) and every id of
    ``known_committed`` (id -> how it is known, e.g. ``"the commit record names it"``), newest
    first; ids in ``exclude`` (id -> reason, e.g. a file a worker found corrupt) are skipped,
    and so are candidates below ``min_id``. A candidate without a manifest is skipped as
    "manifest missing", one whose manifest does not parse as such, one whose files do not
    verify with its first problem. ``allow_empty`` yields ``checkpoint_id=None`` only when
    there is no candidate at all: a root whose checkpoints are all broken raises
    :class:`NoUsableCheckpointError`, unless ``allow_none_usable`` (then ``None`` with every
    candidate in ``skipped``).
    """
    if requested != "latest":
        cid, _ = choose_checkpoint(store, requested, verify=verify)
        return RestoreChoice(cid, (), store.url)
    known = dict(known_committed or {})
    excluded = dict(exclude or {})
    files = set(store.manifest_ids())
    candidates = sorted((c for c in files | set(known) | set(excluded) if c >= 1), reverse=True)
    if min_id is not None:
        candidates = [c for c in candidates if c >= min_id]
    skipped: list[SkippedCheckpoint] = []
    for cid in candidates:
        reason = _why_unusable(store, cid, cid in files, known.get(cid), excluded.get(cid), verify=verify)
        if reason is None:
            return RestoreChoice(CheckpointId(cid), tuple(skipped), store.url)
        skipped.append(SkippedCheckpoint(cid, reason))
    choice = RestoreChoice(None, tuple(skipped), store.url)
    if allow_none_usable and (candidates or allow_empty):
        return choice
    if not candidates:
        if allow_empty:
            return choice
        raise NoUsableCheckpointError(
            f"{store.url}: holds no complete checkpoint (no manifest under checkpoints/); nothing to restore; "
            "check the root URL, restore from a savepoint elsewhere, or start without restoring"
        )
    raise NoUsableCheckpointError(
        f"{store.url}: none of the {len(candidates)} complete checkpoint(s) {sorted(candidates)[-10:]} can be restored "
        f"({'; '.join(choice.warnings[-3:])}); nothing usable to restore; restore from a savepoint elsewhere, "
        "or start without restoring"
    )


def _why_unusable(store: SnapshotStore, cid: int, has_manifest: bool, known: str | None, excluded: str | None,
                  *, verify: bool) -> str | None:
    """Why checkpoint ``cid`` cannot be restored, or ``None`` when it can."""
    if excluded is not None:
        return excluded
    if not has_manifest:
        return f"manifest missing ({known})" if known else "manifest missing"
    try:
        store.read_manifest(cid)  # a newer format (UnsupportedFormatError) raises instead of being skipped
    except CorruptManifestError as exc:
        short = exc.reason if "manifest" in exc.reason else f"manifest {exc.reason}"
        return f"{short} ({exc})"
    except CheckpointNotFoundError:
        return f"manifest missing ({known})" if known else "manifest missing (deleted while reading)"
    if not verify:
        return None
    report = store.verify(cid)
    return None if report.ok else _first_problem(report)

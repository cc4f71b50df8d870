"""Which checkpoint to restore: the latest one whose files verify, or an explicit one."""
from __future__ import annotations

from typing import Literal, Union

from storage import CheckpointId, SnapshotStore
from storage.verify import VerifyReport

from .check import latest_intact_before
from .errors import CheckpointUnusableError, NoUsableCheckpointError, RecoveryError

__all__ = ["choose_checkpoint"]

Requested = Union[Literal["latest"], int]


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
        return _latest(store, verify=verify, allow_empty=allow_empty)
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


def _latest(store: SnapshotStore, *, verify: bool, allow_empty: bool) -> tuple[CheckpointId | None, list[str]]:
    ids = store.list_checkpoints()
    if not ids:
        if allow_empty:
            return None, []
        raise NoUsableCheckpointError(
            f"{store.url}: holds no complete checkpoint (no manifest under checkpoints/ parses); nothing to restore; "
            "check the root URL, restore from a savepoint elsewhere, or start without restoring"
        )
    if not verify:
        store.read_manifest(ids[-1])  # a newer format raises here instead of being restored blindly
        return ids[-1], []
    warnings: list[str] = []
    for pos in range(len(ids) - 1, -1, -1):
        cid = ids[pos]
        store.read_manifest(cid)
        report = store.verify(cid)
        if report.ok:
            return cid, warnings
        nxt = f"trying checkpoint {ids[pos - 1]}" if pos > 0 else "no older checkpoint left"
        warnings.append(f"{store.url}: checkpoint {cid} skipped: {_first_problem(report)}; {nxt}")
    raise NoUsableCheckpointError(
        f"{store.url}: none of the {len(ids)} complete checkpoint(s) {list(ids)[-10:]} verifies "
        f"({'; '.join(warnings[-3:])}); nothing usable to restore; restore from a savepoint elsewhere, "
        "or start without restoring"
    )

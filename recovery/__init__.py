"""Recovery and rescaling: restore plans, key-group reassignment into a new parallelism,
operator-state redistribution, compatibility checks and the choice of the checkpoint to
restore. Depends on ``storage`` and the floor ``abscore`` only (never on ``abs``).

Pure planning first, I/O second:

- :func:`plan_restore` (pure): manifest + job fingerprint + parallelism -> :class:`RestorePlan`.
- :func:`check_manifest` (pure) / :func:`check` (reads the store, verifies files):
  -> :class:`CompatibilityReport`.
- :func:`choose_checkpoint` / :func:`choose_restore` (read the store): the newest checkpoint whose
  files verify, and why each newer one was skipped.

A restore, as the runtime's driver does it::

    cid, warnings = choose_checkpoint(store, "latest", allow_empty=True)
    manifest = store.read_manifest(cid)
    check(flow.fingerprint(), store, checkpoint_id=cid, parallelism=P, verify_files=False).raise_if_fatal()
    plan = plan_restore(manifest, flow.fingerprint(), P, source_splits={uid: src.splits(), ...})

Offline rewrites (not imported here): :mod:`recovery.spark` compacts a checkpoint into a
savepoint or re-keys it into a new ``max_parallelism`` on Spark; :mod:`recovery.rewrite` holds
their engine-independent core and an in-process re-key. The re-key hashes keys with
:mod:`abscore.keygroups`, the key-group math the runtime uses too.
"""
from __future__ import annotations

from abscore.logs import package_logger as _package_logger

_package_logger("recovery")  # warnings and notices reach stderr unless the application routes logging itself

from abscore.keygroups import KeyGroupRange, key_group_range, routing_table, subtask_for_key_group

from . import errors
from .check import check, check_manifest, latest_intact_before
from .choose import RestoreChoice, SkippedCheckpoint, choose_checkpoint, choose_restore
from .errors import (
    CheckpointUnusableError,
    FingerprintFormatError,
    IncompatibleSnapshotError,
    NoUsableCheckpointError,
    ParallelismError,
    RecoveryError,
)
from .fingerprint import JobFingerprint, OperatorFingerprint
from .plan import RestorePlan, SubtaskPlan, plan_restore
from .report import CompatibilityReport, Problem

__all__ = [
    "plan_restore",
    "RestorePlan",
    "SubtaskPlan",
    "check",
    "check_manifest",
    "CompatibilityReport",
    "Problem",
    "choose_checkpoint",
    "choose_restore",
    "RestoreChoice",
    "SkippedCheckpoint",
    "latest_intact_before",
    "JobFingerprint",
    "OperatorFingerprint",
    "KeyGroupRange",
    "key_group_range",
    "subtask_for_key_group",
    "routing_table",
    "errors",
    "RecoveryError",
    "IncompatibleSnapshotError",
    "CheckpointUnusableError",
    "NoUsableCheckpointError",
    "FingerprintFormatError",
    "ParallelismError",
]

"""Compatibility checks: can this job be restored from this snapshot, at this parallelism?

:func:`check_manifest` is pure (a job fingerprint and a manifest in, a report out);
:func:`check` adds the I/O: it reads the manifest and ``_job.json`` from a store, verifies
the checkpoint's files and, when they are broken, names the newest older checkpoint that
verifies.

Problem kinds (``Problem.kind``), and whether they are fatal:

- ``unknown_operator`` [1]: the snapshot holds state of a uid the job does not have.
- ``operator_kind`` [1]: source offsets / sink transactions under a uid that is no longer a
  source / sink.
- ``undeclared_state`` [1]: a keyed state name the operator no longer declares.
- ``state_kind`` [2]: state declared with another kind (value / list / map / reducing).
- ``state_type`` [2]: state declared with another Arrow type.
- ``reduce_fn`` (warning): a reducing state's function changed; the values restore as stored.
- ``max_parallelism`` (fatal): the snapshot's number of key groups differs from the job's.
- ``parallelism`` (fatal): parallelism < 1 or > max_parallelism.
- ``format_version`` (fatal): written by a newer storage format than this toolkit reads.
- ``operator_state_rule`` (fatal): operator state without a known redistribution rule.
- ``source_offsets`` / ``sink_transactions`` (fatal): malformed content in the manifest.
- ``file`` (fatal): a file of the checkpoint is missing, torn or corrupt (or a chain is
  malformed); the report names ``fallback_checkpoint``.
- ``manifest`` (fatal): no such checkpoint, or its manifest / ``_job.json`` is corrupt.
- ``job_name`` (warning): the snapshot was taken by a job of another name; fatal with
  ``storage_root=True`` (``abs-snapshot check``) when the root belongs to a job of another
  name, which ``abs.run(..., storage=ROOT)`` refuses (``JobMismatchError``).
- ``unverified_types`` (warning): ``_job.json`` records no state descriptors, so kinds and
  types were not compared.

[1] fatal unless ``allow_non_restored_state=True`` (the content is then dropped, a warning).
[2] fatal when the checkpoint holds data of that state; otherwise a warning.

Known limit: ``_job.json`` is written once, by the first job that used the root; state
descriptors are compared with that first job's declarations.
"""
from __future__ import annotations

from typing import Any, Mapping

from storage import FORMAT_VERSION, Manifest, SnapshotStore
from storage.errors import CheckpointNotFoundError, CorruptManifestError, UnsupportedFormatError

from ._content import OPERATOR_STATE_RULES, select, sink_transactions_in_order, source_offsets_of
from .fingerprint import JobFingerprint, descriptor_types
from .report import CompatibilityReport, Problem

__all__ = ["Problem", "CompatibilityReport", "check", "check_manifest", "latest_intact_before"]

_DROP_HINT = "pass allow_non_restored_state=True (--allow-non-restored-state) to drop it"


# ====================================================================== pure check
def check_manifest(
    fingerprint: Mapping[str, Any] | JobFingerprint | None,
    manifest: Manifest,
    *,
    parallelism: int | None = None,
    allow_non_restored_state: bool = False,
    snapshot_fingerprint: Mapping[str, Any] | JobFingerprint | None = None,
    root: str | None = None,
    storage_root: bool = False,
) -> CompatibilityReport:
    """Check a job against a manifest without any I/O.

    ``fingerprint``: the job's (``Dataflow.fingerprint()``); ``None`` checks the snapshot on
    its own (versions, ``max_parallelism`` against ``snapshot_fingerprint``, parallelism
    bounds, manifest content). ``snapshot_fingerprint``: the snapshot root's ``_job.json``,
    needed to compare state kinds and types. ``storage_root``: the job would run on this root
    (``abs.run(..., storage=ROOT)``), which refuses a root of another job's name: that is
    then fatal; otherwise (restored from as a savepoint path into a root of the job's own)
    another name is a warning.
    """
    cid = manifest.checkpoint_id
    job = None if fingerprint is None else JobFingerprint.parse(fingerprint, source="job fingerprint")
    snap = None
    if snapshot_fingerprint is not None:
        snap = JobFingerprint.parse(snapshot_fingerprint, source="_job.json", strict=False)
    problems: list[Problem] = []
    problems += _version_problems(cid, manifest, snap)
    problems += _parallelism_problems(cid, manifest, job, snap, parallelism)
    owner = snap.name if snap is not None and snap.name is not None else manifest.job_name
    if storage_root and job is not None and job.name is not None and job.name != owner:
        problems.append(Problem(
            "job_name", owner,
            f"checkpoint {cid}: this storage root belongs to job {owner!r}, this job is {job.name!r}; abs.run(..., "
            "storage=ROOT) refuses a root of another job (JobMismatchError); run the job as "
            f"{owner!r}, or restore from this root as a savepoint (restore=ROOT) with a storage root of the job's own, "
            "which restores it (state is matched by operator uid); check that this is the snapshot you meant",
            True,
        ))
    elif job is not None and job.name is not None and job.name != manifest.job_name:
        problems.append(Problem(
            "job_name", manifest.job_name,
            f"checkpoint {cid} was taken by job {manifest.job_name!r}, this job is {job.name!r}; restoring anyway "
            "(state is matched by operator uid); check that this is the snapshot you meant",
            False,
        ))
    selection = select(job, manifest)
    problems += _dropped_problems(cid, selection, allow_non_restored_state)
    if job is not None and job.operators is not None:
        problems += _descriptor_problems(cid, manifest, job, snap)
    problems += _content_problems(cid, manifest, selection)
    return CompatibilityReport(checkpoint_id=cid, parallelism=parallelism, problems=tuple(problems), root=root)


def _version_problems(cid: int, manifest: Manifest, snap: JobFingerprint | None) -> list[Problem]:
    out = []
    if manifest.format_version > FORMAT_VERSION:
        out.append(Problem(
            "format_version", f"checkpoint {cid}",
            f"checkpoint {cid} was written with storage format version {manifest.format_version}, this toolkit "
            f"reads up to {FORMAT_VERSION}; cannot restore it; upgrade to a release that reads format version "
            f"{manifest.format_version}",
            True,
        ))
    if snap is not None and snap.format_version is not None and snap.format_version > FORMAT_VERSION:
        out.append(Problem(
            "format_version", "_job.json",
            f"_job.json has storage format version {snap.format_version}, this toolkit reads up to {FORMAT_VERSION}; "
            f"cannot restore; upgrade to a release that reads format version {snap.format_version}",
            True,
        ))
    return out


def _parallelism_problems(cid: int, manifest: Manifest, job: JobFingerprint | None, snap: JobFingerprint | None,
                          parallelism: int | None) -> list[Problem]:
    out = []
    m = manifest.max_parallelism
    if job is not None and job.max_parallelism != m:
        out.append(Problem(
            "max_parallelism", f"checkpoint {cid}",
            f"checkpoint {cid} was taken with max_parallelism {m} (its number of key groups), the job declares "
            f"{job.max_parallelism}; key groups cannot be split or merged on restore; keep max_parallelism={m} in the "
            f"job, or re-key the snapshot offline into max_parallelism {job.max_parallelism} (a full rewrite: "
            f"abs-snapshot rekey ROOT {cid} DEST --max-parallelism {job.max_parallelism} [--spark], then restore from DEST)",
            True,
        ))
    if snap is not None and snap.max_parallelism is not None and snap.max_parallelism != m:
        out.append(Problem(
            "max_parallelism", "_job.json",
            f"checkpoint {cid} has max_parallelism {m} but the root's _job.json says {snap.max_parallelism}; "
            "the root mixes jobs and cannot be trusted; restore from a savepoint in a root of its own",
            True,
        ))
    if parallelism is not None:
        if type(parallelism) is not int or parallelism < 1:
            out.append(Problem(
                "parallelism", f"parallelism {parallelism!r}",
                f"parallelism {parallelism!r} is invalid; use an integer >= 1", True,
            ))
        elif parallelism > m:
            out.append(Problem(
                "parallelism", f"parallelism {parallelism}",
                f"parallelism {parallelism} exceeds max_parallelism {m} of checkpoint {cid} (a subtask needs at least "
                f"one key group); lower the parallelism to at most {m}, or re-key the snapshot offline into a larger "
                f"max_parallelism (abs-snapshot rekey ROOT {cid} DEST --max-parallelism N with N >= {parallelism})",
                True,
            ))
    return out


def _dropped_problems(cid: int, selection: Any, allow: bool) -> list[Problem]:
    out = []
    for d in selection.dropped:
        verdict = "it is dropped (allow_non_restored_state=True)" if allow else "restoring would lose it"
        if d.reason == "unknown_operator":
            message = (f"checkpoint {cid}: operator uid {d.uid!r} has {d.holds} in the snapshot, but the job has no "
                       f"operator with this uid; {verdict}")
            action = (f"; restore it under the same uid {d.uid!r} (keep the operator's uid), or {_DROP_HINT}")
            subject = d.uid
        elif d.reason == "operator_kind":
            message = (f"checkpoint {cid}: operator {d.uid!r} has {d.holds} in the snapshot, but in the job it is a "
                       f"{d.job_kind} operator that cannot take them; {verdict}")
            action = f"; give the {d.job_kind} operator another uid and keep {d.uid!r} for the original, or {_DROP_HINT}"
            subject = d.uid
        else:
            message = (f"checkpoint {cid}: operator {d.uid!r} has keyed state {d.state!r} in the snapshot, but the job's "
                       f"operator {d.uid!r} does not declare it; {verdict}")
            action = f"; declare state {d.state!r} again, or {_DROP_HINT}"
            subject = f"{d.uid}/{d.state}"
        out.append(Problem(d.reason, subject, message + ("" if allow else action), not allow))
    return out


def _descriptor_problems(cid: int, manifest: Manifest, job: JobFingerprint, snap: JobFingerprint | None) -> list[Problem]:
    assert job.operators is not None
    if snap is None or snap.operators is None:
        if manifest.keyed:
            return [Problem(
                "unverified_types", "_job.json",
                f"checkpoint {cid}: the snapshot root records no state descriptors in _job.json, so state kinds and "
                "Arrow types were not compared; restoring anyway; a mismatch will fail when the state is read",
                False,
            )]
        return []
    out = []
    for uid, op in sorted(job.operators.items()):
        old_op = snap.operators.get(uid)
        if old_op is None:
            continue
        for name, desc in sorted(op.states.items()):
            old = old_op.states.get(name)
            if old is None:
                continue
            has_data = bool(manifest.keyed.get(uid, {}).get(name))
            subject = f"{uid}/{name}"
            tail = ("cannot read it as declared; declare it as before, or migrate it offline / rename the state to "
                    "start it empty" if has_data else "the checkpoint holds no data of it, so it starts empty")
            if old["kind"] != desc["kind"]:
                out.append(Problem(
                    "state_kind", subject,
                    f"checkpoint {cid}: state {name!r} of operator {uid!r} was a {old['kind']} state, the job declares a "
                    f"{desc['kind']} state; {tail}",
                    has_data,
                ))
                continue
            old_types, new_types = descriptor_types(old), descriptor_types(desc)
            if old_types != new_types:
                diff = ", ".join(f"{k} {old_types.get(k)} -> {new_types.get(k)}"
                                 for k in sorted(set(old_types) | set(new_types)) if old_types.get(k) != new_types.get(k))
                out.append(Problem(
                    "state_type", subject,
                    f"checkpoint {cid}: state {name!r} of operator {uid!r} changed its Arrow type ({diff}); {tail}",
                    has_data,
                ))
            if old.get("reduce_fn") != desc.get("reduce_fn"):
                out.append(Problem(
                    "reduce_fn", subject,
                    f"checkpoint {cid}: reducing state {name!r} of operator {uid!r} was folded with {old.get('reduce_fn')}, "
                    f"the job uses {desc.get('reduce_fn')}; restoring the stored values as they are; check that the "
                    "new function accepts them",
                    False,
                ))
    return out


def _content_problems(cid: int, manifest: Manifest, selection: Any) -> list[Problem]:
    out = []
    for uid in selection.operator_state:
        rule = manifest.operator_state_rules.get(uid)
        if rule is None:
            out.append(Problem(
                "operator_state_rule", uid,
                f"checkpoint {cid}: operator {uid!r} has operator state but no redistribution rule in the manifest; "
                f"cannot decide which subtask restores which file; the writer must record one of {OPERATOR_STATE_RULES}",
                True,
            ))
        elif rule not in OPERATOR_STATE_RULES:
            out.append(Problem(
                "operator_state_rule", uid,
                f"checkpoint {cid}: operator {uid!r} redistributes its operator state by rule {rule!r}, this toolkit "
                f"knows {OPERATOR_STATE_RULES}; cannot plan the restore; upgrade to a release that knows {rule!r}",
                True,
            ))
    for uid in selection.sources:
        try:
            source_offsets_of(manifest.source_offsets[uid])
        except ValueError as exc:
            out.append(Problem(
                "source_offsets", uid,
                f"checkpoint {cid}: source offsets of {uid!r} are malformed ({exc}); the manifest is corrupt; restore "
                "from another checkpoint",
                True,
            ))
    for uid in selection.sinks:
        try:
            sink_transactions_in_order(manifest.sink_transactions[uid])
        except ValueError as exc:
            out.append(Problem(
                "sink_transactions", uid,
                f"checkpoint {cid}: sink transactions of {uid!r} are malformed ({exc}); the manifest is corrupt; "
                "restore from another checkpoint",
                True,
            ))
    return out


# ====================================================================== with a store
def latest_intact_before(store: SnapshotStore, checkpoint_id: int | None) -> int | None:
    """The newest complete checkpoint older than ``checkpoint_id`` (any, if ``None``) whose
    manifest parses and whose files verify; ``None`` if there is none."""
    for cid in reversed(store.list_checkpoints()):
        if checkpoint_id is not None and cid >= checkpoint_id:
            continue
        if store.verify(cid).ok:
            return cid
    return None


def check(
    fingerprint: Mapping[str, Any] | JobFingerprint | None,
    manifest_or_store: Manifest | SnapshotStore,
    *,
    checkpoint_id: int | None = None,
    parallelism: int | None = None,
    allow_non_restored_state: bool = False,
    verify_files: bool = True,
    snapshot_fingerprint: Mapping[str, Any] | None = None,
    storage_root: bool = False,
) -> CompatibilityReport:
    """Check whether the job (``fingerprint``) can be restored from a checkpoint at ``parallelism``.

    ``fingerprint=None`` checks the snapshot on its own: files, format versions,
    ``max_parallelism`` against ``_job.json``, parallelism bounds, manifest content.

    With a :class:`SnapshotStore`, ``checkpoint_id`` picks the checkpoint (default: the latest
    complete one), ``_job.json`` supplies the snapshot's state descriptors, and with
    ``verify_files`` every file of the checkpoint is checked (existence, size, sha256); when
    any is broken, ``fallback_checkpoint`` names the newest older checkpoint that verifies.
    ``storage_root``: the job would run on this root (see :func:`check_manifest`).
    With a :class:`Manifest`, only the pure checks run (``snapshot_fingerprint`` may be given).
    """
    if isinstance(manifest_or_store, Manifest):
        return check_manifest(fingerprint, manifest_or_store, parallelism=parallelism,
                              allow_non_restored_state=allow_non_restored_state,
                              snapshot_fingerprint=snapshot_fingerprint, storage_root=storage_root)
    if not isinstance(manifest_or_store, SnapshotStore):
        raise TypeError(f"check expects a storage.Manifest or storage.SnapshotStore, got {type(manifest_or_store).__name__}")
    store = manifest_or_store
    early: list[Problem] = []
    snap: Any = snapshot_fingerprint
    if snap is None:
        try:
            snap = store.read_job()
        except UnsupportedFormatError as exc:
            early.append(Problem("format_version", "_job.json", str(exc), True))
        except CorruptManifestError as exc:
            early.append(Problem("manifest", "_job.json", str(exc), True))
    cid = checkpoint_id if checkpoint_id is not None else store.latest_checkpoint()
    if checkpoint_id is None:  # corrupt manifests newer than the latest checkpoint are not silently passed over
        for bad, err in store.list_manifests().items():
            if isinstance(err, CorruptManifestError) and (cid is None or bad > cid):
                early.append(Problem("manifest", f"checkpoint {bad}", f"{err}; checkpoint {bad} is skipped (a corrupt "
                                     "manifest is not a checkpoint)" + (f"; checking checkpoint {cid}" if cid else ""),
                                     False))
    if cid is None:
        early.append(Problem(
            "manifest", store.url,
            f"{store.url}: holds no complete checkpoint; nothing to restore; check the root URL, or start the job "
            "without restoring",
            True,
        ))
        return CompatibilityReport(None, parallelism, tuple(early), root=store.url)
    try:
        manifest = store.read_manifest(cid)
    except (CheckpointNotFoundError, UnsupportedFormatError, CorruptManifestError) as exc:
        kind = "format_version" if isinstance(exc, UnsupportedFormatError) else "manifest"
        early.append(Problem(kind, f"checkpoint {cid}", str(exc), True))
        fallback = None
        if not isinstance(exc, UnsupportedFormatError):
            fallback = latest_intact_before(store, cid)
        return CompatibilityReport(cid, parallelism, tuple(early), root=store.url, fallback_checkpoint=fallback)
    report = check_manifest(fingerprint, manifest, parallelism=parallelism,
                            allow_non_restored_state=allow_non_restored_state,
                            snapshot_fingerprint=snap if isinstance(snap, Mapping) else None, root=store.url,
                            storage_root=storage_root)
    problems = early + list(report.problems)
    fallback = None
    files_checked = None
    if verify_files:
        verified = store.verify(cid)
        files_checked = verified.files_checked
        if cid in verified.removed:  # not damaged: a job writing the root dropped it meanwhile
            problems.append(Problem(
                "manifest", f"checkpoint {cid}",
                f"checkpoint {cid} was removed while verifying it (deleted by a GC meanwhile, e.g. the retention of a "
                "job writing this root); it cannot be restored any more; check again (without an ID, check takes the "
                "root's newest checkpoint)",
                True,
            ))
        elif not verified.ok:
            fallback = latest_intact_before(store, cid)
            action = (f"restore from checkpoint {fallback} instead" if fallback is not None
                      else "no older checkpoint verifies; restore from a savepoint")
            for p in verified.problems:
                where = f"file {p.path}: " if p.path else ""
                problems.append(Problem(
                    "file", p.path or f"checkpoint {cid}",
                    f"checkpoint {cid}: {where}{p.message}; the checkpoint cannot be restored; {action}",
                    True,
                ))
    return CompatibilityReport(cid, parallelism, tuple(problems), root=store.url,
                               fallback_checkpoint=fallback, files_checked=files_checked)


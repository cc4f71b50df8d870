"""Compatibility checks and the choice of the checkpoint to restore, on real stores."""
from __future__ import annotations

import copy
import json
from typing import Any

import pyarrow as pa
import pytest

from recovery import (
    CheckpointUnusableError,
    CompatibilityReport,
    IncompatibleSnapshotError,
    NoUsableCheckpointError,
    Problem,
    RecoveryError,
    check,
    check_manifest,
    choose_checkpoint,
)
from storage import CheckpointNotFoundError, CompactionPolicy, Manifest, SnapshotStore, StorageError, StoragePaths
from storage.errors import UnsupportedFormatError
from storage.manifest import FORMAT_VERSION

NEWER = FORMAT_VERSION + 1

M = 8
JOB: dict[str, Any] = {
    "name": "fraud",
    "max_parallelism": M,
    "operators": [
        {"uid": "src", "kind": "source"},
        {"uid": "count", "kind": "process", "state": [
            {"kind": "value", "name": "n", "type": "int64"},
            {"kind": "value", "name": "unused", "type": "int64"},
        ]},
        {"uid": "out", "kind": "sink"},
    ],
}


def delta(keys: list[int], values: list[int], ops: list[int] | None = None) -> pa.Table:
    return pa.table({
        "key": pa.array(keys, pa.int64()),
        "value": pa.array(values, pa.int64()),
        "op": pa.array(ops if ops is not None else [0] * len(keys), pa.int8()),
    })


class Root:
    """Checkpoints 1, 2, 3 of the job: 2 adds a delta to key group 1, 3 one to key group 2."""

    def __init__(self, url: str, job: dict[str, Any] = JOB) -> None:
        self.store = SnapshotStore.open(url, policy=CompactionPolicy(max_chain_length=100, max_delta_ratio=1e9),
                                        fsync=False)
        self.store.init_job(job)
        self.chains = {kg: self.store.write_key_group(1, "count", "n", kg, [], delta([kg, kg + 100], [1, 1]))
                       for kg in range(M)}
        self.commit(1)
        self.chains[1] = self.store.write_key_group(2, "count", "n", 1, self.chains[1], delta([1], [2]))
        self.commit(2)
        self.chains[2] = self.store.write_key_group(3, "count", "n", 2, self.chains[2], delta([2], [0], [1]))
        self.commit(3)

    def commit(self, cid: int, **extra: Any) -> Manifest:
        fields: dict[str, Any] = dict(
            keyed={"count": {"n": dict(self.chains)}},
            source_offsets={"src": {"a": cid * 10, "b": cid * 20}},
            sink_transactions={"out": {"0": [{"checkpoint": cid, "subtask": 0}]}},
            stats={"parallelism": 2},
        )
        fields.update(extra)
        return self.store.commit(Manifest(checkpoint_id=cid, job_name="fraud", max_parallelism=M, **fields))

    def damage(self, path: str, data: bytes | None) -> None:
        full = f"{self.store.url}/{path}"
        if data is None:
            self.store.fs.rm_file(full)
        else:
            self.store.fs.pipe_file(full, data)

    def reopen(self) -> SnapshotStore:
        """A fresh store object (no cached manifests), as a restarting job would have."""
        return SnapshotStore.open(self.store.url)


@pytest.fixture
def root(tmp_path) -> Root:
    return Root(str(tmp_path / "root"))


def with_job(**changes: Any) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job.update(changes)
    return job


def with_count_state(*states: dict[str, Any]) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["operators"][1]["state"] = list(states)
    return job


def only(report: CompatibilityReport, kind: str) -> Problem:
    found = [p for p in report.problems if p.kind == kind]
    assert len(found) == 1, report.lines()
    return found[0]


# =========================================================================== check
def test_the_same_job_restores_at_any_parallelism_up_to_max(root):
    for p in (1, 3, M):
        report = check(JOB, root.store, parallelism=p)
        assert report.ok and report.problems == (), report.lines()
        assert report.checkpoint_id == 3 and report.files_checked == M + 2
        assert report.lines() == [f"checkpoint 3 of {root.store.url} can be restored at parallelism {p}; "
                                  f"{M + 2} file(s) verified"]
    report.raise_if_fatal()


def test_removed_operator_with_state_is_fatal_unless_non_restored_state_is_allowed(root):
    job = with_job(operators=[op for op in JOB["operators"] if op["uid"] != "count"])
    problem = only(check(job, root.store, parallelism=2), "unknown_operator")
    assert problem.fatal and problem.subject == "count"
    assert "operator uid 'count' has keyed state 'n'" in problem.message
    assert "restore it under the same uid 'count'" in problem.message
    assert problem.message.endswith("pass allow_non_restored_state=True (--allow-non-restored-state) to drop it")
    allowed = check(job, root.store, parallelism=2, allow_non_restored_state=True)
    assert allowed.ok and not only(allowed, "unknown_operator").fatal
    assert "dropped (allow_non_restored_state=True)" in only(allowed, "unknown_operator").message


def test_renamed_source_and_sink_are_named(root):
    job = with_job(operators=[{"uid": "source-v2", "kind": "source"}, JOB["operators"][1],
                              {"uid": "out", "kind": "map"}])
    report = check(job, root.store, parallelism=2)
    assert only(report, "unknown_operator").subject == "src"
    assert "source offsets of 2 splits" in only(report, "unknown_operator").message
    kind = only(report, "operator_kind")
    assert kind.subject == "out" and "sink transactions" in kind.message and "map operator" in kind.message
    assert not report.ok


def test_state_dropped_from_the_declaration_is_fatal(root):
    report = check(with_count_state({"kind": "value", "name": "total", "type": "int64"}), root.store, parallelism=2)
    problem = only(report, "undeclared_state")
    assert problem.fatal and problem.subject == "count/n"
    assert "keyed state 'n'" in problem.message and "declare state 'n' again" in problem.message


def test_state_declared_with_another_kind_or_arrow_type_is_fatal(root):
    kind = only(check(with_count_state({"kind": "list", "name": "n", "element_type": "int64"},
                                       JOB["operators"][1]["state"][1]), root.store), "state_kind")
    assert kind.fatal and kind.subject == "count/n" and "was a value state" in kind.message
    typ = only(check(with_count_state({"kind": "value", "name": "n", "type": "double"},
                                      JOB["operators"][1]["state"][1]), root.store), "state_type")
    assert typ.fatal and "type int64 -> double" in typ.message


def test_type_change_of_a_state_without_data_is_only_a_warning(root):
    job = with_count_state(JOB["operators"][1]["state"][0], {"kind": "value", "name": "unused", "type": "string"})
    report = check(job, root.store, parallelism=2)
    problem = only(report, "state_type")
    assert not problem.fatal and "starts empty" in problem.message and report.ok


def test_max_parallelism_mismatch_is_fatal_and_points_at_the_offline_rekey(root):
    problem = only(check(with_job(max_parallelism=16), root.store, parallelism=2), "max_parallelism")
    assert problem.fatal and "max_parallelism 8" in problem.message and "re-key the snapshot offline" in problem.message


def test_parallelism_above_max_parallelism_is_fatal(root):
    problem = only(check(JOB, root.store, parallelism=M + 1), "parallelism")
    assert problem.fatal and f"parallelism {M + 1} exceeds max_parallelism {M}" in problem.message
    assert only(check(JOB, root.store, parallelism=0), "parallelism").fatal


def test_newer_format_version_is_fatal(root):
    manifest = root.store.read_manifest(3)
    newer = Manifest.from_dict(manifest.to_dict())
    newer.format_version = NEWER
    problem = only(check(JOB, newer), "format_version")
    assert problem.fatal and "upgrade" in problem.message
    # the same on disk: the manifest file says version 2
    path = StoragePaths.manifest(3)
    doc = json.loads(root.store.fs.cat_file(f"{root.store.url}/{path}"))
    root.damage(path, json.dumps({**doc, "format_version": NEWER}).encode())
    report = check(JOB, root.reopen(), checkpoint_id=3, parallelism=2)
    assert only(report, "format_version").fatal and f"format version {NEWER}" in only(report, "format_version").message


def test_newer_job_file_format_is_fatal(root):
    doc = json.loads(root.store.fs.cat_file(f"{root.store.url}/_job.json"))
    root.damage("_job.json", json.dumps({**doc, "format_version": NEWER}).encode())
    problem = only(check(JOB, root.reopen(), parallelism=2), "format_version")
    assert problem.fatal and problem.subject == "_job.json"


def test_corrupt_file_is_fatal_and_names_the_newest_older_checkpoint_that_verifies(root):
    broken = root.chains[2][-1]  # written by checkpoint 3
    root.damage(broken.path, b"garbage")
    report = check(JOB, root.store, parallelism=2)
    problem = only(report, "file")
    assert problem.fatal and problem.subject == broken.path
    assert f"checkpoint 3: file {broken.path}" in problem.message
    assert report.fallback_checkpoint == 2
    assert report.lines()[-1].endswith("restore from checkpoint 2 (its files verify), or fix the problems above")
    with pytest.raises(IncompatibleSnapshotError, match="restore from checkpoint 2") as info:
        report.raise_if_fatal()
    assert info.value.report is report
    # the exception is one message: the problems come after the verdict, not "above" it
    assert "above" not in str(info.value)
    assert f"or fix the problems named below: checkpoint 3: file {broken.path}" in str(info.value)
    assert check(JOB, root.store, checkpoint_id=2, parallelism=2).ok


def test_missing_file_shared_by_every_checkpoint_has_no_fallback(root):
    root.damage(root.chains[5][0].path, None)  # base of checkpoint 1, referenced by 1, 2, 3
    report = check(JOB, root.store, parallelism=2)
    assert "is missing" in only(report, "file").message
    assert report.fallback_checkpoint is None
    assert "no older checkpoint verifies; restore from a savepoint" in only(report, "file").message


def test_files_are_not_read_without_verify_files(root):
    root.damage(root.chains[2][-1].path, b"garbage")
    report = check(JOB, root.store, parallelism=2, verify_files=False)
    assert report.ok and report.files_checked is None


def test_unknown_checkpoint_and_empty_root_are_reported(root, tmp_path):
    problem = only(check(JOB, root.store, checkpoint_id=99), "manifest")
    assert problem.fatal and "checkpoint 99 does not exist" in problem.message
    empty = SnapshotStore.open(str(tmp_path / "empty"))
    report = check(JOB, empty)
    assert only(report, "manifest").fatal and "holds no complete checkpoint" in report.lines()[0]


def test_operator_state_without_a_known_rule_is_fatal(root):
    ref = root.store.write_operator_state(4, "src", 0, pa.table({"split": ["a"]}))
    root.commit(4, operator_state={"src": {0: ref}}, operator_state_rules={"src": "by-magic"})
    assert "rule 'by-magic'" in only(check(JOB, root.store, parallelism=2), "operator_state_rule").message
    root.commit(5, operator_state={"src": {0: ref}})
    assert "no redistribution rule" in only(check(JOB, root.store, parallelism=2), "operator_state_rule").message
    root.commit(6, operator_state={"src": {0: ref}}, operator_state_rules={"src": "split"})
    assert check(JOB, root.store, parallelism=2).ok


def test_malformed_sink_transactions_and_source_offsets_are_fatal(root):
    root.commit(4, sink_transactions={"out": "not-a-list"}, source_offsets={"src": ["a", "b"]})
    report = check(JOB, root.store, parallelism=2)
    assert only(report, "sink_transactions").fatal and only(report, "source_offsets").fatal


def test_other_job_name_is_a_warning(root):
    report = check(with_job(name="fraud-v2"), root.store, parallelism=2)
    assert report.ok and "taken by job 'fraud'" in only(report, "job_name").message


def test_other_job_name_is_fatal_on_the_jobs_own_storage_root(root):
    """storage_root=True: the job would run on this root, which abs.run refuses for another
    job's name; the pure check of the manifest alone agrees."""
    report = check(with_job(name="fraud-v2"), root.store, parallelism=2, storage_root=True)
    problem = only(report, "job_name")
    assert not report.ok and problem.fatal and "belongs to job 'fraud'" in problem.message
    assert "matched by operator uid" in problem.message
    manifest = root.store.read_manifest(3)
    assert only(check_manifest(with_job(name="fraud-v2"), manifest, storage_root=True), "job_name").fatal
    assert check(JOB, root.store, parallelism=2, storage_root=True).ok


def test_snapshot_without_descriptors_warns_that_types_were_not_compared(tmp_path):
    root = Root(str(tmp_path / "root"), job={"job_name": "fraud", "max_parallelism": M})
    report = check(JOB, root.store, parallelism=2)
    assert report.ok and not only(report, "unverified_types").fatal


def test_without_a_job_the_snapshot_is_checked_on_its_own(root):
    assert check(None, root.store, parallelism=M).ok
    assert only(check(None, root.store, parallelism=M + 1), "parallelism").fatal
    root.damage(root.chains[1][-1].path, None)  # written by checkpoint 2, used by 2 and 3
    report = check(None, root.store)
    assert only(report, "file").fatal and report.fallback_checkpoint == 1


def test_check_manifest_is_pure_and_lines_end_in_a_verdict(root):
    manifest = root.store.read_manifest(2)
    report = check_manifest(with_job(max_parallelism=4), manifest, parallelism=9,
                            snapshot_fingerprint=root.store.read_job())
    assert report.kinds == {"max_parallelism", "parallelism"}
    assert report.files_checked is None
    assert report.lines()[0].startswith("error [max_parallelism] checkpoint 2 was taken with max_parallelism 8")
    assert report.lines()[-1] == "checkpoint 2 cannot be restored at parallelism 9: 2 fatal problem(s); fix the problems above"
    assert isinstance(IncompatibleSnapshotError("x"), StorageError)


# =========================================================================== choose_checkpoint
def test_latest_is_the_newest_checkpoint_when_everything_verifies(root):
    assert choose_checkpoint(root.store, "latest") == (3, [])


def test_latest_falls_back_past_a_corrupt_file_and_names_it(root):
    broken = root.chains[2][-1]  # written by checkpoint 3
    root.damage(broken.path, b"x" * broken.bytes)  # right size, wrong checksum
    cid, warnings = choose_checkpoint(root.reopen(), "latest")
    assert cid == 2
    assert len(warnings) == 1
    assert "checkpoint 3 skipped" in warnings[0] and broken.path in warnings[0] and "corrupt file" in warnings[0]
    assert warnings[0].endswith("trying checkpoint 2")


def test_latest_walks_back_past_several_broken_checkpoints(root):
    lost = root.chains[1][-1]  # written by checkpoint 2, used by 2 and 3
    root.damage(lost.path, None)
    cid, warnings = choose_checkpoint(root.store, "latest")
    assert cid == 1
    assert [w.split(": ")[1] for w in warnings] == ["checkpoint 3 skipped", "checkpoint 2 skipped"]
    assert all(lost.path in w for w in warnings)


def test_explicit_checkpoint_that_does_not_verify_names_file_and_fallback(root):
    broken = root.chains[2][-1]
    root.damage(broken.path, b"garbage")
    with pytest.raises(CheckpointUnusableError) as info:
        choose_checkpoint(root.store, 3)
    err = info.value
    assert err.checkpoint_id == 3 and err.fallback == 2
    assert broken.path in str(err) and str(err).endswith("restore from checkpoint 2 instead (its files verify)")
    assert choose_checkpoint(root.store, 2) == (2, [])
    assert choose_checkpoint(root.store, 3, verify=False) == (3, [])


def test_nothing_usable_names_the_root(root):
    root.damage(root.chains[0][0].path, None)  # the base every checkpoint uses
    with pytest.raises(NoUsableCheckpointError, match=f"{root.store.url}: none of the 3 complete checkpoint"):
        choose_checkpoint(root.store, "latest")
    with pytest.raises(CheckpointUnusableError, match="no older checkpoint verifies"):
        choose_checkpoint(root.store, 2)


def test_empty_root_is_an_error_unless_a_fresh_start_is_allowed(tmp_path):
    empty = SnapshotStore.open(str(tmp_path / "empty"))
    with pytest.raises(NoUsableCheckpointError, match="holds no complete checkpoint"):
        choose_checkpoint(empty, "latest")
    assert choose_checkpoint(empty, "latest", allow_empty=True) == (None, [])


def test_bad_requests(root):
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 42 does not exist"):
        choose_checkpoint(root.store, 42)
    with pytest.raises(RecoveryError, match="not 'latest' or a checkpoint id"):
        choose_checkpoint(root.store, "newest")  # type: ignore[arg-type]


def test_latest_refuses_a_newer_format_instead_of_skipping_it(root):
    path = StoragePaths.manifest(3)
    doc = json.loads(root.store.fs.cat_file(f"{root.store.url}/{path}"))
    root.damage(path, json.dumps({**doc, "format_version": NEWER}).encode())
    with pytest.raises(UnsupportedFormatError, match=f"format version {NEWER}"):
        choose_checkpoint(root.reopen(), "latest")

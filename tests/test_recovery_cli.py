"""``abs-snapshot check``, ``rescale-preview`` and ``savepoint`` through ``main([...])``."""
from __future__ import annotations

import copy
import json
from typing import Any

import pyarrow as pa
import pytest

from abs.cli import main
from recovery import check
from storage import CompactionPolicy, Manifest, SnapshotStore

M = 16
JOB: dict[str, Any] = {
    "name": "sessions",
    "max_parallelism": M,
    "operators": [
        {"uid": "src", "kind": "source"},
        {"uid": "agg", "kind": "aggregate", "state": [{"kind": "value", "name": "total", "type": "int64"}]},
        {"uid": "out", "kind": "sink"},
    ],
}


def delta(keys: list[int], values: list[int]) -> pa.Table:
    return pa.table({"key": pa.array(keys, pa.int64()), "value": pa.array(values, pa.int64()),
                     "op": pa.array([0] * len(keys), pa.int8())})


@pytest.fixture
def root(tmp_path) -> SnapshotStore:
    """Checkpoints 1 and 2 at parallelism 2; key group g holds g + 1 keys."""
    store = SnapshotStore.open(str(tmp_path / "root"), policy=CompactionPolicy(max_chain_length=100,
                                                                              max_delta_ratio=1e9), fsync=False)
    store.init_job(JOB)
    chains = {kg: store.write_key_group(1, "agg", "total", kg, [], delta(list(range(kg * 100, kg * 100 + kg + 1)),
                                                                         [1] * (kg + 1))) for kg in range(M)}
    for cid in (1, 2):
        if cid == 2:
            chains[3] = store.write_key_group(2, "agg", "total", 3, chains[3], delta([300], [9]))
        store.commit(Manifest(checkpoint_id=cid, job_name="sessions", max_parallelism=M,
                              keyed={"agg": {"total": dict(chains)}},
                              source_offsets={"src": {"p0": cid, "p1": cid * 2, "p2": cid * 3}},
                              sink_transactions={"out": {"0": [{"checkpoint": cid}]}},
                              stats={"parallelism": 2}))
    return store


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def job_file(tmp_path, job: dict[str, Any]) -> str:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    return str(path)


# =========================================================================== check
def test_check_ok_against_the_snapshots_own_job_file(root, capsys):
    code, out, err = run(capsys, "check", root.url, "--parallelism", "4")
    assert code == 0 and err == ""
    assert out.splitlines() == [f"checkpoint 2 of {root.url} can be restored at parallelism 4; {M + 1} file(s) verified"]


def test_check_an_explicit_checkpoint_without_parallelism(root, capsys):
    code, out, _ = run(capsys, "check", root.url, "1")
    assert code == 0 and out.startswith(f"checkpoint 1 of {root.url} can be restored;")


def test_check_parallelism_above_max_parallelism_exits_1(root, capsys):
    code, out, _ = run(capsys, "check", root.url, "--parallelism", str(M + 1))
    assert code == 1
    assert f"error [parallelism] parallelism {M + 1} exceeds max_parallelism {M}" in out
    assert "cannot be restored" in out.splitlines()[-1]


def test_check_with_a_job_file_that_lost_an_operator(root, capsys, tmp_path):
    job = copy.deepcopy(JOB)
    job["operators"] = [op for op in job["operators"] if op["uid"] != "agg"]
    path = job_file(tmp_path, job)
    code, out, _ = run(capsys, "check", root.url, "-p", "2", "--job", path)
    assert code == 1 and "error [unknown_operator]" in out and "'agg'" in out
    code, out, _ = run(capsys, "check", root.url, "-p", "2", "--job", path, "--allow-non-restored-state")
    assert code == 0 and "warning [unknown_operator]" in out and "can be restored at parallelism 2 (1 warning(s))" in out


def test_check_with_a_job_of_another_name_fails_as_the_job_would_on_this_root(root, capsys, tmp_path):
    """abs.run(..., storage=ROOT) refuses a root of another job (JobMismatchError): check
    says so as an error, with the way out of restoring from the root as a savepoint."""
    path = job_file(tmp_path, {**JOB, "name": "sessions-v2"})
    code, out, _ = run(capsys, "check", root.url, "-p", "2", "--job", path)
    assert code == 1, out
    assert ("error [job_name] checkpoint 2: this storage root belongs to job 'sessions', this job is 'sessions-v2'; "
            "abs.run(..., storage=ROOT) refuses a root of another job (JobMismatchError)") in out
    assert "restore from this root as a savepoint (restore=ROOT)" in out and "matched by operator uid" in out
    assert "restoring anyway" not in out and "cannot be restored at parallelism 2" in out.splitlines()[-1]
    code, out, _ = run(capsys, "check", root.url, "-p", "2", "--job", job_file(tmp_path, JOB))
    assert code == 0 and "job_name" not in out
    # a savepoint is restored from as a path (restore=DIR) into a root of the job's own: a warning there
    sp = str(tmp_path / "sp")
    root.savepoint(2, sp)
    code, out, _ = run(capsys, "check", sp, "-p", "2", "--job", job_file(tmp_path, {**JOB, "name": "sessions-v2"}))
    assert code == 0 and "warning [job_name]" in out and "restoring anyway" in out, out


def test_check_reports_a_corrupt_file_and_the_fallback(root, capsys):
    broken = root.read_manifest(2).chains("agg", "total")[3][-1]
    root.fs.pipe_file(f"{root.url}/{broken.path}", b"torn")
    code, out, _ = run(capsys, "check", root.url, "-p", "2")
    assert code == 1
    assert f"error [file] checkpoint 2: file {broken.path}:" in out
    assert out.splitlines()[-1].endswith("restore from checkpoint 1 (its files verify), or fix the problems above")
    code, _, _ = run(capsys, "check", root.url, "-p", "2", "--no-verify")
    assert code == 0


def test_check_applies_max_decoded_bytes_to_the_files_as_a_restore_would(root, capsys):
    """A file a reader would refuse to decode (beyond the decode limit) is a problem of the
    checkpoint, with the limit check was given; the default limits pass the same files."""
    code, out, _ = run(capsys, "check", root.url, "2", "--max-decoded-bytes", "1")
    assert code == 1, out
    assert "error [file] checkpoint 2: file " in out and "beyond the decode limit of 1 bytes" in out
    assert "--max-decoded-bytes N" in out and "cannot be restored" in out.splitlines()[-1]
    code, out, _ = run(capsys, "check", root.url, "2")
    assert code == 0 and "can be restored" in out
    code, out, _ = run(capsys, "check", root.url, "2", "--max-decoded-bytes", "1MiB")
    assert code == 0 and "can be restored" in out


def test_check_usage_errors_exit_2(root, capsys, tmp_path):
    code, _, err = run(capsys, "check", root.url, "--job", str(tmp_path / "nope.json"))
    assert code == 2 and "--job" in err and "cannot read a JSON job fingerprint" in err
    code, _, err = run(capsys, "check", root.url, "--job", job_file(tmp_path, {"name": "sessions", "operators": []}))
    assert code == 2 and "max_parallelism=None is not an integer" in err
    code, _, err = run(capsys, "check", str(tmp_path / "no-root"))
    assert code == 2 and "holds no snapshots" in err
    code, _, err = run(capsys, "check", root.url, "-p", "0")
    assert code == 2 and "--parallelism 0" in err


# =========================================================================== rescale-preview
def test_rescale_preview_prints_each_new_subtask(root, capsys):
    code, out, err = run(capsys, "rescale-preview", root.url, "--parallelism", "3")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"restore plan: checkpoint 2 of job 'sessions', max_parallelism {M}, parallelism 2 -> 3"
    rows = [line.split() for line in lines[2:5]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert [" ".join(r[1:3]) for r in rows] == ["[0, 5]", "[6, 10]", "[11, 15]"]
    assert [r[3] for r in rows] == ["6", "5", "5"]  # key groups
    assert [r[4] for r in rows] == ["6", "5", "5"]  # chains (every key group holds state)
    assert [r[5] for r in rows] == ["7", "5", "5"]  # files: + the delta of key group 3
    assert [r[6] for r in rows] == ["7", "5", "5"]  # references: a file of its own each
    shares = [float(r[9].rstrip("%")) for r in rows]
    assert sum(shares) == pytest.approx(100, abs=0.2)
    assert shares[0] == max(shares)  # six chains and a delta
    assert lines[5].split()[0] == "total"
    balance = [line for line in lines if line.startswith("balance: max/mean bytes per subtask")]
    assert len(balance) == 1 and "(subtask 0 reads" in balance[0]
    assert float(balance[0].split()[5]) == pytest.approx(shares[0] / (100 / 3), abs=0.01)
    assert "sink 'out': 1 transaction(s) handed to every subtask (union) to re-commit" in lines


def test_rescale_preview_counts_a_packed_file_once_in_files_and_its_ranges_in_refs(tmp_path, capsys):
    """Checkpoint 1 packs the 16 bases into one file, checkpoint 2 the 16 deltas into another
    (one shared range): each subtask reads 2 files, through one reference per key group and
    file."""
    from storage.store import KeyGroupWrite

    store = SnapshotStore.open(str(tmp_path / "packed"), policy=CompactionPolicy(max_chain_length=100,
                                                                               max_delta_ratio=1e9), fsync=False)
    store.init_job(JOB)
    chains = dict(enumerate(store.write_key_groups(1, [
        KeyGroupWrite("agg", "total", kg, [], delta(list(range(kg * 100, kg * 100 + 50)), [1] * 50))
        for kg in range(M)])))
    store.commit(Manifest(checkpoint_id=1, job_name="sessions", max_parallelism=M, keyed={"agg": {"total": chains}}))
    chains = dict(enumerate(store.write_key_groups(2, [
        KeyGroupWrite("agg", "total", kg, chains[kg], delta([kg * 100], [2])) for kg in range(M)])))
    m2 = store.commit(Manifest(checkpoint_id=2, job_name="sessions", max_parallelism=M,
                               keyed={"agg": {"total": chains}}))
    assert len({r.path for r in m2.files().values()}) == 2 and len(m2.files()) == 2 * M  # packed, as described

    code, out, err = run(capsys, "rescale-preview", store.url, "-p", "2")
    assert code == 0 and err == ""
    lines = out.splitlines()
    rows = [line.split() for line in lines[2:5]]
    assert [r[0] for r in rows] == ["0", "1", "total"]
    files = lines[1].split().index("files")  # "key groups" and "[0, 7]" are two words each
    assert [r[files] for r in rows[:2]] == ["2", "2"]
    assert lines[1].split()[4:7] == ["chains", "files", "refs"]
    assert [r[5:7] for r in rows[:2]] == [["2", "16"], ["2", "16"]]  # files, refs of each subtask
    assert rows[2][3:5] == ["2", str(2 * M)]  # total: 2 distinct files, 32 references


def test_rescale_preview_of_an_older_checkpoint_and_errors(root, capsys, tmp_path):
    code, out, _ = run(capsys, "rescale-preview", root.url, "1", "-p", str(M))
    assert code == 0 and out.splitlines()[0].startswith("restore plan: checkpoint 1 ")
    code, _, err = run(capsys, "rescale-preview", root.url, "-p", str(M + 1))
    assert code == 1 and f"parallelism {M + 1} exceeds max_parallelism {M}" in err
    code, _, err = run(capsys, "rescale-preview", root.url, "-p", "2", "--job",
                       job_file(tmp_path, {**JOB, "max_parallelism": 32}))
    assert code == 1 and "re-key" in err
    code, _, err = run(capsys, "rescale-preview", root.url, "9", "-p", "2")
    assert code == 2 and "checkpoint 9 does not exist" in err


# =========================================================================== savepoint
def test_savepoint_writes_a_pinned_self_contained_copy(root, capsys, tmp_path):
    dest = str(tmp_path / "sp")
    code, out, err = run(capsys, "savepoint", root.url, "2", dest)
    assert code == 0 and err == ""
    assert out.startswith(f"savepoint 2 of checkpoint 2 written to {dest} ")
    saved = SnapshotStore.open(dest)
    manifest = saved.read_manifest(2)
    size = sum(r.bytes for r in manifest.files().values())
    from storage.inspect import human_bytes

    assert f"({len(manifest.paths())} file(s), {human_bytes(size)}); pinned" in out and " bytes" not in out  # not raw
    assert manifest.kind == "savepoint" and all(len(c) == 1 for c in manifest.chains("agg", "total").values())
    assert check(JOB, saved, parallelism=5).ok
    code, out, _ = run(capsys, "savepoint", root.url, "1", root.url)  # into the same root: a fresh id
    assert code == 0 and out.startswith(f"savepoint 3 of checkpoint 1 written to {root.url} ")


def test_savepoint_of_a_missing_checkpoint_exits_2(root, capsys, tmp_path):
    code, _, err = run(capsys, "savepoint", root.url, "7", str(tmp_path / "sp"))
    assert code == 2 and "checkpoint 7 does not exist" in err


def test_existing_commands_still_work(root, capsys):
    code, out, _ = run(capsys, "ls", root.url)
    assert code == 0 and out
    code, out, _ = run(capsys, "verify", root.url)
    assert code == 0 and "OK" in out

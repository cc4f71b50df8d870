"""``abs-snapshot``: ls, show, dump, verify, gc, through ``main([...])`` and once as the
installed console script."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pyarrow as pa
import pytest

from abs.cli import main
from storage import CompactionPolicy, Manifest, SnapshotStore
from storage.inspect import parse_storage_options


class Tripwire:
    """Unpickling this fails loudly: proves the CLI does not unpickle without --unpickle."""

    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise AssertionError("the CLI unpickled a value without --unpickle")


PICKLED_META = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"pickle"}


def build_root(url: str, options: dict | None = None) -> SnapshotStore:
    store = SnapshotStore.open(url, options, policy=CompactionPolicy(max_delta_ratio=100.0))
    store.init_job({"job_name": "clicks", "max_parallelism": 4})
    chains = {}
    for kg in range(2):
        chains[kg] = store.write_key_group(1, "count/1", "n", kg, [], pa.table({
            "key": [kg * 10 + i for i in range(5)], "value": [f"v{i}" for i in range(5)],
            "op": pa.array([0] * 5, pa.int8())}))
    blobs = store.write_key_group(1, "count/1", "blobs", 0, [], pa.table({
        "key": ["a", "b"], "value": pa.array([pickle.dumps(Tripwire()), pickle.dumps({"x": 1})], pa.binary()),
        "op": pa.array([0, 0], pa.int8())}).replace_schema_metadata(PICKLED_META))
    src = store.write_operator_state(1, "source", 0, pa.table({"split": ["s0"], "offset": [3]}))
    store.commit(Manifest(checkpoint_id=1, job_name="clicks", max_parallelism=4, created_at=1_700_000_000,
                          keyed={"count/1": {"n": chains, "blobs": {0: blobs}}}, operator_state={"source": {0: src}},
                          operator_state_rules={"source": "split"}, source_offsets={"source": {"s0": 3}},
                          stats={"duration_s": 0.25}))
    chains[0] = store.write_key_group(2, "count/1", "n", 0, chains[0], pa.table({
        "key": [0, 99], "value": ["", "new"], "op": pa.array([1, 0], pa.int8())}))
    store.commit(Manifest(checkpoint_id=2, job_name="clicks", max_parallelism=4, created_at=1_700_000_010,
                          keyed={"count/1": {"n": chains, "blobs": {0: blobs}}}, operator_state={"source": {0: src}},
                          operator_state_rules={"source": "split"}, source_offsets={"source": {"s0": 9}}))
    return store


@pytest.fixture
def root(tmp_path):
    url = str(tmp_path / "snap")
    build_root(url)
    return url


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_complete_checkpoints_with_sizes(capsys, root):
    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["id", "kind", "status", "created", "written", "full", "size", "files", "max", "chain"]
    assert lines[2].startswith("1 ") and lines[3].startswith("2 ") and "2023-11-14 22:13:20 UTC" in lines[2]
    assert lines[3].split()[-1] == "2"  # max chain length of checkpoint 2 (base + delta)


def test_show_defaults_to_the_latest_checkpoint(capsys, root):
    code, out, _ = run(capsys, "show", root)
    assert code == 0
    assert out.startswith("checkpoint 2 (checkpoint) of job 'clicks', max_parallelism 4")
    assert "operator 'count/1'" in out and "state 'n': 2 key groups, 3 files" in out
    assert "kg 0000: base@1" in out and "<- delta@2" in out
    assert "operator 'source' (rule split)" in out and '"s0": 9' in out
    code, out, _ = run(capsys, "show", root, "1", "--files")
    assert code == 0 and out.startswith("checkpoint 1 ") and "state/count%2F1/n/kg-0000/00000001-base-" in out
    assert '"duration_s": 0.25' in out


def test_dump_prints_resolved_rows_as_a_table_or_json_lines(capsys, root):
    code, out, _ = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "n", "--key-group", "0")
    assert code == 0
    body = [line.split() for line in out.splitlines()[2:]]
    assert sorted(int(r[1]) for r in body) == [1, 2, 3, 4, 99]
    code, out, _ = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "n", "--format", "jsonl",
                       "--limit", "3")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 3 and set(rows[0]) == {"key_group", "key", "value"}


def test_dump_never_unpickles_unless_asked(capsys, root):
    code, out, _ = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "blobs")
    assert code == 0 and "<pickled" in out and "bytes>" in out
    code, out, _ = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "blobs", "--format", "jsonl")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and all(set(r["value"]) == {"pickled_hex"} for r in rows)
    assert pickle.loads(bytes.fromhex(rows[1]["value"]["pickled_hex"])) == {"x": 1}


def test_dump_with_unpickle_shows_the_objects(capsys, tmp_path):
    store = SnapshotStore.open(str(tmp_path / "s"))
    chain = store.write_key_group(1, "o", "s", 0, [], pa.table({
        "key": ["k"], "value": pa.array([pickle.dumps({"total": 3})], pa.binary())}).replace_schema_metadata(PICKLED_META))
    store.commit(Manifest(checkpoint_id=1, job_name="j", max_parallelism=1, keyed={"o": {"s": {0: chain}}}))
    code, out, _ = run(capsys, "dump", str(tmp_path / "s"), "1", "--operator", "o", "--state", "s", "--unpickle",
                       "--format", "jsonl")
    assert code == 0 and json.loads(out)["value"] == {"total": 3}


def test_verify_exit_codes(capsys, root):
    code, out, _ = run(capsys, "verify", root)
    assert code == 0 and out.strip().endswith("OK")
    store = SnapshotStore.open(root)
    victim = store.read_manifest(2).keyed["count/1"]["n"][0][-1]
    os.remove(os.path.join(root, victim.path))
    code, out, _ = run(capsys, "verify", root)
    assert code == 1
    assert f"checkpoint 2: {victim.path}: file (written by checkpoint 2) is missing" in out
    assert "restore from checkpoint 1" in out
    code, out, _ = run(capsys, "verify", root, "1")
    assert code == 0
    code, _, err = run(capsys, "verify", root, "7")
    assert code == 2 and "checkpoint 7 has no manifest" in err and "Traceback" not in err


def test_errors_are_one_line_without_traceback(capsys, tmp_path, root):
    code, out, err = run(capsys, "ls", str(tmp_path / "nowhere"))
    assert code == 2 and out == "" and err.count("\n") == 1 and "holds no snapshots" in err
    code, _, err = run(capsys, "dump", root, "2", "--operator", "nope", "--state", "n")
    assert code == 2 and "no keyed state for operator 'nope'" in err and err.count("\n") == 1
    code, _, err = run(capsys, "ls", root, "--storage-option", "novalue")
    assert code == 2 and "key=value" in err
    code, _, err = run(capsys, "frobnicate", root)
    assert code == 2 and "invalid choice" in err


def test_gc_dry_run_then_real(capsys, root):
    store = SnapshotStore.open(root)
    garbage = store.write_key_group(2, "count/1", "n", 3, [], pa.table({"key": [1], "value": ["x"]}))[0].path
    code, out, _ = run(capsys, "gc", root, "--retain", "1", "--dry-run")
    assert code == 0 and f"would delete {garbage}" in out and "would delete checkpoints/chk-00000001.json" in out
    assert os.path.exists(os.path.join(root, garbage))
    code, out, _ = run(capsys, "gc", root, "--retain", "1")
    assert code == 0 and f"deleted {garbage}" in out
    assert SnapshotStore.open(root).list_checkpoints() == [2]
    code, out, _ = run(capsys, "verify", root)
    assert code == 0
    code, _, err = run(capsys, "gc", root, "--retain", "0")
    assert code == 1 and "retain >= 1" in err


def test_gc_with_job_stopped_also_removes_files_of_a_crashed_last_attempt(capsys, root):
    store = SnapshotStore.open(root)
    crashed = store.write_key_group(3, "count/1", "n", 1, [], pa.table({"key": [1], "value": ["x"]}))[0].path
    run(capsys, "gc", root, "--retain", "1")
    assert os.path.exists(os.path.join(root, crashed))
    code, out, _ = run(capsys, "gc", root, "--retain", "1", "--job-stopped")
    assert code == 0 and f"deleted {crashed}" in out


def test_storage_options_parse_json_values_and_dotted_keys():
    assert parse_storage_options(["anon=true", "endpoint_url=http://h:1", "client_kwargs.region_name=eu",
                                  "config_kwargs.retries={\"max_attempts\": 1}"]) == {
        "anon": True, "endpoint_url": "http://h:1", "client_kwargs": {"region_name": "eu"},
        "config_kwargs": {"retries": {"max_attempts": 1}}}


@pytest.mark.s3
def test_cli_reads_s3_with_storage_options(capsys, s3_server, s3_root):
    build_root(s3_root, s3_server.storage_options)
    opts = [f"--storage-option=key={s3_server.storage_options['key']}",
            f"--storage-option=secret={s3_server.storage_options['secret']}",
            f"--storage-option=endpoint_url={s3_server.endpoint_url}"]
    code, out, err = run(capsys, "verify", s3_root, *opts)
    assert code == 0, err
    assert "verified 2 checkpoint(s)" in out


def test_the_installed_console_script_runs(root):
    exe = shutil.which("abs-snapshot", path=os.path.dirname(sys.executable))
    assert exe, "abs-snapshot is not installed in this environment (pip install -e .)"
    proc = subprocess.run([exe, "ls", root], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("id")
    proc = subprocess.run([exe, "verify", root, "9"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_a_manifest_of_a_newer_format_is_listed_but_not_shown_and_blocks_gc(capsys, root):
    doc = json.loads(open(os.path.join(root, "checkpoints", "chk-00000002.json")).read())
    doc.update(checkpoint_id=3, format_version=99)
    with open(os.path.join(root, "checkpoints", "chk-00000003.json"), "w") as f:
        json.dump(doc, f)
    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and out.splitlines()[-1].startswith("3 ") and "newer format: upgrade" in out
    code, _, err = run(capsys, "show", root)
    assert code == 1 and "upgrade to a release that supports format version 99" in err
    before = sorted(os.listdir(os.path.join(root, "checkpoints")))
    code, _, err = run(capsys, "gc", root, "--retain", "1")
    assert code == 1 and "GC refused" in err and "nothing was deleted" in err
    assert sorted(os.listdir(os.path.join(root, "checkpoints"))) == before

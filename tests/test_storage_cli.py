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
    assert "operator 'count/1'" in out and "state 'n': 2 key groups, 3 file(s), 1.7 KiB" in out
    assert "2 bases (10 rows, 1.0 KiB), 0 values images, 1 delta (2 rows, 648 B)" in out
    assert "chain length min 1, median 1.5, max 2" in out
    assert "kg 0000" not in out  # key groups only on request
    assert "operator 'source' (rule split)" in out and '"s0": 9' in out
    code, out, _ = run(capsys, "show", root, "latest", "--key-groups")
    assert code == 0 and "kg 0000: base@1" in out and "<- delta@2" in out and "/kg-0000/" not in out
    code, out, _ = run(capsys, "show", root, "1", "--files")
    assert code == 0 and out.startswith("checkpoint 1 ") and "state/count%2F1/n/kg-0000/00000001-base-" in out
    assert "\ntook 250 ms\n" in out


def test_dump_prints_resolved_rows_as_a_table_or_json_lines(capsys, root):
    code, out, _ = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "n", "--key-group", "0")
    assert code == 0
    body = [line.split() for line in out.splitlines()[2:]]
    assert sorted(int(r[1]) for r in body) == [1, 2, 3, 4, 99]
    code, out, _ = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "n", "--format", "jsonl",
                       "--limit", "3")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 3 and set(rows[0]) == {"key_group", "key", "value"}
    # a table that stopped at the limit says so (JSON lines stay rows alone)
    code, out, _ = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "n", "--limit", "3")
    assert code == 0 and len(out.splitlines()) == 2 + 3 + 1
    assert out.splitlines()[-1] == "(the first 3 rows: the limit; there may be more; --limit 0 prints every row)"
    code, out, _ = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "n", "--limit", "0")
    assert code == 0 and "the limit" not in out


@pytest.mark.parametrize("key_group", ["4", "-1", "128"])
def test_dump_of_a_key_group_outside_the_range_says_so(capsys, root, key_group):
    code, out, err = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "n", "--key-group", key_group)
    assert code == 2 and out == ""
    assert f"key group {key_group} is outside 0..3 (max_parallelism 4); pass a key group from 0 to 3" in err
    assert "held no state" not in err


def test_dump_of_a_key_group_that_held_no_state_prints_no_rows(capsys, root):
    code, out, err = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "n", "--key-group", "3")
    assert code == 0 and err == ""
    assert out.splitlines() == ["(no rows: key group 3 of count/1/n held no state at checkpoint 2)"]
    code, out, err = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "n", "--key-group", "3",
                         "--format", "jsonl")
    assert (code, out, err) == (0, "", "")
    code, _, err = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "nope", "--key-group", "3")
    assert code == 2 and "has no state 'nope'" in err  # an unknown state is still named first


def test_dump_lists_a_resolved_key_groups_rows_in_key_order(capsys, tmp_path):
    """A chain whose delta changed some keys: resolving puts those after the base's others;
    dump lists the rows by key, as it lists a base's, so a --limit shows the smallest keys."""
    url = str(tmp_path / "snap")
    store = SnapshotStore.open(url, policy=CompactionPolicy(max_delta_ratio=100.0))
    store.init_job({"job_name": "order", "max_parallelism": 4})
    chain = store.write_key_group(1, "op", "n", 0, [], pa.table({"key": [10, 20, 30], "value": [1, 2, 3]}))
    chain = store.write_key_group(2, "op", "n", 0, chain, pa.table({"key": [5, 20], "value": [7, 8]}))
    assert len(chain) == 2
    store.commit(Manifest(checkpoint_id=2, job_name="order", max_parallelism=4, created_at=1_700_000_000,
                          keyed={"op": {"n": {0: chain}}}))
    code, out, _ = run(capsys, "dump", url, "2", "--operator", "op", "--state", "n", "--format", "jsonl")
    assert code == 0
    assert [(r["key"], r["value"]) for r in map(json.loads, out.splitlines())] == [(5, 7), (10, 1), (20, 8), (30, 3)]
    code, out, _ = run(capsys, "dump", url, "2", "--operator", "op", "--state", "n", "--format", "jsonl", "--limit", "2")
    assert [json.loads(line)["key"] for line in out.splitlines()] == [5, 10]


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


def test_verify_applies_max_decoded_bytes(capsys, root):
    """verify reports the files a reader would refuse to decode under the limit it was given."""
    code, out, _ = run(capsys, "verify", root, "1", "--max-decoded-bytes", "1")
    assert code == 1 and "beyond the decode limit of 1 bytes" in out and "no checked checkpoint is intact" in out
    code, out, _ = run(capsys, "verify", root, "1")
    assert code == 0 and out.strip().endswith("OK")


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
    assert code == 2 and "use K >= 1" in err  # a bad flag value: usage, as elsewhere


def test_verify_and_gc_print_sizes_as_the_other_commands_do(capsys, root):
    """KiB/MiB/GiB with one decimal (storage.inspect.human_bytes, as ls and show), not bytes."""
    from storage.inspect import human_bytes

    store = SnapshotStore.open(root)
    report = store.verify()
    assert report.bytes_checked > 1024  # so that the size reads in KiB
    code, out, _ = run(capsys, "verify", root)
    assert code == 0 and out.splitlines()[-1] == (f"verified 2 checkpoint(s), {report.files_checked} file(s), "
                                                  f"{human_bytes(report.bytes_checked)}: OK")
    assert human_bytes(report.bytes_checked).endswith(" KiB") and f"{report.bytes_checked} bytes" not in out
    plan = store.plan_gc(1)
    assert plan.bytes_freed > 1024
    code, out, _ = run(capsys, "gc", root, "--retain", "1", "--dry-run")
    assert code == 0 and f"manifests ({human_bytes(plan.bytes_freed)});" in out
    assert f"{plan.bytes_freed} bytes" not in out


def _flip_a_byte_of(root: str, cid: int, key_group: int) -> None:
    """Damage the file (or range) checkpoint ``cid`` wrote for key group ``key_group`` of count/1 n."""
    store = SnapshotStore.open(root)
    ref = store.read_manifest(cid).keyed["count/1"]["n"][key_group][-1]
    assert ref.checkpoint_id == cid
    path = os.path.join(root, ref.path)
    at = (ref.offset or 0) + ref.bytes // 2
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_gc_keeps_the_newest_intact_checkpoint_when_every_kept_one_is_damaged(capsys, root):
    """Checkpoint 2 (the one --retain 1 keeps) is damaged: GC keeps checkpoint 1 too, which a
    restore falls back to; --no-verify collects as before."""
    _flip_a_byte_of(root, 2, 0)
    code, out, err = run(capsys, "gc", root, "--retain", "1")
    assert code == 0 and err == ""
    assert "checkpoint(s) [2] are damaged" in out and "keeping every checkpoint down to 1, the newest intact one" in out
    assert SnapshotStore.open(root).list_checkpoints() == [1, 2]
    code, out, err = run(capsys, "gc", root, "--retain", "1", "--no-verify")
    assert code == 0 and "damaged" not in out
    assert SnapshotStore.open(root).list_checkpoints() == [2]


def test_gc_deletes_nothing_when_no_checkpoint_is_intact(capsys, root):
    _flip_a_byte_of(root, 1, 1)  # key group 1's base: both checkpoints read it
    before = SnapshotStore.open(root).list_files()
    code, out, err = run(capsys, "gc", root, "--retain", "1")
    assert code == 1 and "no checkpoint is intact (checked [1, 2]" in err and "nothing was deleted" in err
    assert SnapshotStore.open(root).list_files() == before
    code, _, err = run(capsys, "gc", root, "--retain", "0")
    assert code == 2 and "--retain 0: GC keeps at least the newest checkpoint" in err


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


# ---------------------------------------------------------------------- latest, show's summary
@pytest.mark.parametrize("argv", [
    ["show", "{root}", "{id}"],
    ["dump", "{root}", "{id}", "--operator", "count/1", "--state", "n"],
    ["verify", "{root}", "{id}"],
    ["check", "{root}", "{id}"],
    ["rescale-preview", "{root}", "{id}", "-p", "2"],
])
def test_latest_names_the_newest_checkpoint_wherever_an_id_is_taken(capsys, root, argv):
    by_id = run(capsys, *[a.format(root=root, id="2") for a in argv])
    latest = run(capsys, *[a.format(root=root, id="latest") for a in argv])
    assert by_id[0] == 0 and latest == by_id


def test_latest_is_taken_by_savepoint_too(capsys, root, tmp_path):
    """(rekey ROOT latest: see tests/test_cli_hostile.py, on a root whose keys a real job placed)"""
    code, out, err = run(capsys, "savepoint", root, "latest", str(tmp_path / "dest"))
    assert code == 0 and "of checkpoint 2 written" in out and err == ""


def test_a_savepoint_of_an_older_checkpoint_into_its_own_root_says_it_is_now_the_latest(capsys, root, tmp_path):
    code, out, err = run(capsys, "savepoint", root, "1", root)
    assert code == 0 and err == ""
    assert "savepoint 3 of checkpoint 1 written" in out
    assert f"note: it is now the newest checkpoint of {root}: restore='latest' there restores checkpoint 1's state" in out
    code, out, _ = run(capsys, "savepoint", root, "2", str(tmp_path / "elsewhere"))
    assert code == 0 and "note:" not in out
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "notes.txt").write_text("mine")
    code, out, err = run(capsys, "savepoint", root, "2", str(tmp_path / "mixed"))
    assert code == 2 and out == "" and "is not empty (1 file(s), e.g. ['notes.txt']) and holds no snapshots" in err
    assert sorted(os.listdir(tmp_path / "mixed")) == ["notes.txt"]


def test_verify_counts_a_corrupt_job_file_and_latest_names_newer_corrupt_manifests(capsys, root):
    with open(os.path.join(root, "checkpoints", "chk-00000003.json"), "w") as f:
        f.write("{")
    for argv in (["verify", root, "latest"], ["check", root, "latest"], ["dump", root, "latest", "--operator",
                                                                          "count/1", "--state", "n"]):
        code, out, err = run(capsys, *argv)
        assert code == 0 and "note: checkpoint 3: manifest is corrupt (does not parse as JSON)" in err
    with open(os.path.join(root, "_job.json"), "w") as f:
        f.write('{"job_name": "clicks", "max_par')
    code, out, err = run(capsys, "verify", root)
    assert code == 1 and out.startswith("problem: ") and "_job.json: does not parse as JSON" in out


def test_latest_on_a_root_without_checkpoints_says_so(capsys, tmp_path):
    store = SnapshotStore.open(str(tmp_path / "empty"))
    store.init_job({"job_name": "j", "max_parallelism": 2})
    code, out, err = run(capsys, "dump", str(tmp_path / "empty"), "latest", "--operator", "o", "--state", "s")
    assert code == 2 and out == "" and "holds no complete checkpoint, so 'latest' names none" in err
    code, _, err = run(capsys, "show", str(tmp_path / "empty"), "0")
    assert code == 2 and "ids start at 1 (or use 'latest')" in err


def test_show_summarises_per_state_and_labels_values_images(capsys, tmp_path):
    """64 key groups: one summary per state (not a line per key group); a values image counts
    apart from deltas and reads 'values' in the per key group view."""
    url = str(tmp_path / "v")
    store = SnapshotStore.open(url, policy=CompactionPolicy(max_delta_ratio=10.0))
    store.init_job({"job_name": "counts", "max_parallelism": 64})

    def image(kg: int, bump: int) -> pa.Table:
        keys = list(range(kg * 1000, kg * 1000 + 50))
        return pa.table({"key": pa.array(keys, pa.int64()), "value": pa.array([k + bump for k in keys], pa.int64())})

    chains = {kg: store.write_key_group(1, "count", "n", kg, [], image(kg, 0), complete=True) for kg in range(64)}
    store.commit(Manifest(checkpoint_id=1, job_name="counts", max_parallelism=64, keyed={"count": {"n": chains}},
                          stats={"duration_s": 0.0123, "alignment_s": 5.9168e-05}))
    chains = {kg: store.write_key_group(2, "count", "n", kg, chain, image(kg, 1), complete=True, over_base=chain[0])
              for kg, chain in chains.items()}
    chains[7] = store.write_key_group(3, "count", "n", 7, chains[7], pa.table({
        "key": pa.array([7000], pa.int64()), "value": pa.array([1], pa.int64())}))
    store.commit(Manifest(checkpoint_id=3, job_name="counts", max_parallelism=64, keyed={"count": {"n": chains}}))
    code, out, _ = run(capsys, "show", url, "latest")
    lines = out.splitlines()
    assert code == 0 and len(lines) < 15, out
    assert "    state 'n': 64 key groups, " in out
    assert "64 bases (3,200 rows" in out and "64 values images (3,200 rows" in out and "1 delta (1 row," in out
    assert "chain length min 2, median 2, max 3" in out
    code, out, _ = run(capsys, "show", url, "latest", "--key-groups")
    assert len(out.splitlines()) == len(lines) + 64
    assert "kg 0007: base@1 (" in out and "<- values@2 (" in out and "<- delta@3 (" in out
    code, out, _ = run(capsys, "show", url, "1")
    assert "took 12.3 ms (alignment 0.06 ms)" in out and "5.9168e-05" not in out


def test_an_unexpected_error_is_one_line_naming_a_bug_and_traceback_shows_it(capsys, root, monkeypatch):
    import abs.cli

    def broken(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(abs.cli._COMMANDS, "ls", broken)
    code, out, err = run(capsys, "ls", root)
    assert code == 3 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "ls failed unexpectedly (ZeroDivisionError: division by zero); this is a bug" in err
    code, _, err = run(capsys, "--traceback", "ls", root)
    assert code == 3 and "Traceback (most recent call last)" in err and "ZeroDivisionError" in err


def test_show_still_summarises_when_a_file_it_peeks_at_is_missing(capsys, root):
    store = SnapshotStore.open(root)
    victim = store.read_manifest(2).keyed["count/1"]["n"][0][1]  # the delta of key group 0
    os.remove(os.path.join(root, victim.path))
    code, out, err = run(capsys, "show", root, "2")
    assert code == 0 and err == "" and "1 delta (2 rows, 648 B)" in out
    assert f"note: 1 file(s) could not be read to tell a values image from a delta (counted as deltas), " \
           f"e.g. {victim.path}; run 'abs-snapshot verify'" in out


def test_dump_unpickle_of_a_value_that_fails_to_unpickle_is_one_line(capsys, root):
    code, out, err = run(capsys, "dump", root, "2", "--operator", "count/1", "--state", "blobs", "--unpickle")
    assert code == 1 and err.count("\n") == 1 and "does not unpickle here (AssertionError: the CLI unpickled" in err


def test_a_savepoint_packs_its_key_groups_and_every_command_reads_it(capsys, tmp_path):
    """``abs-snapshot savepoint`` writes a packed file per state (not a file per key group); a
    key group whose keys were all deleted keeps an empty base (as the Spark rewrite writes it),
    and every command reads the savepoint."""
    url = str(tmp_path / "snap")
    store = SnapshotStore.open(url, policy=CompactionPolicy(max_delta_ratio=100.0))
    store.init_job({"job_name": "clicks", "max_parallelism": 8})
    chains = {kg: store.write_key_group(1, "count", "n", kg, [], pa.table({
        "key": [kg * 10 + i for i in range(3)], "value": [f"v{i}" for i in range(3)],
        "op": pa.array([0] * 3, pa.int8())})) for kg in range(6)}
    store.commit(Manifest(checkpoint_id=1, job_name="clicks", max_parallelism=8, keyed={"count": {"n": chains}}))
    chains[2] = store.write_key_group(2, "count", "n", 2, chains[2], pa.table({  # every key of key group 2 deleted
        "key": [20, 21, 22], "value": ["", "", ""], "op": pa.array([1, 1, 1], pa.int8())}))
    store.commit(Manifest(checkpoint_id=2, job_name="clicks", max_parallelism=8, keyed={"count": {"n": chains}}))
    dest = str(tmp_path / "sp")
    code, out, err = run(capsys, "savepoint", url, "2", dest)
    assert code == 0 and err == "", err
    sp = SnapshotStore.open(dest)
    saved = sp.read_manifest(2)
    assert sorted(saved.chains("count", "n")) == [0, 1, 2, 3, 4, 5]
    assert saved.chains("count", "n")[2][0].rows == 0  # all its keys deleted: an empty base
    assert sp.read_key_group(saved, "count", "n", 2).num_rows == 0
    state_files = [p for p in sp.list_files() if p.startswith("state/")]
    assert len(state_files) == 1 and "/packed/" in state_files[0]
    assert saved.paths() == set(state_files)
    for kg in (0, 1, 3, 4, 5):
        assert sp.read_key_group(saved, "count", "n", kg).column("key").to_pylist() == [kg * 10 + i for i in range(3)]
    assert run(capsys, "verify", dest)[0] == 0
    code, out, _ = run(capsys, "dump", dest, "2", "--operator", "count", "--state", "n", "--key-group", "2",
                       "--format", "jsonl")
    assert (code, out) == (0, "")
    code, out, _ = run(capsys, "dump", dest, "2", "--operator", "count", "--state", "n", "--format", "jsonl")
    assert code == 0 and len(out.splitlines()) == 15
    for argv in (["ls", dest], ["show", dest], ["check", dest, "2", "-p", "3"],
                 ["rescale-preview", dest, "2", "-p", "3"], ["report", dest, "--output", str(tmp_path / "r.html")]):
        code, out, err = run(capsys, *argv)
        assert code == 0, (argv, out, err)
    code, out, err = run(capsys, "gc", dest, "--retain", "1")
    assert code == 0 and set(sp.list_files()) >= set(state_files) and sp.verify().ok


# -------------------------------------------------- a root that a running job's retention changes
def _commit_full(store: SnapshotStore, cid: int) -> None:
    """Checkpoint ``cid`` writing both key groups anew (every key changed), so that dropping it
    deletes its files, as a job's retention does."""
    chains = {kg: store.write_key_group(cid, "sum", "n", kg, [], pa.table({"key": [kg], "value": [cid]}))
              for kg in range(2)}
    store.commit(Manifest(checkpoint_id=cid, job_name="live", max_parallelism=2, keyed={"sum": {"n": chains}}))


@pytest.fixture
def live_root(tmp_path) -> str:
    url = str(tmp_path / "live")
    store = SnapshotStore.open(url, fsync=False)
    store.init_job({"job_name": "live", "max_parallelism": 2})
    for cid in (1, 2, 3):
        _commit_full(store, cid)
    return url


def _job_retention_on_first_read(monkeypatch, url: str, of: set[int], step) -> list[str]:
    """The first time anything reads a data file of a checkpoint in ``of``, run ``step(store)``
    first, on a store of its own: what a job writing ``url`` does meanwhile (commit a newer
    checkpoint, drop older ones by retention). Returns the path whose read set it off."""
    from storage.backend import RootIO
    from storage.paths import StoragePaths

    real = RootIO.get
    fired: list[str] = []

    def get(self, rel):
        parsed = StoragePaths.parse(rel)
        if (not fired and parsed is not None and parsed.category in ("base", "delta", "packed")
                and parsed.checkpoint_id in of):
            fired.append(rel)
            step(SnapshotStore.open(url, fsync=False))
        return real(self, rel)

    monkeypatch.setattr(RootIO, "get", get)
    return fired


def test_verify_does_not_report_checkpoints_a_running_jobs_retention_dropped_meanwhile(capsys, monkeypatch,
                                                                                        live_root):
    """A job with CheckpointConfig(retained=1) drops checkpoints 1 and 2 while verify reads
    them: they are gone, not damaged (verify said 'file ... vanished while verifying' and
    exited 1, 'no checked checkpoint is intact' when it checked one)."""
    fired = _job_retention_on_first_read(monkeypatch, live_root, {1, 2}, lambda s: s.gc(1))
    code, out, err = run(capsys, "verify", live_root)
    assert fired, "verify read no file of checkpoints 1-2"
    assert code == 0, out + err
    assert "vanished" not in out and "missing" not in out
    assert "checkpoint(s) [1, 2] removed while verifying" in out
    assert out.splitlines()[-1].startswith("verified 1 checkpoint(s)") and ": OK" in out.splitlines()[-1]
    assert SnapshotStore.open(live_root).list_checkpoints() == [3]


def test_check_and_gc_of_a_checkpoint_a_running_job_dropped_meanwhile(capsys, monkeypatch, live_root):
    """check (of the latest) and gc (verifying the newest first) while the job commits
    checkpoint 4 and drops 3: check says the checkpoint was removed and to check again (not
    'cannot be restored ... restore from a savepoint'); gc verifies the newest checkpoint
    there now and collects (it refused: 'no checkpoint is intact')."""
    def commit_4_and_drop(store):
        _commit_full(store, 4)
        store.gc(1)

    _job_retention_on_first_read(monkeypatch, live_root, {3}, commit_4_and_drop)
    code, out, err = run(capsys, "check", live_root)
    assert code == 1 and "Traceback" not in err
    assert "checkpoint 3 was removed while verifying" in out and "check again" in out
    assert "restore from a savepoint" not in out and "vanished" not in out

    def commit_5_and_drop(store):
        _commit_full(store, 5)
        store.gc(1)

    fired = _job_retention_on_first_read(monkeypatch, live_root, {4}, commit_5_and_drop)
    code, out, err = run(capsys, "gc", live_root, "--retain", "1")
    assert fired and code == 0, out + err
    assert "damaged" not in out and "no checkpoint is intact" not in err
    assert SnapshotStore.open(live_root).list_checkpoints() == [5]


def test_savepoint_into_a_root_whose_job_commits_the_same_id_meanwhile(capsys, monkeypatch, live_root):
    """`abs-snapshot savepoint ROOT 2 ROOT` takes the next free id (4); the job writing the root
    commits its own checkpoint 4 while the copy runs. The savepoint fails, leaves nothing, and
    says why and what to do (it said 'take the next id from next_checkpoint_id()', an API
    hint no CLI user can follow)."""
    fired = _job_retention_on_first_read(monkeypatch, live_root, {2}, lambda store: _commit_full(store, 4))
    code, out, err = run(capsys, "savepoint", live_root, "2", live_root)
    assert fired and code == 1 and "Traceback" not in err
    assert "checkpoint 4 already has a manifest" in err
    assert "next_checkpoint_id()" not in err
    assert "a job writing this root committed it while the savepoint copied" in err
    assert "take the savepoint into a directory of its own" in err
    store = SnapshotStore.open(live_root)
    assert store.list_checkpoints() == [1, 2, 3, 4] and store.read_manifest(4).kind == "checkpoint"
    assert not [p for p in store.list_files() if ".sp-" in p]  # no marker left
    code, out, _ = run(capsys, "verify", live_root)
    assert code == 0, out

"""Offline tools never unpickle a snapshot's bytes without an explicit opt-in (``--unpickle``,
``unpickle=True``): a planted pickle payload (one that creates a marker file) never runs
without it, and the refusal says why. Paths that work on the pickled bytes (savepoint /
compaction, dump) do not need it."""
from __future__ import annotations

import os
import pickle

import pyarrow as pa
import pytest

from abs.cli import main
from abs.keygroups import stable_hashes
from recovery.rewrite import UnpickleRefusedError, rekey_local
from storage import Manifest, SnapshotStore

PICKLED_KEYS = {b"abs.key_encoding": b"pickle", b"abs.value_encoding": b"arrow"}


class Payload:
    """Unpickling it creates the file ``path``: stands for any code a hostile root could run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def build_root(url: str, marker: str, *, pickled_group: int = 0) -> SnapshotStore:
    """Checkpoint 12 of a job with max_parallelism 4: operator 'count' state 'n' holds typed
    keys in key group 0 and, in ``pickled_group``, a pickled key that is the payload."""
    store = SnapshotStore.open(url, fsync=False)
    store.init_job({"job_name": "planted", "max_parallelism": 4})
    chains = {}
    if pickled_group != 0:
        keys = [k for k in range(100) if int(stable_hashes([k])[0] % 4) == 0][:2]  # keys of key group 0
        chains[0] = store.write_key_group(12, "count", "n", 0, [], pa.table({
            "key": pa.array(keys, pa.int64()), "value": pa.array([1, 2], pa.int64())}))
    chains[pickled_group] = store.write_key_group(12, "count", "n", pickled_group, [], pa.table({
        "key": pa.array([pickle.dumps(Payload(marker))], pa.binary()), "value": pa.array([7], pa.int64()),
    }).replace_schema_metadata(PICKLED_KEYS))
    store.commit(Manifest(checkpoint_id=12, job_name="planted", max_parallelism=4, keyed={"count": {"n": chains}}))
    return store


@pytest.fixture
def planted(tmp_path) -> tuple[str, str]:
    marker = str(tmp_path / "payload-ran")
    root = str(tmp_path / "root")
    build_root(root, marker)
    return root, marker


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


REFUSAL = ("checkpoint 12: operator 'count' state 'n' has pickled keys; re-keying must unpickle them, which runs "
           "code from the snapshot; pass --unpickle")


@pytest.mark.parametrize("spark", [False, True], ids=["local", "spark"])
def test_rekey_refuses_pickled_keys_without_unpickle_and_the_payload_never_runs(capsys, planted, tmp_path, spark):
    root, marker = planted
    dest = str(tmp_path / "dest")
    code, out, err = run(capsys, "rekey", root, "latest", dest, "--max-parallelism", "8", *(["--spark"] if spark else []))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert REFUSAL in err
    assert not os.path.exists(marker)
    assert not SnapshotStore.open(dest).list_checkpoints()


def test_the_python_api_needs_unpickle_true_too(planted, tmp_path):
    root, marker = planted
    with pytest.raises(UnpickleRefusedError, match="has pickled keys; re-keying must unpickle them"):
        rekey_local(root, 12, str(tmp_path / "dest"), max_parallelism=8)
    assert not os.path.exists(marker)


def test_a_task_refuses_pickled_keys_the_plan_did_not_see(tmp_path):
    """The plan looks at one file per state; every key group is checked again before hashing."""
    marker = str(tmp_path / "payload-ran")
    root = str(tmp_path / "root")
    build_root(root, marker, pickled_group=3)
    with pytest.raises(UnpickleRefusedError, match="operator 'count' state 'n' has pickled keys"):
        rekey_local(root, 12, str(tmp_path / "dest"), max_parallelism=8)
    assert not os.path.exists(marker)


def test_with_unpickle_the_rekey_does_unpickle(capsys, planted, tmp_path):
    """The control: the opt-in is what runs the payload (here it then fails to hash an open file)."""
    root, marker = planted
    code, _, err = run(capsys, "rekey", root, "12", str(tmp_path / "dest"), "--max-parallelism", "8", "--unpickle")
    assert os.path.exists(marker)
    assert code == 1 and err.count("\n") == 1 and "cannot be hashed" in err and "Traceback" not in err


def test_savepoint_and_dump_work_on_the_pickled_bytes_without_unpickling(capsys, planted, tmp_path):
    root, marker = planted
    code, out, err = run(capsys, "savepoint", root, "latest", str(tmp_path / "sp"))
    assert code == 0 and "savepoint 12 of checkpoint 12" in out, err
    code, out, err = run(capsys, "dump", str(tmp_path / "sp"), "latest", "--operator", "count", "--state", "n")
    assert code == 0 and "<pickled" in out, err
    assert not os.path.exists(marker)

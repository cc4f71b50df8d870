"""A job's storage root is one place for the driver and every worker.

A relative path is resolved in the driver (a Spark executor resolves it against its own work
directory otherwise), and every worker checks at start that it sees the driver's root: the
driver writes a probe file, each worker reads it, and a worker that cannot fails the job at
once with an error naming the root and the remedy (no restart is spent on it).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pytest

import abs
from abs.runtime.driver import LocalExecutor
from storage import SnapshotStore, StoragePaths
from storage.backend import absolute_url
from storage.errors import RootNotSharedError


def _count(ctx, event):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def _flow(events: int = 20_000) -> abs.Dataflow:
    flow = abs.Dataflow("root-shared")
    counts = flow.source("events", abs.GeneratorSource(events, num_keys=100)).key_by("key").process(
        "count", _count, state=[abs.ValueState("n", pa.int64())]
    )
    counts.sink("out", abs.CollectSink())
    return flow


def test_absolute_url_resolves_local_paths_and_leaves_other_urls_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_url("snap") == str(tmp_path / "snap")
    assert absolute_url("./a/../snap") == str(tmp_path / "snap")
    assert absolute_url("file://snap") == "file://" + str(tmp_path / "snap")
    assert absolute_url("/abs/root") == "/abs/root"
    assert absolute_url("~/x") == os.path.expanduser("~/x")
    for url in ("s3://bucket/prefix", "memory://x", "faulty://tmp/x", "simplecache::s3://b/p"):
        assert absolute_url(url) == url


def test_a_relative_storage_path_is_resolved_in_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = abs.run(_flow(), parallelism=2, checkpoint=abs.CheckpointConfig(interval=0.2), storage="snap")
    assert result.status == "FINISHED"
    store = SnapshotStore.open(str(tmp_path / "snap"))
    ids = store.list_checkpoints()
    last = ids[-1]
    assert last == result.completed_checkpoints[-1].checkpoint_id
    assert store.verify(last).ok
    # the probe of each start is gone once the workers are running
    assert not [p for p in store.list_files() if StoragePaths.parse(p) and StoragePaths.parse(p).category == "probe"]


def test_probe_checks_the_token_and_names_the_root(tmp_path):
    driver_side = SnapshotStore.open(str(tmp_path / "root"))
    token = driver_side.write_probe()
    SnapshotStore.open(str(tmp_path / "root")).check_probe(token, who="worker 0")
    with pytest.raises(RootNotSharedError, match=r"worker 1 does not see the snapshot root .*root.*s3://"):
        SnapshotStore.open(str(tmp_path / "elsewhere")).check_probe(token, who="worker 1")
    driver_side.delete_probe(token)
    driver_side.delete_probe(token)  # idempotent
    with pytest.raises(RootNotSharedError, match="is missing"):
        driver_side.check_probe(token)


def _can_unshare_mounts() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt && umount /mnt"],
                           capture_output=True)
    return probe.returncode == 0


class _OtherDiskExecutor(LocalExecutor):
    """Local workers that each see an empty disk at ``hidden`` (a fresh tmpfs mounted over it
    in a mount namespace of their own): a worker "on another host" whose local path exists
    but is not the driver's."""

    def __init__(self, hidden: str, *, workers: tuple[int, ...]) -> None:
        super().__init__()
        self.hidden = hidden
        self.workers = workers

    def launch(self, index: int, boot: dict) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        cmd = [sys.executable, "-c", "from abs.runtime.worker_main import main; main()"]
        if index in self.workers:
            cmd = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', self.hidden, *cmd]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, close_fds=True)
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(boot) + "\n").encode())
        proc.stdin.close()
        return proc


@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs root and mount namespaces (unshare -m)")
def test_a_worker_that_does_not_see_the_drivers_root_fails_the_job_at_once(tmp_path):
    root = tmp_path / "local-disk" / "snap"
    root.mkdir(parents=True)
    executor = _OtherDiskExecutor(str(tmp_path / "local-disk"), workers=(1,))
    with pytest.raises(abs.StartupError) as info:
        abs.run(_flow(), parallelism=2, executor=executor, checkpoint=abs.CheckpointConfig(interval=0.2),
                storage=str(root), restart=abs.RestartStrategy(max_restarts=3, delay=0.0))
    assert info.value.permanent  # restarting cannot help: no restart was spent
    assert info.value.result is not None and info.value.result.restarts == []
    first_line = str(info.value).splitlines()[0]
    assert "worker 1" in first_line and "does not see the snapshot root" in first_line and str(root) in first_line
    # nothing was checkpointed, and the driver's probe is gone
    store = SnapshotStore.open(str(root))
    assert store.list_checkpoints() == []
    assert not [p for p in store.list_files() if p.startswith("._probe.")]

"""Progress of long operations: the events verify, GC, savepoint and re-key send
(abscore.progress), and the CLI's bars on a terminal only (abs.observe.progress)."""
from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import pyarrow as pa
import pytest

import abs
from abs.observe.progress import terminal_progress
from abscore.progress import ProgressEvent, Tracker
from pacing import PacedSource
from recovery.rewrite import rekey_local
from storage import SnapshotStore


def count_fn(ctx, row):
    n = ctx.state.n
    n.update((n.value() or 0) + 1)
    ctx.emit({"key": ctx.key})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """Several checkpoints of 64 keys: each reader lets 700 of its 4,000 records out per
    completed checkpoint."""
    path = str(tmp_path_factory.mktemp("progress") / "root")
    flow = abs.Dataflow("progress-counts", max_parallelism=16)
    src = PacedSource(abs.GeneratorSource(8_000, num_keys=64, num_splits=2, batch_size=100), 700)
    flow.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]) \
        .sink("out", abs.CollectSink())
    result = abs.run(flow, parallelism=2, storage=path, checkpoint=abs.CheckpointConfig(interval=0.05, retained=20))
    assert len(result.completed_checkpoints) >= 4
    return path


def collect() -> tuple[list[ProgressEvent], object]:
    events: list[ProgressEvent] = []
    return events, events.append


def test_a_tracker_reports_its_start_and_each_step_and_nothing_without_a_callback():
    events, cb = collect()
    t = Tracker(cb, "copy", 3, "files")
    for _ in range(3):
        t.advance()
    assert events == [ProgressEvent("copy", i, 3, "files") for i in range(4)]
    silent = Tracker(None, "copy", 3)
    silent.advance()
    assert silent.done == 0


def test_verify_gc_savepoint_and_rekey_report_each_file_or_key_group(root, tmp_path):
    store = SnapshotStore.open(root)
    events, cb = collect()
    report = store.verify(progress=cb)
    assert report.ok and events[-1] == ProgressEvent("verify", report.files_checked, report.files_checked, "files")
    assert [e.done for e in events] == list(range(report.files_checked + 1))

    events, cb = collect()
    manifest = store.read_manifest(store.latest_checkpoint())
    key_groups = sum(len(chains) for states in manifest.keyed.values() for chains in states.values())
    store.savepoint(manifest.checkpoint_id, str(tmp_path / "sp"), progress=cb)
    assert events[-1] == ProgressEvent("savepoint: copy", key_groups, key_groups, "key groups")

    events, cb = collect()
    rekey_local(root, manifest.checkpoint_id, str(tmp_path / "rekeyed"), max_parallelism=8, progress=cb)
    stages = {e.stage: e for e in events}
    assert stages["rekey: read"].done == stages["rekey: read"].total == key_groups
    assert stages["rekey: write"].done == stages["rekey: write"].total > 0

    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(root, copy)
    events, cb = collect()
    plan = SnapshotStore.open(str(copy)).gc(1, progress=cb)
    deleted = len(plan.delete_files) + len(plan.delete_manifests) + len(plan.delete_pins)
    assert deleted > 0 and events[-1] == ProgressEvent("gc: delete", deleted, deleted, "files")


def test_bars_are_drawn_on_a_terminal_only_and_never_with_quiet():
    with terminal_progress(stream=io.StringIO()) as cb:
        assert cb is None  # not a terminal
    with terminal_progress(quiet=True, force=True) as cb:
        assert cb is None
    out = io.StringIO()
    with terminal_progress(stream=out, force=True) as cb:
        assert cb is not None
        t = Tracker(cb, "verify", 4, "files")
        for _ in range(4):
            t.advance()
    assert "verify" in out.getvalue() and "4/4" in out.getvalue()


def test_the_rate_and_time_left_are_over_the_time_since_the_bar_started():
    """Events may come in a burst (a restore's ride on the workers' heartbeats): the rate is
    what is done over the time since the bar started, not over the microseconds between the
    last two events (rich's own speed showed a restore of 3,976 KiB in 0.2 s as 63,601,195.3
    KiB/s)."""
    import re
    import time

    out = io.StringIO()
    with terminal_progress(stream=out, force=True) as cb:
        cb(ProgressEvent("restore", 0, 4000, "KiB"))
        started = time.monotonic()
        while time.monotonic() - started < 0.2:  # at least 0.2 s pass before the burst
            time.sleep(0.01)
        cb(ProgressEvent("restore", 2000, 4000, "KiB"))
        cb(ProgressEvent("restore", 4000, 4000, "KiB"))
    rates = [float(r.replace(",", "")) for r in re.findall(r"([\d,]+\.\d) KiB/s", out.getvalue())]
    assert rates and max(rates) <= 4000 / 0.2, out.getvalue()
    assert "4000/4000" in out.getvalue()


def run_on_a_terminal(args: list[str]) -> tuple[int, str]:
    """``abs-snapshot ARGS`` with stderr on a pseudo-terminal; returns its exit code and what
    the terminal showed."""
    leader, follower = pty.openpty()
    env = dict(os.environ, COLUMNS="120", TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "abs.cli", *args], stdout=subprocess.DEVNULL, stderr=follower,
                            stdin=subprocess.DEVNULL, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return proc.wait(timeout=300), b"".join(chunks).decode(errors="replace")


def test_the_cli_draws_progress_on_a_terminal_and_stays_quiet_otherwise(root, capsys):
    code, shown = run_on_a_terminal(["verify", root])
    assert code == 0 and "verify" in shown and "files" in shown, shown
    code, shown = run_on_a_terminal(["verify", root, "--quiet"])
    assert code == 0 and "files" not in shown, shown
    from abs.cli import main

    assert main(["verify", root]) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal here


# ----------------------------------------------------------------------------- a job's restore
RESTORE_JOB = """
import sys
import pyarrow as pa
import abs

def keep(ctx, row):
    ctx.state.v.update(row["value"])

flow = abs.Dataflow("restore-progress")
flow.source("src", abs.GeneratorSource(200_000, num_keys=200_000, batch_size=8192)).key_by("key") \\
    .process("keep", keep, state=[abs.ValueState("v", pa.int64())])
mode = sys.argv[2]
runtime = abs.RuntimeOptions(progress=False) if mode == "off" else abs.RuntimeOptions()
if mode == "write":
    abs.run(flow, parallelism=2, storage=sys.argv[1], checkpoint=abs.CheckpointConfig(interval=None))
else:
    abs.run(flow, parallelism=2, storage=sys.argv[1], restore="latest", runtime=runtime)
"""


def _job_on_a_terminal(script: str, *args: str) -> str:
    leader, follower = pty.openpty()
    env = dict(os.environ, COLUMNS="120", TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.DEVNULL, stderr=follower,
                            stdin=subprocess.DEVNULL, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=600) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_a_restore_reports_the_bytes_read_of_the_bytes_assigned(tmp_path):
    root = str(tmp_path / "root")
    subprocess.run([sys.executable, "-c", RESTORE_JOB, root, "write"], check=True, timeout=600)
    events = []
    flow = abs.Dataflow("restore-progress")
    flow.source("src", abs.GeneratorSource(200_000, num_keys=200_000, batch_size=8192)).key_by("key") \
        .process("keep", _keep, state=[abs.ValueState("v", pa.int64())])
    result = abs.run(flow, parallelism=2, storage=root, restore="latest",
                     runtime=abs.RuntimeOptions(progress=events.append))
    assert result.restored_from is not None
    assert {e.stage for e in events} == {"restore"} and events[0].done == 0
    total_kib = sum(result.bytes_restored_per_worker) // 1024
    assert events[-1].done == events[-1].total == total_kib > 0
    assert [e.done for e in events] == sorted(e.done for e in events)
    # on a terminal: a bar; with progress=False: none
    shown = _job_on_a_terminal(RESTORE_JOB, root, "auto")
    assert "restore" in shown and "KiB" in shown, shown
    assert "KiB" not in _job_on_a_terminal(RESTORE_JOB, root, "off")


def _keep(ctx, row):
    ctx.state.v.update(row["value"])

"""Start-up: what a local job imports (in the driver and in its workers)."""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

import abs
from abs.runtime.forked import ForkedWorker, fork_refusal

# Extras and heavy modules that a local job never needs: importing any of them costs start-up
# time (pyspark alone: seconds) in the driver and in every worker.
NEVER_LOCAL = ("pyspark", "s3fs", "pandas", "matplotlib", "rich", "prometheus_client", "boto3", "moto")

JOB = textwrap.dedent(
    """
    import json, sys
    import pyarrow as pa
    import abs

    NEVER = {never!r}
    STORAGE = {storage!r}
    START = {start!r}

    def loaded():
        # fsspec neither: no storage, or a local root (plain os calls, see storage.backend)
        return sorted(m for m in sys.modules if m.split(".")[0] in NEVER or m == "fsspec")

    def count(ctx, row):
        n = ctx.state.n
        n.update((n.value() or 0) + 1)
        if n.value() == 1:
            ctx.emit({{"key": ctx.key, "modules": json.dumps(loaded())}})

    if __name__ == "__main__":
        flow = abs.Dataflow("imports")
        flow.source("src", abs.GeneratorSource(200, num_keys=10, num_splits=2)).key_by("key").process(
            "count", count, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
        options = {{}} if STORAGE is None else {{"storage": STORAGE, "checkpoint": abs.CheckpointConfig()}}
        result = abs.run(flow, parallelism=2, executor=abs.LocalExecutor(start=START), **options)
        workers = sorted(set(result.collected("out").column("modules").to_pylist()))
        print(json.dumps({{"driver": loaded(), "workers": workers}}))
    """
)


def _modules_of_a_local_job(tmp_path, storage: str | None, start: str = "auto") -> dict:
    script = tmp_path / "job.py"
    script.write_text(JOB.format(never=NEVER_LOCAL, storage=storage, start=start))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("start", ["auto", "spawn"])
def test_a_local_job_imports_no_spark_no_extras_and_no_fsspec_in_driver_or_workers(tmp_path, start):
    seen = _modules_of_a_local_job(tmp_path, str(tmp_path / "root"), start)
    assert seen["driver"] == [], f"the driver of a local job imported {seen['driver']}"
    assert seen["workers"] == ["[]"], f"the workers of a local job imported {seen['workers']}"


def test_a_job_without_storage_imports_no_file_system_layer(tmp_path):
    seen = _modules_of_a_local_job(tmp_path, None, "spawn")
    assert seen["driver"] == [], f"the driver of a job without storage imported {seen['driver']}"
    assert seen["workers"] == ["[]"], f"the workers of a job without storage imported {seen['workers']}"


# ---------------------------------------------------------------- forked workers
needs_fork = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="forked workers need Linux pidfds")


@needs_fork
def test_fork_is_refused_while_another_thread_runs():
    alone = threading.active_count() == 1  # earlier tests of a run may leave threads (servers) behind
    release = threading.Event()
    other = threading.Thread(target=release.wait, name="holder", daemon=True)
    other.start()
    try:
        refusal = fork_refusal()
        assert refusal is not None and "other thread" in refusal
        if alone:
            assert "holder" in refusal  # the refusal names the thread
    finally:
        release.set()
        other.join()


def test_local_executor_refuses_an_unknown_start_method():
    with pytest.raises(abs.ConfigError, match=r"start='forkserver'.*'auto'.*'spawn'"):
        abs.LocalExecutor(start="forkserver")


def _child(body) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(70)
    return pid


@needs_fork
def test_a_forked_worker_reports_its_exit_code_and_its_kill_like_popen():
    exits = ForkedWorker(_child(lambda: os._exit(3)))
    assert exits.wait(timeout=60) == 3 and exits.poll() == 3
    r, w = os.pipe()
    blocked = ForkedWorker(_child(lambda: os.read(r, 1)))
    try:
        assert blocked.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            blocked.wait(timeout=0.01)
        blocked.kill()
        assert blocked.wait(timeout=60) == -signal.SIGKILL
        blocked.kill()  # reaped: a no-op, never a signal to a reused pid
    finally:
        os.close(r)
        os.close(w)


FREEZE_JOB = textwrap.dedent(
    """
    import gc, json
    import pyarrow as pa
    import abs

    def count(ctx, row):
        n = ctx.state.n
        n.update((n.value() or 0) + 1)
        if n.value() == 1:
            ctx.emit({"key": ctx.key, "frozen": gc.get_freeze_count()})

    def run():
        flow = abs.Dataflow("freeze")
        flow.source("src", abs.GeneratorSource(100, num_keys=5, num_splits=1)).key_by("key").process(
            "count", count, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
        result = abs.run(flow, parallelism=1, executor=abs.LocalExecutor(start="auto"))
        return min(result.collected("out").column("frozen").to_pylist())

    if __name__ == "__main__":
        worker = run()
        driver = gc.get_freeze_count()
        gc.freeze()  # the application's own freeze
        own = gc.get_freeze_count()
        run()
        print(json.dumps({"worker": worker, "driver": driver, "own": own, "after": gc.get_freeze_count()}))
    """
)


@needs_fork
def test_a_forked_worker_keeps_the_driver_objects_frozen_and_the_driver_gets_its_freeze_back(tmp_path):
    script = tmp_path / "freeze_job.py"
    script.write_text(FREEZE_JOB)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["worker"] > 0, "the worker's collections examine the objects it shares with the driver"
    assert seen["driver"] == 0, "the driver's objects stayed frozen after its worker was forked"
    assert seen["after"] == seen["own"] > 0, "a job changed the application's own freeze"


_HEAP_CYCLES = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from abs.runtime.worker_main import keep_freed_heap
    if sys.argv[1] == "keep":
        keep_freed_heap()

    def checkpoint():  # a task's copies of 128 key groups of 7.8 k int64 keys and values, then freed
        copies = [np.ones(7812, np.int64) for _ in range(256)]
        del copies

    checkpoint()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        checkpoint()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt: keep_freed_heap does nothing elsewhere")
def test_a_workers_freed_heap_serves_the_next_checkpoints_copies_without_page_faults():
    """keep_freed_heap (a worker calls it at start): the pages a checkpoint's copies freed are
    the next checkpoint's, not handed back to the kernel and faulted in again 4 KB at a time."""
    faults = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", _HEAP_CYCLES, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        faults[mode] = int(out.stdout)
    assert faults["default"] > 5 * 1000  # 16 MB a cycle, 5 cycles: ~4 k pages each when handed back
    assert faults["keep"] < faults["default"] / 20, faults


@pytest.mark.integration
@pytest.mark.parametrize("driver", ["refuses", "hangs_up"])
def test_a_worker_whose_driver_is_gone_says_so_in_one_line(driver):
    """A driver killed (kill -9) while its workers start: a worker that finds no driver to
    connect to, or one that hangs up before it sends the job, exits 1 with one line naming the
    driver's address (it printed a Python traceback of multiprocessing.connection)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if driver == "refuses":
        listener.close()  # nothing listens there any more
    else:
        def hang_up() -> None:
            conn, _ = listener.accept()
            conn.close()
            listener.close()

        threading.Thread(target=hang_up, daemon=True).start()
    boot = {"secret": os.urandom(16).hex(), "index": 3, "driver": ["127.0.0.1", port]}
    proc = subprocess.run([sys.executable, "-c", "from abs.runtime.worker_main import main; main()"],
                          input=json.dumps(boot) + "\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "worker 3" in lines[0] and f"127.0.0.1:{port}" in lines[0], proc.stderr
    assert "is gone" in lines[0]

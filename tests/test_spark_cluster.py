"""Jobs on a real Spark standalone cluster (scripts/cluster.py): a master, two worker JVMs of
one core each and an S3 server (moto) as the storage both "hosts" share. As root with
``ip netns`` (Linux), each worker runs in its own network namespace on a private bridge:
the workers, the driver and the S3 server are different addresses and nothing crosses by
loopback; elsewhere every daemon is on 127.0.0.1 (the run says which, and why).

Each job's driver is its own process (tests/cluster_job.py): a process holds one
SparkContext, and the rest of the suite shares a ``local[4]`` one.

- the counting job gives the local launcher's results, its records counted in two
  different namespaces (hosts) when they exist, channels and the per-job secret across them;
- an abs worker process killed with SIGKILL, then a Spark executor JVM killed with SIGKILL:
  each time the job restores the latest checkpoint from S3 and its output is exact;
- a job needing more slots than the cluster has fails at once, naming free and needed slots.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.integration, pytest.mark.cluster]

TOTAL, KEYS = 30_000, 250  # as in tests/cluster_job.py
EXPECTED = {str(k): list(range(1, n + 1)) for k, n in collections.Counter((np.arange(TOTAL) % KEYS).tolist()).items()}


def _cluster_module() -> Any:
    spec = importlib.util.spec_from_file_location("abs_cluster", HERE.parent / "scripts" / "cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


cluster_script = _cluster_module()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request) -> Iterator[dict]:
    """Two workers (one core, 1 GB each), netns when this machine allows it; stopped (and
    checked stopped) at the end of the module, whatever happened."""
    pytest.importorskip("pyspark")
    pytest.importorskip("moto.server")
    if not sys.platform.startswith("linux") or shutil.which("java") is None:
        pytest.skip("the test cluster needs Linux and a Java runtime (java on PATH)")
    why_not = cluster_script.netns_available()
    directory = str(tmp_path_factory.mktemp("cluster"))
    state = cluster_script.up(hosts=2, netns=why_not is None, directory=directory)
    mode = ("each worker in its own network namespace on a private bridge" if why_not is None else
            f"every daemon on 127.0.0.1 (no network namespaces: {why_not})")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[cluster] {state['master_url']}: {mode}")
    state["mode"] = mode
    try:
        yield state
    finally:
        cluster_script.down(directory)
        left = [name for name, proc in state["processes"].items() if cluster_script.alive(proc)]
        assert not left, f"scripts/cluster down left {left} running"
        if state["namespaces"]:
            names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert not [ns for ns in state["namespaces"] if ns in names], "scripts/cluster down left a namespace"


def run_driver(cluster: dict, scenario: str, work: Path) -> dict:
    """Run tests/cluster_job.py SCENARIO against the cluster; its result as a dict."""
    work.mkdir(parents=True, exist_ok=True)
    state_file = Path(cluster["dir"]) / cluster_script.STATE_FILE
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    with open(work / "driver.log", "wb") as log:
        proc = subprocess.run([sys.executable, str(HERE / "cluster_job.py"), str(state_file), scenario, str(work)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=280)
    tail = (work / "driver.log").read_text(errors="replace")[-3000:]
    assert proc.returncode == 0 and (work / "result.json").exists(), f"the driver failed:\n{tail}"
    result = json.loads((work / "result.json").read_text())
    assert "exception" not in result, f"{result['exception']}\n--- driver log:\n{tail}"
    return result


def test_a_job_on_the_cluster_gives_the_local_launchers_results(cluster, tmp_path):
    status = cluster_script.status(cluster["dir"])
    assert status["workers_alive"] == 2 and all(status["processes"].values()), status
    result = run_driver(cluster, "same", tmp_path)
    assert result["status"] == "FINISHED"
    assert result["checkpoints"] >= 2, "checkpoints are taken on S3 while the stage runs"
    assert result["spark"] == result["local"] == EXPECTED
    if cluster["netns"]:
        # records were counted by two workers in two namespaces other than the driver's: the
        # keyed channels between them, and their connections to the driver (each
        # authenticated with the job's secret), went over the bridge
        assert len(result["nets"]) == 2 and result["driver_net"] not in result["nets"], (cluster["mode"], result["nets"])


def test_a_worker_process_killed_on_the_cluster_recovers_with_exact_output(cluster, tmp_path):
    # a real SIGKILL of worker 1 (the child process of Spark task 1, on one of the hosts)
    # right after the 2nd checkpoint's manifest is committed on S3
    result = run_driver(cluster, "kill-worker", tmp_path)
    assert result["status"] == "FINISHED"
    assert len(result["restarts"]) == 1, result["restarts"]
    assert result["restored_from"] == [2], "the second stage restored the latest checkpoint"
    assert result["spark"] == EXPECTED


def test_a_spark_executor_jvm_killed_on_the_cluster_recovers_with_exact_output(cluster, tmp_path):
    # SIGKILL of host 1's executor JVM after the first checkpoint: its task, Python worker and
    # abs worker die with it; the master starts a new executor on that worker and the driver
    # restores the checkpoint on a new barrier stage once the slots are back
    result = run_driver(cluster, "kill-executor", tmp_path)
    assert result["killed_executors"], "host 1 runs an executor of the job"
    assert result["status"] == "FINISHED"
    assert len(result["restarts"]) >= 1, result
    assert result["restored_from"][0] >= result["killed_after_checkpoint"] >= 1
    assert result["spark"] == EXPECTED


def test_a_job_needing_more_slots_than_the_cluster_has_fails_naming_free_and_needed(cluster, tmp_path):
    result = run_driver(cluster, "slots", tmp_path)
    error = result["error"] or ""
    assert "needs 3 task slots" in error and "has 2 slot(s), 2 free" in error, error
    assert "spark.cores.max" in error, error


# ------------------------------------------------------------------- without a cluster
def test_a_loopback_driver_address_is_refused_only_with_a_master_elsewhere():
    from abs.runtime.spark import driver_address_problem

    assert driver_address_problem("local[4]", "127.0.0.1") is None
    assert driver_address_problem("spark://127.0.0.1:7077", "localhost") is None
    assert driver_address_problem("spark://10.1.2.3:7077", "10.1.2.1") is None
    problem = driver_address_problem("spark://10.1.2.3:7077", "localhost")
    assert problem is not None and "spark.driver.host" in problem and "driver_host=" in problem


def test_down_without_a_recorded_cluster_says_how_to_start_one(tmp_path, capsys):
    assert cluster_script.main(["down", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no cluster recorded" in err and "scripts/cluster up" in err

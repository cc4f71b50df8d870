"""Jobs on a real Spark standalone cluster (scripts/cluster.py): a master, three worker JVMs of
one core each and an S3 server (moto) as the storage the "hosts" share. Jobs run two abs
workers (one barrier stage of two tasks, on two hosts); the third core runs the tasks of a
streaming query beside them. As root with
``ip netns`` (Linux), each worker runs in its own network namespace on a private bridge:
the workers, the driver and the S3 server are different addresses and nothing crosses by
loopback; elsewhere (or with ``ABS_TEST_CLUSTER_NETNS=off``) every daemon is on 127.0.0.1
(the run says which, and why).

The jobs' driver is its own process (tests/cluster_job.py, one Spark application for every
scenario): a process holds one SparkContext, and the rest of the suite shares a ``local[4]`` one.

- the counting job gives the local launcher's results, its records counted in two
  different namespaces (hosts) when they exist, channels and the per-job secret across them;
- an abs worker process killed with SIGKILL, then (in the restarted attempt) a Spark executor
  JVM killed with SIGKILL: each time the job restores the latest checkpoint from S3 and its
  output is exact;
- a job needing more slots than the cluster has fails at once, naming free and needed slots;
- a Spark file stream through the micro-batch bridge, staged on S3 by the query's tasks on
  the cluster's executors, counted on the cluster's workers, stays exactly-once across an
  executor JVM killed mid-stream;
- Spark's rate source (unbounded) the same way, the job canceled after its restore: exactly
  the rows its checkpoints' offsets cover are committed, none twice;
- a whole host lost (every process of it killed): the job restores on the two others, exact;
- then a job of two workers on the two hosts left loses one of them: it restarts with one
  worker (``RestartStrategy(min_workers=1)``), and once the host is started again it rescales
  back to two workers while it runs, exact;
- on the S3 root the counting job wrote: ``abs-snapshot ls/show/verify``, the ``abs-snapshot``
  data source (its checkpoints table and the state, read by several tasks), offline
  ``savepoint --spark`` and ``rekey --spark`` with the cluster's master (their state checked
  back), and a connection with a wrong per-job secret from an executor refused.
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
# the first test also starts the cluster and runs the driver's scenarios (module fixtures)
pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.timeout(720)]

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
    """Three workers (one core, 1 GB each), netns when this machine allows it; stopped (and
    checked stopped) at the end of the module, whatever happened."""
    pytest.importorskip("pyspark")
    pytest.importorskip("moto.server")
    if not sys.platform.startswith("linux") or shutil.which("java") is None:
        pytest.skip("the test cluster needs Linux and a Java runtime (java on PATH)")
    why_not = cluster_script.netns_available()
    if os.environ.get("ABS_TEST_CLUSTER_NETNS", "").lower() in ("0", "off", "no"):
        why_not = "turned off by ABS_TEST_CLUSTER_NETNS"
    directory = str(tmp_path_factory.mktemp("cluster"))
    state = cluster_script.up(hosts=3, netns=why_not is None, directory=directory)
    mode = ("each worker in its own network namespace on a private bridge" if why_not is None else
            f"every daemon on 127.0.0.1 (no network namespaces: {why_not})")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
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


# tools right after same (it reads the root same wrote); kill-host late: the host stays lost;
# shrink after it (two hosts left: losing one leaves one slot)
SCENARIOS = ("same", "tools", "failover", "microbatch", "rate", "kill-host", "shrink")


@pytest.fixture(scope="module")
def driver(cluster, tmp_path_factory) -> dict:
    """One driver process (one Spark application: its executors start once) runs the
    scenarios of tests/cluster_job.py in turn against the cluster; their results by name."""
    work = tmp_path_factory.mktemp("driver")
    state_file = Path(cluster["dir"]) / cluster_script.STATE_FILE
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    with open(work / "driver.log", "wb") as log:
        proc = subprocess.run([sys.executable, str(HERE / "cluster_job.py"), str(state_file), str(work), *SCENARIOS],
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600)
    results = json.loads((work / "result.json").read_text()) if (work / "result.json").exists() else {}
    results["_log"] = (work / "driver.log").read_text(errors="replace")[-3000:]
    results["_returncode"] = proc.returncode
    return results


def result_of(driver: dict, scenario: str) -> dict:
    for failed in ("session", scenario):
        if "exception" in driver.get(failed, {}):
            pytest.fail(f"{failed}: {driver[failed]['exception']}\n--- driver log:\n{driver['_log']}")
    assert scenario in driver, f"the driver (exit code {driver['_returncode']}) did not run {scenario!r}:\n{driver['_log']}"
    return driver[scenario]


def test_the_cluster_is_up_with_every_worker_registered(cluster):
    status = cluster_script.status(cluster["dir"])
    assert status["workers_alive"] == 3 and all(status["processes"].values()), status


def test_a_job_on_the_cluster_gives_the_local_launchers_results(cluster, driver):
    result = result_of(driver, "same")
    assert result["status"] == "FINISHED"
    assert result["checkpoints"] >= 2, "checkpoints are taken on S3 while the stage runs"
    assert result["spark"] == result["local"] == EXPECTED
    if cluster["netns"]:
        # records were counted by two workers in two namespaces other than the driver's: the
        # keyed channels between them, and their connections to the driver (each
        # authenticated with the job's secret), went over the bridge
        assert len(result["nets"]) == 2 and result["driver_net"] not in result["nets"], (cluster["mode"], result["nets"])


def test_a_job_needing_more_slots_than_the_cluster_has_fails_naming_free_and_needed(cluster, driver):
    error = result_of(driver, "same")["slots_error"] or ""
    cores = cluster["cores"]
    assert f"needs {cores + 1} task slots" in error and f"has {cores} slot(s), {cores} free" in error, error
    assert "spark.cores.max" in error, error


def test_snapshot_tools_and_the_data_source_read_the_cluster_jobs_checkpoints_on_s3(driver):
    result = result_of(driver, "tools")
    for command in ("ls", "show", "verify"):
        assert result[command]["code"] == 0, (command, result[command])
    assert result["checkpoint_ids"], "the data source's checkpoints table lists the job's checkpoints"
    assert all(str(cid) in result["ls"]["out"] for cid in result["checkpoint_ids"]), result["ls"]
    # the final state read back on the executors: every key counted TOTAL / KEYS times
    assert result["state"] == {k: len(v) for k, v in EXPECTED.items()}
    assert result["partitions"] > 1, "the key groups are read by several tasks"


def test_offline_savepoint_and_rekey_with_spark_run_on_the_clusters_master(driver):
    result = result_of(driver, "tools")
    for step in ("savepoint", "rekey", "verify_sp", "verify_rekey"):
        assert result[step]["code"] == 0, (step, result[step])
    expected = {k: len(v) for k, v in EXPECTED.items()}
    assert result["sp_state"] == expected and result["rekey_state"] == expected
    assert 32 <= result["rekey_max_key_group"] < 64, "the keys were hashed into the new 64 key groups (were 32)"


def test_a_wrong_per_job_secret_is_refused_across_hosts(cluster, driver):
    # a Spark task connects to a listener of the driver process as abs's channels do: with a
    # wrong key the handshake fails on both ends, with the right one its hello arrives
    result = result_of(driver, "tools")
    net, got = result["secret_task"]
    assert got == ["AuthenticationError", "accepted"], got
    assert result["secret_driver"][0][0] == "AuthenticationError", result["secret_driver"]
    assert result["secret_driver"][1] == ["accepted", net]
    if cluster["netns"]:
        assert net != result_of(driver, "same")["driver_net"], "the task ran on another host"


def test_a_killed_worker_process_then_a_killed_executor_jvm_recover_with_exact_output(driver):
    # attempt 0: a real SIGKILL of abs worker 1 (the child process of Spark task 1, on one of
    # the hosts) right after checkpoint 2's manifest is committed on S3; attempt 1: once it
    # completed checkpoint 3, SIGKILL of the executor JVM of a host running an abs worker (its
    # task, Python worker and abs worker die with it; the master starts a new executor on
    # that worker and the driver restores on a new barrier stage once the slots are back)
    result = result_of(driver, "failover")
    assert result["killed_executors"], "a host running an abs worker has an executor"
    assert result["status"] == "FINISHED"
    assert len(result["restarts"]) == 2, result["restarts"]
    assert result["restored_from"][0] == 2, "the second stage restored the latest checkpoint"
    assert result["restored_from"][1] >= result["killed_after_checkpoint"] >= 3, result
    assert result["spark"] == EXPECTED


def test_a_spark_file_stream_staged_on_s3_is_exactly_once_across_a_killed_executor(driver):
    # 4 JSON files of 300 rows, one micro-batch each (written as Parquet on S3 by the
    # executors' tasks, the driver's foreachBatch only lists the parts), read by two abs
    # workers on two hosts; paced, so that the kill after the first checkpoint falls mid-stream
    result = result_of(driver, "microbatch")
    assert result["killed_executors"], "a host running an abs worker has an executor"
    assert result["status"] == "FINISHED"
    assert len(result["restarts"]) >= 1, result
    keys = collections.Counter(i % 37 for i in range(result["total"]))
    assert result["spark"] == {str(k): list(range(1, n + 1)) for k, n in keys.items()}, "each row counted once"
    assert result["active_queries"] == 0, "the streaming query is stopped when the job ends"
    # the micro-batches were staged on S3 by the query's tasks on the cluster, not by the driver
    assert result["writers"] and result["driver_writer"] not in result["writers"], result["writers"]


def test_the_rate_source_staged_on_s3_is_exactly_once_across_a_killed_executor(driver):
    # unbounded: the job is canceled once it counted rows after its restore; the committed
    # output holds every row the second-latest checkpoint's offsets cover, none beyond the
    # latest's, none twice, and every key's counts run 1..n
    result = result_of(driver, "rate")
    assert result["killed_executors"], "a host running an abs worker has an executor"
    assert result["status"] == "CANCELED" and len(result["restarts"]) == 1, result
    assert result["ids"] == result["distinct"] > 0, "a row counted twice"
    assert result["missing"] == 0 and result["beyond"] == 0, result
    assert all(v == list(range(1, len(v) + 1)) for v in result["spark"].values())
    assert result["active_queries"] == 0, "the streaming query is stopped when the job ends"


def test_a_whole_host_lost_mid_job_recovers_on_the_remaining_hosts_with_exact_output(driver):
    result = result_of(driver, "kill-host")
    assert result["killed"], "a host runs an abs worker"
    assert result["status"] == "FINISHED"
    assert len(result["restarts"]) == 1, result["restarts"]
    assert result["restored_from"][0] >= result["killed_after_checkpoint"] >= 1
    assert result["spark"] == EXPECTED


def test_a_lost_host_whose_slots_do_not_come_back_leaves_the_job_on_fewer_workers_then_it_rescales_back(driver):
    # after kill-host two one-core hosts are left; the job's two workers run on both; one
    # host is lost: the restart waits slot_wait for two slots, finds one and goes on with
    # one worker (min_workers=1); the host is started again, its executor registers, and the
    # driver rescales the job back to two workers while it runs
    result = result_of(driver, "shrink")
    assert result["killed"], "a host runs an abs worker"
    assert result["workers_after_restart"] == 1, result
    assert result["workers_after_rescale"] == 2, result
    assert result["status"] == "FINISHED" and result["parallelism"] == 2, result
    assert len(result["restarts"]) == 1 and result["restarts"][0]["workers"] == "1", result["restarts"]
    assert result["spark"] == EXPECTED


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

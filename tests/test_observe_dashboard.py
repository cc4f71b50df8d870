"""The live dashboard of a running job (abs.observe): its JSON, its token, and the page in
a real browser (Chromium through Playwright, see tests/browser.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

import abs
from abs.errors import ConfigError
from abs.observe import Dashboard
from browser import browser_page
from pacing import PacedSource

DOCS = Path(__file__).resolve().parent.parent / "docs"


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def held_flow(gate: str) -> abs.Dataflow:
    """Counts per key; each reader emits 500 records per completed checkpoint and stops at
    5,000 until ``gate`` exists (never, here): the job runs, and checkpoints, until canceled."""
    flow = abs.Dataflow("dashboard-counts")
    src = PacedSource(abs.GeneratorSource(40_000, num_keys=64, num_splits=4, batch_size=100), 500, hold=5_000, gate=gate)
    flow.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]) \
        .sink("out", abs.CollectSink())
    return flow


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def running_job(tmp_path):
    job = abs.submit(held_flow(str(tmp_path / "never-opened")), parallelism=2, storage=str(tmp_path / "root"),
                     checkpoint=abs.CheckpointConfig(interval=0.5), dashboard=True)
    try:
        deadline = time.monotonic() + 120
        while job.status == "CREATED" and time.monotonic() < deadline:  # workers starting
            time.sleep(0.02)
        assert job.status == "RUNNING", job.status
        yield job
    finally:
        job.cancel()


def test_dashboard_options_parse_and_refuse_bad_values():
    assert Dashboard.parse(True) == Dashboard() and Dashboard.parse(None) is None and Dashboard.parse(False) is None
    assert Dashboard.parse("0.0.0.0:8081") == Dashboard(host="0.0.0.0", port=8081)
    for bad in ("nowhere", 8081, "host:port"):
        with pytest.raises(ConfigError, match="dashboard must be"):
            Dashboard.parse(bad)
    with pytest.raises(ConfigError, match="port"):
        Dashboard(port=70000)
    with pytest.raises(ConfigError, match="16 characters"):
        Dashboard(token="short")


def test_every_request_without_the_job_token_is_refused(running_job):
    server = running_job.dashboard
    base = server.base_url
    for path in ("/", "/api/job", "/metrics", "/api/job?token=wrong" + "x" * 20):
        status, body = get(base + path)
        assert status == 403 and b"token" in body, path
    request = urllib.request.Request(base + "/api/checkpoint", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 403
    status, body = get(base + "/api/job?token=" + server.token)
    job = json.loads(body)
    assert status == 200 and job["job"] == "dashboard-counts" and job["parallelism"] == 2
    assert [t["operators"][0]["uid"] for t in job["graph"]["tasks"]] == ["src", "count"]
    assert job["graph"]["edges"] == [{"from": "task0", "to": "task1", "partition": "key_by"}]
    # an Authorization header serves as well (a Prometheus scrape config's bearer token)
    request = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {server.token}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        scraped = {s.name: s.value for fam in text_string_to_metric_families(r.read().decode()) for s in fam.samples
                   if s.labels.get("job") == "dashboard-counts" and "operator" not in s.labels}
    assert scraped["abs_job_parallelism"] == 2 and scraped["abs_job_up"] == 1
    # counted before and after the scrape: the job checkpoints all the while
    assert job["checkpoints"]["counts"]["completed"] <= scraped["abs_job_checkpoints_completed_total"] \
        <= len(running_job._driver.completed)


def test_the_page_shows_the_checkpoint_table_growing_and_a_triggered_checkpoint_completing(running_job, tmp_path):
    server = running_job.dashboard
    completed_rows = "#checkpoints tbody tr[data-status=COMPLETED]"
    with browser_page(tmp_path) as page:
        page.goto(server.url)
        page.wait_for_function("document.getElementById('status').textContent === 'RUNNING'")
        page.wait_for_function(f"document.querySelectorAll({completed_rows!r}).length >= 2")
        seen = page.locator(completed_rows).count()
        # the page refreshes by itself: more rows come without a reload
        page.wait_for_function(f"document.querySelectorAll({completed_rows!r}).length > {seen}")
        assert page.locator("#graph g.task").count() == 2

        page.click("#trigger-checkpoint")
        page.wait_for_function("/checkpoint \\d+ completed/.test(document.getElementById('action-result').textContent)")
        triggered = int(re.search(r"checkpoint (\d+) completed", page.text_content("#action-result")).group(1))
        assert triggered in [c.checkpoint_id for c in running_job._driver.completed]
        row = page.locator(f"#checkpoints tbody tr[data-id='{triggered}'][data-status=COMPLETED]")
        row.wait_for()
        row.click()  # its per-task figures: 2 tasks x 2 subtasks
        page.wait_for_function("document.querySelectorAll('#checkpoints tr.detail table.tasks tbody tr').length === 4")
        stats = next(c for c in running_job._driver.completed if c.checkpoint_id == triggered)
        cells = row.locator("td").all_text_contents()
        assert cells[0] == str(triggered) and cells[9] == str(stats.files_written)

        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("ABS_UPDATE_SCREENSHOTS"):  # the README's picture
            shutil.copy(shot, DOCS / "dashboard.png")

        page.click("#trigger-savepoint")
        page.wait_for_function("/savepoint written to /.test(document.getElementById('action-result').textContent)")
        location = page.text_content("#action-result").split("savepoint written to ", 1)[1]
        assert "savepoints/sp-" in location
        assert Path(location.removeprefix("file://")).exists()

        refused = page.goto(server.base_url + "/?token=" + "0" * 32)
        assert refused is not None and refused.status == 403


def test_task_figures_split_what_a_task_wrote_into_bases_and_deltas():
    from types import SimpleNamespace

    from abs.observe.snapshot import task_figures
    from storage import FileRef, StoragePaths

    def ref(cid: int, kind: str, kg: int, size: int) -> FileRef:
        return FileRef(path=StoragePaths.state_file(cid, "count", "n", kg, kind, f"{cid:032x}"), kind=kind,
                       checkpoint_id=cid, rows=1, bytes=size, checksum="a" * 32, checksum_algorithm="xxh3_128")

    old_base, new_delta, new_base = ref(3, "base", 0, 100), ref(5, "delta", 0, 7), ref(5, "base", 1, 40)
    ack = SimpleNamespace(keyed={"count": {"n": {0: [old_base, new_delta], 1: [new_base]}}}, alignment_time=0.5,
                          sync_time=0.01, async_time=0.2, bytes_written=47, files_written=2)
    figures = task_figures(5, {"task1#0": ack})["task1#0"]
    assert figures == {"alignment_s": 0.5, "sync_s": 0.01, "async_s": 0.2, "bytes_written": 47, "files_written": 2,
                       "base_bytes_written": 40, "delta_bytes_written": 7, "state_bytes": 147}


def test_run_with_a_dashboard_returns_the_same_result_logs_the_url_and_stops_the_server(tmp_path, caplog):
    flow = abs.Dataflow("dashboard-run")
    flow.source("src", abs.GeneratorSource(2_000, num_keys=10, num_splits=2, batch_size=100)).key_by("key") \
        .process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
    with caplog.at_level("INFO", logger="abs.observe"):
        result = abs.run(flow, parallelism=2, storage=str(tmp_path / "root"), checkpoint=abs.CheckpointConfig(),
                         dashboard=True)
    assert result.status == "FINISHED" and result.collected("out").num_rows == 2_000
    (url,) = re.findall(r"dashboard at (http://127\.0\.0\.1:\d+/\?token=\S+)", caplog.text)
    with pytest.raises(urllib.error.URLError):  # the server ended with the job
        urllib.request.urlopen(url, timeout=10)


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_a_dashboard_on_the_ipv6_loopback_serves_the_job(tmp_path):
    """Dashboard.parse takes "[::1]:PORT" and base_url brackets an IPv6 host, but the server
    bound IPv4 only: "cannot listen on ::1:0 ([Errno -9] Address family for hostname not
    supported)"."""
    job = abs.submit(held_flow(str(tmp_path / "never-opened")), parallelism=1, dashboard="[::1]:0")
    try:
        assert job.dashboard.base_url.startswith("http://[::1]:")
        status, body = get(f"{job.dashboard.base_url}/metrics?token={job.dashboard.token}")
        assert status == 200 and b'abs_job_up{job="dashboard-counts"' in body
    finally:
        job.cancel()


def restarting_job(tmp_path, delay: float) -> abs.JobHandle:
    """A held job with a dashboard whose worker 0 fails at its 1,000th record, restarted once
    after ``delay`` seconds."""
    from abs.faults import Fault

    return abs.submit(held_flow(str(tmp_path / "never-opened")), parallelism=2, storage=str(tmp_path / "root"),
                      checkpoint=abs.CheckpointConfig(interval=0.3), dashboard=True,
                      restart=abs.RestartStrategy(max_restarts=1, delay=delay),
                      runtime=abs.RuntimeOptions(faults=[Fault("records", "task1#0", nth=1_000)]))


def test_a_restart_shows_with_its_cause_in_the_json_and_the_metrics(tmp_path):
    job = restarting_job(tmp_path, delay=0.0)
    server = job.dashboard
    try:
        deadline = time.monotonic() + 180
        snap: dict = {}
        while time.monotonic() < deadline:  # the job restarts once the fault killed worker 0
            snap = json.loads(get(server.base_url + "/api/job?token=" + server.token)[1])
            if snap["restarts"] and snap["status"] == "RUNNING":
                break
            time.sleep(0.1)
        (restart,) = snap["restarts"]
        assert restart["attempt"] == 1 and "worker 0" in restart["error"], restart
        status, body = get(server.base_url + "/metrics?token=" + server.token)
        assert status == 200 and 'abs_job_restarts_total{job="dashboard-counts"} 1.0' in body.decode()
    finally:
        job.cancel()


def test_the_page_lists_live_reconfigurations_and_the_assignment_in_force(running_job, tmp_path):
    server = running_job.dashboard
    with browser_page(tmp_path) as page:
        page.goto(server.url)
        page.wait_for_function("document.getElementById('status').textContent === 'RUNNING'")
        page.wait_for_function("document.getElementById('assignment').textContent.includes('w0: 0-63')")
        rec = running_job.move(range(8), to=1, strategy="batched", batch=4)
        page.wait_for_function("document.querySelector('#reconfigurations tbody').textContent.includes('COMPLETED')")
        cells = page.locator("#reconfigurations tbody tr").first.locator("td").all_text_contents()
        assert cells[:5] == ["1", "move, batched", "COMPLETED", "2", "8"]
        assert cells[7] == rec.after == "w0: 8-63; w1: 0-7,64-127"
        page.wait_for_function("document.getElementById('assignment').textContent.includes('w0: 8-63')")
    job = json.loads(get(f"{server.base_url}/api/job?token={server.token}")[1])
    (r,) = job["reconfigurations"]
    assert r["status"] == "COMPLETED" and [s["key_groups"] for s in r["steps"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert r["bytes_moved"] == rec.bytes_moved > 0
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(get(f"{server.base_url}/metrics?token={server.token}")[1].decode())
               for s in fam.samples}
    assert metrics[("abs_job_reconfigurations_total", (("job", "dashboard-counts"), ("status", "COMPLETED")))] == 1
    assert metrics[("abs_job_reconfiguration_steps_total", (("job", "dashboard-counts"),))] == 2
    assert metrics[("abs_job_reconfiguration_moved_bytes_total", (("job", "dashboard-counts"),))] == rec.bytes_moved


def slow_fn(ctx, row):
    time.sleep(0.001)  # a slow operator: its input channels fill, its upstream waits on them
    ctx.emit({"key": ctx.key})


def test_busy_and_backpressured_time_per_subtask(tmp_path):
    """A slow keyed operator is busy nearly all the time and its source is backpressured;
    the JSON, the metrics and the page's graph say so, in lines that fit the task's box (one
    line for both ran past it from 3 subtasks on; from 5, the mean and the highest)."""
    flow = abs.Dataflow("slow")
    flow.source("src", abs.GeneratorSource(None, num_keys=64, num_splits=3, batch_size=100)).key_by("key") \
        .process("slow", slow_fn).sink("out", abs.CollectSink())
    job = abs.submit(flow, parallelism=3, dashboard=True)
    server = job.dashboard
    try:
        deadline = time.monotonic() + 120  # bounds a hang only: the figures come within a second or two
        while True:
            load = json.loads(get(f"{server.base_url}/api/job?token={server.token}")[1])["load"]
            src = [load.get(f"task0#{i}") for i in range(3)]
            slow = [load.get(f"task1#{i}") for i in range(3)]
            if all(src + slow) and min(s["backpressured"] for s in src) > 0.5 and min(s["busy"] for s in slow) > 0.5:
                break
            assert time.monotonic() < deadline, load
            time.sleep(0.2)
        for shares in load.values():
            assert shares["busy"] + shares["idle"] + shares["backpressured"] == pytest.approx(1.0)
        metrics = {(s.name, s.labels.get("task"), s.labels.get("subtask")): s.value
                   for fam in text_string_to_metric_families(get(f"{server.base_url}/metrics?token={server.token}")[1].decode())
                   for s in fam.samples}
        assert ("abs_task_backpressured_ratio", "task0", "0") in metrics
        assert ("abs_task_busy_ratio", "task1", "1") in metrics
        with browser_page(tmp_path) as page:
            page.goto(server.url)
            page.wait_for_function("document.querySelector('#graph g.task[data-task=task1] text.load')"
                                   " && /busy \\d+%\\/\\d+%\\/\\d+%/.test(document.querySelector("
                                   "'#graph g.task[data-task=task1] text.load').textContent)")
            overflow = page.evaluate("""[...document.querySelectorAll('#graph g.task')].flatMap(g => {
                const box = g.querySelector('rect').getBBox();
                return [...g.querySelectorAll('text')].map(t => t.getBBox())
                  .filter(b => b.x + b.width > box.x + box.width || b.y + b.height > box.y + box.height)
                  .map(b => [g.dataset.task, b.width]); })""")
            assert overflow == []
            six = page.evaluate("loadLines({'t#0': {busy: 0.1, backpressured: 0}, 't#5': {busy: 0.9, backpressured: 0.5}},"
                                " {task: 't', parallelism: 6})")
            assert six == ["busy mean 50%, max 90% (#5)", "backpressured mean 25%, max 50% (#5)"]
    finally:
        job.cancel()


def test_a_restart_shows_at_once_not_only_after_its_back_off(tmp_path, caplog):
    """A worker died and the restart strategy waits 3 s: the driver recorded the restart and
    the status RESTARTING only after that wait, so for as long the page and /metrics said
    RUNNING (abs_job_up 1), listed no restart and kept the dead workers' busy shares."""
    import logging
    import threading

    announced = threading.Event()

    class Announced(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "restart 1 of 1 in" in record.getMessage():
                announced.set()

    handler = Announced()
    with caplog.at_level("INFO", logger="abs"):
        logging.getLogger("abs").addHandler(handler)
        job = restarting_job(tmp_path, delay=3.0)
        server = job.dashboard
        try:
            assert announced.wait(180), "the fault did not kill worker 0"
            # the driver is in the restart strategy's delay now
            snap = json.loads(get(f"{server.base_url}/api/job?token={server.token}")[1])
            assert snap["status"] == "RESTARTING", snap["status"]
            assert [r["attempt"] for r in snap["restarts"]] == [1] and "worker 0" in snap["restarts"][0]["error"]
            assert snap["load"] == {} and snap["records_in"] == {}
            metrics = {(s.name, s.labels.get("status")): s.value
                       for fam in text_string_to_metric_families(get(f"{server.base_url}/metrics?token={server.token}")[1].decode())
                       for s in fam.samples}
            assert metrics[("abs_job_up", "RESTARTING")] == 0 and metrics[("abs_job_restarts_total", None)] == 1
            assert not any(name == "abs_task_busy_ratio" for name, _ in metrics)
        finally:
            logging.getLogger("abs").removeHandler(handler)
            job.cancel()


def test_records_in_do_not_drop_when_a_live_rescale_retires_a_worker(tmp_path):
    """The records a leaving worker counted were dropped from the dashboard's records_in (and
    from abs_operator_records_in_total, a counter that then went down) by a scale-in."""
    flow = abs.Dataflow("scale-in-counts")
    flow.source("src", abs.GeneratorSource(None, num_keys=64, num_splits=4, batch_size=100, rate=500)).key_by("key") \
        .process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
    job = abs.submit(flow, parallelism=2, storage=str(tmp_path / "root"), checkpoint=abs.CheckpointConfig(interval=0.5),
                     dashboard=True)
    server, driver = job.dashboard, job._driver
    try:
        assert job.rescale(3).status == "COMPLETED"
        deadline = time.monotonic() + 120  # bounds a hang only: worker 2 counts within a second or two
        while driver._records.get(2, {}).get("count", 0) == 0:  # the joined worker took records
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert job.rescale(2).status == "COMPLETED"
        assert driver._retired_records["count"] > 0  # what worker 2 counted before it left
        # counts only grow: the job's figures lie between two readings of the driver's totals
        low, shown, high = driver._records_total(), server.job()["records_in"], driver._records_total()
        low_m = driver._records_total()
        scraped = {s.labels["operator"]: s.value for fam in text_string_to_metric_families(server.metrics()[0].decode())
                   for s in fam.samples if s.name == "abs_operator_records_in_total"}
        high_m = driver._records_total()
        for uid in ("src", "count", "out"):
            assert low[uid] <= shown[uid] <= high[uid], (uid, low, shown, high)
            assert low_m[uid] <= scraped[uid] <= high_m[uid], (uid, low_m, scraped, high_m)
    finally:
        job.cancel()


def test_when_the_job_ends_the_page_says_so_and_stops_asking(tmp_path):
    """The page kept asking every second after the job ended, over a keep-alive connection
    that the stopped server went on answering (its uptime still counting); a console error
    came with every page load (the browser's /favicon.ico, asked for without the token: 403)."""
    import http.client

    gate = tmp_path / "gate"
    flow = abs.Dataflow("ending")
    flow.source("src", PacedSource(abs.GeneratorSource(4_000, num_keys=64, num_splits=2, batch_size=100), 700,
                                   hold=1_000, gate=str(gate))).key_by("key") \
        .process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
    job = abs.submit(flow, parallelism=2, storage=str(tmp_path / "root"), checkpoint=abs.CheckpointConfig(interval=0.3),
                     dashboard=True)
    server = job.dashboard
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=60)  # a client that keeps its connection
    try:
        conn.request("GET", f"/api/job?token={server.token}")
        first = conn.getresponse()
        assert first.status == 200 and first.getheader("Connection") != "close"
        first.read()
        errors: list[str] = []
        with browser_page(tmp_path) as page:
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(server.url)
            page.wait_for_function("document.getElementById('status').textContent === 'RUNNING'")
            gate.touch()  # the readers go on to the end of their input
            result = job.wait(300)
            assert result.status == "FINISHED"
            page.wait_for_function("/the job ended \\(FINISHED\\)/.test(document.getElementById('updated').textContent)")
            assert page.text_content("#status") == "FINISHED"
            assert page.is_disabled("#trigger-checkpoint") and page.is_disabled("#trigger-savepoint")
        assert errors == []
        # the connection opened while the job ran gets one last answer, the ended job, and is closed
        conn.request("GET", f"/api/job?token={server.token}")
        last = conn.getresponse()
        ended = json.loads(last.read())
        assert last.status == 200 and last.getheader("Connection") == "close"
        assert ended["status"] == "FINISHED" and ended["load"] == {}
        assert ended["uptime_s"] == result.duration  # the uptime stopped with the job
    finally:
        conn.close()
        job.cancel()

"""The Prometheus exposition of a job (abs.observe.prometheus), read back with
prometheus_client's own parser."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from abs.observe.prometheus import METRICS, exposition, job_registry


def snapshot() -> dict:
    def cp(cid: int, duration: float) -> dict:
        return {"checkpoint_id": cid, "trigger_time": cid * 1.0, "duration": duration, "alignment_time": 0.01,
                "sync_time": 0.002, "async_time": 0.05, "bytes_written": 1000 * cid, "full_size": 5000 + cid,
                "files_written": 2, "async_cpu": 0.01, "status": "COMPLETED",
                "tasks": {"task1#0": {"alignment_s": 0.01, "sync_s": 0.002, "async_s": 0.05, "bytes_written": 700},
                          "task1#1": {"alignment_s": 0.0, "sync_s": 0.001, "async_s": 0.04, "bytes_written": 300}}}
    return {
        "job": "wc", "status": "RUNNING", "parallelism": 2, "uptime_s": 12.5,
        "graph": {"tasks": [{"task": "task0", "parallelism": 2, "operators": [{"uid": "src", "kind": "source"}]},
                            {"task": "task1", "parallelism": 2, "operators": [{"uid": "count", "kind": "process"}]}],
                  "edges": [{"from": "task0", "to": "task1", "partition": "key_by"}]},
        "records_in": {"src": 900, "count": 880}, "throughput": {"src": 45.5},
        "checkpoints": {"completed": [cp(i, 0.1 * i) for i in range(1, 13)], "failed": [{"checkpoint_id": 13, "reason": "x"}],
                        "in_progress": [14], "counts": {"completed": 12, "failed": 1}},
        "restarts": [{"attempt": 1, "error": "boom", "at": 3.0, "restored_from": 2}],
    }


def samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_exposition_has_flink_like_names_with_job_labels_and_the_snapshot_values():
    body, content_type = exposition(job_registry(snapshot))
    assert content_type.startswith("text/plain")
    got = samples(body.decode())
    job = (("job", "wc"),)
    assert got[("abs_job_checkpoints_completed_total", job)] == 12
    assert got[("abs_job_checkpoints_failed_total", job)] == 1
    assert got[("abs_job_checkpoints_in_progress", job)] == 1
    assert got[("abs_job_restarts_total", job)] == 1
    assert got[("abs_job_up", job + (("status", "RUNNING"),))] == 1
    assert got[("abs_job_last_checkpoint_id", job)] == 12
    assert got[("abs_job_last_checkpoint_duration_seconds", job)] == 1.2000000000000002
    assert got[("abs_operator_records_in_total", (("job", "wc"), ("operator", "count")))] == 880
    assert got[("abs_operator_records_in_per_second", (("job", "wc"), ("operator", "src")))] == 45.5
    # per-checkpoint series for the newest ten only
    per_cp = {dict(labels)["checkpoint"] for name, labels in got if name == "abs_checkpoint_duration_seconds"}
    assert per_cp == {str(i) for i in range(3, 13)}
    assert got[("abs_checkpoint_written_bytes", (("checkpoint", "7"), ("job", "wc"), ("status", "completed")))] == 7000
    task = (("job", "wc"), ("operator", "count"), ("subtask", "1"), ("task", "task1"))
    assert got[("abs_task_checkpoint_written_bytes", task)] == 300


def test_every_documented_metric_is_exposed_and_every_exposed_one_documented():
    text = exposition(job_registry(snapshot))[0].decode()
    exposed = {fam.name + ("_total" if fam.type == "counter" else "") for fam in text_string_to_metric_families(text)}
    assert exposed == {name for name, *_ in METRICS}


def test_a_job_without_checkpoints_yet_exposes_its_counters_at_zero():
    snap = snapshot()
    snap["checkpoints"] = {"completed": [], "failed": [], "in_progress": [], "counts": {"completed": 0, "failed": 0}}
    got = samples(exposition(job_registry(lambda: snap))[0].decode())
    assert got[("abs_job_checkpoints_completed_total", (("job", "wc"),))] == 0
    assert not [k for k in got if k[0] == "abs_job_last_checkpoint_id"]


def test_the_first_scrape_has_the_rate_the_mean_since_the_job_started_then_between_scrapes():
    """The rate needs two readings of the counts; the first scrape has none before it, so it
    gives the mean since the job started (uptime_s), and a job scraped at its start 0."""
    from abs.observe.server import DashboardServer

    now = [100.0]
    snap = snapshot()
    snap.pop("throughput")  # the server computes it
    server = DashboardServer(lambda limit: dict(snap, records_in=dict(snap["records_in"])), clock=lambda: now[0])
    rate = ("abs_operator_records_in_per_second", (("job", "wc"), ("operator", "src")))

    got = samples(server.metrics()[0].decode())
    assert got[rate] == 900 / 12.5  # records_in / uptime_s of the snapshot
    now[0] += 2.0
    snap["records_in"]["src"] += 300
    assert samples(server.metrics()[0].decode())[rate] == 150.0  # 300 records in 2 s

    fresh = DashboardServer(lambda limit: dict(snapshot(), uptime_s=0.0), clock=lambda: now[0])
    assert samples(fresh.metrics()[0].decode())[rate] == 0.0


def test_counters_of_reconfigurations_and_autoscale_decisions_never_go_down_when_one_ends():
    """A running reconfiguration (or autoscaling decision) is a gauge; the counters count the
    ended ones: counted under a RUNNING label, it went 1 -> 0 when it ended, which Prometheus'
    rate() reads as a counter reset."""
    def snap(status: str) -> dict:
        s = snapshot()
        s["reconfigurations"] = [{"status": "COMPLETED", "steps": [1], "bytes_moved": 10},
                                 {"status": status, "steps": [1, 2], "bytes_moved": 20}]
        s["autoscale"] = {"config": {"min_workers": 1}, "decisions": [
            {"kind": "scale_out", "outcome": "COMPLETED"}, {"kind": "scale_out", "outcome": status}]}
        return s

    job = (("job", "wc"),)
    running = samples(exposition(job_registry(lambda: snap("RUNNING")))[0].decode())
    ended = samples(exposition(job_registry(lambda: snap("COMPLETED")))[0].decode())
    counters = {k for k in running if k[0].endswith("_total")}
    assert counters <= set(ended)
    assert all(ended[k] >= running[k] for k in counters), {k: (running[k], ended[k]) for k in counters}
    assert not [k for k in running if k[0].endswith("_total") and ("status", "RUNNING") in k[1]]
    assert not [k for k in running if k[0].endswith("_total") and ("outcome", "RUNNING") in k[1]]
    assert running[("abs_job_reconfigurations_in_progress", job)] == 1
    assert ended[("abs_job_reconfigurations_in_progress", job)] == 0
    assert (running[("abs_job_reconfigurations_total", job + (("status", "COMPLETED"),))],
            ended[("abs_job_reconfigurations_total", job + (("status", "COMPLETED"),))]) == (1, 2)
    scale_out = (("job", "wc"), ("kind", "scale_out"))
    assert (running[("abs_job_autoscale_decisions_in_progress", scale_out)],
            ended[("abs_job_autoscale_decisions_in_progress", scale_out)]) == (1, 0)
    completed = (("job", "wc"), ("kind", "scale_out"), ("outcome", "COMPLETED"))
    assert (running[("abs_job_autoscale_decisions_total", completed)],
            ended[("abs_job_autoscale_decisions_total", completed)]) == (1, 2)

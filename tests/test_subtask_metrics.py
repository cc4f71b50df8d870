"""Per-subtask rates over time (JobHandle.metrics()["subtasks"], abs.runtime.subtask_metrics):
busy/idle/backpressured shares, records in and out per second per operator and subtask, made in
the driver from the counters the workers report."""
from __future__ import annotations

import time

import pytest

import abs
from abs.runtime.plan import compile_plan
from abs.runtime.subtask_metrics import Counters, rates, records_out_sources
from tests.pacing import PacedSource


def keyed_flow() -> abs.Dataflow:
    f = abs.Dataflow("shape", max_parallelism=8)
    (f.source("src", abs.GeneratorSource(10)).map(lambda r: r, uid="m")
      .key_by("key").reduce("r", lambda a, b: a).sink("out", abs.CollectSink()))
    return f


def test_records_out_come_from_the_source_itself_and_from_chained_consumers_only():
    f = keyed_flow()
    # the map's output crosses the key_by exchange: no per-subtask count of it exists
    assert records_out_sources(f, compile_plan(f)) == {"src": "src", "m": None, "r": "out"}


def test_rates_between_two_readings_are_per_subtask_and_per_second():
    out_from = {"src": "src", "m": None, "r": "out"}
    older = Counters(10.0, {"task0#0": (5.0, 1.0, 0.0), "task0#1": (5.0, 2.0, 0.5)},
                     ({"src": 100, "m": 100, "r": 40, "out": 40}, {"src": 50, "m": 50, "r": 0, "out": 0}),
                     {}, (3.0, None))
    newer = Counters(12.0, {"task0#0": (7.0, 1.5, 0.0), "task0#1": (7.0, 2.0, 1.5)},
                     ({"src": 300, "m": 300, "r": 240, "out": 238}, {"src": 50, "m": 50, "r": 10, "out": 10}),
                     {"task1#0": 0.25}, (0.0, None))
    s = rates(older, newer, out_from)
    assert s["time"] == 12.0 and s["interval"] == 2.0
    assert s["tasks"]["task0#0"] == {"busy": 0.75, "idle": 0.25, "backpressured": 0.0, "queue_fill": None}
    assert s["tasks"]["task0#1"] == {"busy": 0.5, "idle": 0.0, "backpressured": 0.5, "queue_fill": None}
    assert s["records_in_per_s"]["src"] == [100.0, 0.0] and s["records_in_per_s"]["r"] == [100.0, 5.0]
    assert s["records_out_per_s"] == {"src": [100.0, 0.0], "m": None, "r": [99.0, 5.0]}
    assert s["source_lag"] == [0.0, None]


def test_records_out_the_workers_counted_are_used_also_across_an_exchange():
    out_from = {"src": "src", "m": None, "r": "out"}
    older = Counters(10.0, {}, ({"m": 100}, {"m": 50}), {}, (None, None), ({"src": 100, "m": 90, "r": 0}, {"src": 50, "m": 50, "r": 0}))
    newer = Counters(12.0, {}, ({"m": 300}, {"m": 50}), {}, (None, None), ({"src": 300, "m": 250, "r": 8}, {"src": 50, "m": 50, "r": 2}))
    s = rates(older, newer, out_from)
    assert s["records_out_per_s"] == {"src": [100.0, 0.0], "m": [80.0, 0.0], "r": [4.0, 1.0]}


def test_rates_are_none_across_a_change_of_workers_and_zero_for_counters_that_restarted():
    one = Counters(1.0, {}, ({"src": 10},), {}, (None,))
    two = Counters(2.0, {}, ({"src": 20}, {"src": 0}), {}, (None, None))
    assert rates(one, two, {"src": "src"}) is None
    assert rates(one, one, {"src": "src"}) is None  # no time between them
    restarted = Counters(3.0, {"task0#0": (0.5, 0.1, 0.0)}, ({"src": 4},), {}, (None,))
    before = Counters(2.0, {"task0#0": (9.0, 1.0, 0.0)}, ({"src": 10},), {}, (None,))
    s = rates(before, restarted, {"src": "src"})
    assert s["records_in_per_s"]["src"] == [0.0] and s["tasks"] == {}  # no load span to compare


PER_READER = 1_500


def test_a_running_map_job_reports_records_in_and_out_per_subtask_that_add_up_to_its_counts(tmp_path):
    """Two workers; the sources wait at a gate until the series has its first sample, so the
    series starts at zero and, with the driver's reading after the workers finished, adds up
    to every record. Pacing (50 records per reader per checkpoint) keeps the job running for
    many samples; the test waits for a sample with records flowing while it runs."""
    gate = str(tmp_path / "gate")
    src = PacedSource(abs.GeneratorSource(2 * PER_READER, num_keys=20, num_splits=2, batch_size=25), 50,
                      hold=0, gate=gate)
    f = abs.Dataflow("counted", max_parallelism=8)
    f.source("src", src).map(lambda r: {"key": r["key"], "twice": 2 * r["value"]}, uid="double").sink(
        "out", abs.CollectSink())
    job = abs.submit(f, parallelism=2, storage=str(tmp_path / "root"),
                     checkpoint=abs.CheckpointConfig(interval=0.2, retained=1))

    def poll(what, done, bound=300.0):
        deadline = time.monotonic() + bound  # only bounds a hang
        while not done():
            if job.status not in ("CREATED", "RUNNING") or time.monotonic() > deadline:
                pytest.fail(f"{what}: job {job.status}, series {job.metrics()['subtasks'][-3:]}")
            time.sleep(0.05)

    poll("a first sample", lambda: job.metrics()["subtasks"])
    assert all(sum(s["records_in_per_s"]["src"]) == 0 for s in job.metrics()["subtasks"])  # held at the gate
    open(gate, "w").close()

    def flowing():
        return [s for s in job.metrics()["subtasks"]
                if sum(s["records_out_per_s"]["double"]) > 0 and sum(s["records_in_per_s"]["double"]) > 0]

    poll("records flowing", flowing)
    running = flowing()[0]
    assert running["tasks"]["task0#0"]["busy"] + running["tasks"]["task0#0"]["idle"] <= 1.0 + 1e-9
    assert set(running["tasks"]) == {"task0#0", "task0#1"}  # one task: source, map and sink chained
    result = job.wait(timeout=600)
    assert result.status == "FINISHED"
    series = job.metrics()["subtasks"]

    def total(kind, uid, w):
        return sum(s[kind][uid][w] * s["interval"] for s in series)

    for w in (0, 1):
        assert total("records_in_per_s", "src", w) == pytest.approx(PER_READER)
        assert total("records_out_per_s", "src", w) == pytest.approx(PER_READER)
        assert total("records_in_per_s", "double", w) == pytest.approx(PER_READER)
        assert total("records_out_per_s", "double", w) == pytest.approx(PER_READER)
    assert result.records_in == {"src": 2 * PER_READER, "double": 2 * PER_READER, "out": 2 * PER_READER}
    assert "out" not in series[-1]["records_out_per_s"]  # a sink has no records out

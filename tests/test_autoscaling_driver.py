"""The driver's autoscaling part (abs.runtime.autoscaling) with a stand-in driver: worker
reports in, decisions out, the clock passed in. A decision whose reconfiguration fails is
reported as failed and leaves the job as it was; a restart forgets the load before it."""
from __future__ import annotations

import types

import pyarrow as pa

import abs
from abs.errors import ReconfigurationError
from abs.reconfig import Assignment
from abs.runtime import messages as m
from abs.runtime.autoscaling import Autoscaling
from abs.runtime.plan import compile_plan, task_key

M = 8


class StandIn(Autoscaling):
    """What Autoscaling uses of JobDriver; every reconfiguration it asks for is refused (as
    when the new workers cannot start)."""

    def __init__(self, config: abs.Autoscale) -> None:
        f = abs.Dataflow("stand-in", max_parallelism=M)
        f.source("src", abs.GeneratorSource(10)).key_by("key").process(
            "count", lambda ctx, row: None, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
        self.flow, self.plan, self.P = f, compile_plan(f), 1
        self.assignment = Assignment.initial(M, 1)
        self.task_load: dict = {}
        self._retired_records: dict = {}
        self._reconf = None
        self._attempt = 0
        self.now = self.t_start = 0.0
        self.clock = lambda: self.now
        self.asked: list = []
        self._autoscale_init(config)
        self.key = task_key(self.plan.task_of[f.nodes[1].index], 0)
        self.taken = self.processed = self.idle = self.started = 0.0

    def _serve_reconfig(self, run, req: m.ReconfigRequest) -> None:
        self.asked.append(req)
        req.reply.put(ReconfigurationError(f"rescale({req.args[0]}): the new workers cannot start"))

    def second(self, input_rate: float, capacity: float = 1000.0) -> None:
        """One second of a worker that processes ``capacity`` records per busy second under
        ``input_rate``, its report, and a round of the driver's loop."""
        self.now += 1.0
        self.taken += input_rate
        self.processed += min(input_rate, capacity)
        self.idle += 1.0 - min(input_rate, capacity) / capacity
        load = (self.now - self.started, self.idle, 0.0)  # seconds since the task started, of them idle, backpressured
        self.task_load[self.key] = (self.task_load.get(self.key, (None, None))[1], load)
        self._worker_metrics[0] = m.WorkerMetrics({"src": int(self.taken), "count": int(self.processed)},
                                                  load={self.key: load}, lag=0.0)
        self._autoscale_tick(types.SimpleNamespace(life=types.SimpleNamespace(sources_exhausted=False)))


def config() -> abs.Autoscale:
    return abs.Autoscale(min_workers=1, max_workers=3, stabilization=3.0, cooldown=5.0, interval=1.0)


def test_a_refused_decision_is_reported_leaves_the_job_as_it_was_and_is_retried_after_the_cooldown():
    d = StandIn(config())
    for _ in range(20):
        d.second(1200.0)
    report = d.autoscale_report()
    assert [r["kind"] for r in report] == ["scale_out"] * len(report) and len(report) >= 2
    assert all(r["workers"] == 2 for r in report)  # 1,200/s at 1,000/s per busy second, 70 % busy: 2
    assert all(r["outcome"] == "FAILED: rescale(2): the new workers cannot start" for r in report)
    assert len(d.asked) == len(report) and d.P == 1 and d.assignment == Assignment.initial(M, 1)
    times = [r["time"] for r in report]
    assert all(b - a >= config().cooldown for a, b in zip(times, times[1:]))


def test_autoscaling_notices_carry_the_abs_prefix_of_the_other_runtime_lines(caplog):
    """Notices are the message alone (abscore.logs), so the runtime's start with "[abs] job ...";
    warnings get "[abs] warning:" from the default handler."""
    d = StandIn(config())
    with caplog.at_level("INFO", logger="abs"):
        for _ in range(8):
            d.second(1200.0)
    notices = [r.getMessage() for r in caplog.records if r.name == "abs.runtime.autoscaling" and r.levelname == "INFO"]
    assert notices and all(n.startswith("[abs] job 'stand-in': autoscaling: scale_out to 2 worker(s): ")
                           for n in notices)


def test_a_restart_forgets_the_load_before_it():
    d = StandIn(config())
    for _ in range(4):
        d.second(600.0)  # keeps up
    assert not d.autoscale_report()
    d._attempt = 1  # the job restarted: the new worker counts from zero
    d.taken = d.processed = d.idle = 0.0
    d.started = d.now
    d._worker_metrics = {}
    for _ in range(8):
        d.second(1500.0)
    first = d.autoscale_report()[0]
    # sized on the load after the restart alone (no sample mixes the counts of both workers)
    assert first["kind"] == "scale_out" and first["reason"].startswith("input 1,500/s, lag 0 records, busy 100%")
    assert all(min(s.busy) > 0.5 for s in d.load_series)  # 60 %, then 100 %: none compares across the restart



def test_a_sample_as_a_dict_is_asdict_of_it_without_its_deep_copy():
    import dataclasses

    from abs.autoscale import LoadSample
    from abs.runtime.autoscaling import sample_dict

    owners = tuple(kg % 3 for kg in range(32768))
    sample = LoadSample(12.5, (0.5, 1.0, 0.0), (10.0, 20.0, 0.0), 30.0, 4.0, {7: 2.5, 9: 1.0}, owners)
    got = sample_dict(sample)
    assert got == dataclasses.asdict(sample) and list(got) == list(dataclasses.asdict(sample))
    assert got["owners"] is owners  # shared, not copied key group by key group
    got["key_group_rates"][7] = 0.0
    assert sample.key_group_rates[7] == 2.5  # the rates are the dict's own
    assert sample_dict(LoadSample(1.0, (), (), 0.0)) == dataclasses.asdict(LoadSample(1.0, (), (), 0.0))

"""Automatic scaling of a running job (abs.Autoscale): a keyed stage whose per-record work
waits (an emulated remote call, so that more workers give more capacity even on two cores)
gets more input than one worker can take; the job scales out by itself, without a restart,
and its output stays exact."""
from __future__ import annotations

import collections
import time

import pyarrow as pa
import pytest

import abs

NUM_KEYS = 53
TOTAL = 20_000


def slow_count(ctx, row):
    time.sleep(0.001)  # a remote call per record: capacity ~1000 records/s per worker
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def flow() -> abs.Dataflow:
    f = abs.Dataflow("autoscaled", max_parallelism=16)
    src = abs.GeneratorSource(TOTAL, num_keys=NUM_KEYS, num_splits=4, batch_size=20, rate=450)  # 1,800/s
    f.source("src", src).key_by("key").process(
        "count", slow_count, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
    return f


def check_exact(result) -> None:
    """Each key counted 1..n once (n: its records)."""
    per_key = collections.defaultdict(list)
    out = result.collected("out")
    for k, c in zip(out.column("key").to_pylist(), out.column("count").to_pylist()):
        per_key[k].append(c)
    want = collections.Counter(i % NUM_KEYS for i in range(TOTAL))
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, n + 1)) for k, n in want.items()}


def test_a_job_that_cannot_keep_up_scales_out_by_itself_and_stays_exact(tmp_path):
    config = abs.Autoscale(min_workers=1, max_workers=3, stabilization=2.0, cooldown=3.0, interval=0.5,
                           strategy="batched", batch=4)
    job = abs.submit(flow(), parallelism=1, storage=str(tmp_path / "root"),
                     checkpoint=abs.CheckpointConfig(interval=0.5, retained=1), autoscale=config)
    result = job.wait(timeout=600)
    assert result.status == "FINISHED" and not result.failed_checkpoints
    decisions = result.autoscale_decisions
    outs = [d for d in decisions if d["kind"] == "scale_out"]
    assert outs and outs[0]["outcome"] == "COMPLETED", decisions
    assert "needs" in outs[0]["reason"] and "busy" in outs[0]["reason"]
    assert result.parallelism >= 2 and all(d["workers"] <= 3 for d in decisions)
    times = [d["time"] for d in decisions]
    assert all(b - a >= config.cooldown for a, b in zip(times, times[1:]))
    check_exact(result)
    # the load series the decisions were made from is the job's metrics too
    metrics = job.metrics()
    series = metrics["load"]
    assert series and max(s["busy"][0] for s in series) > 0.7
    assert any(s["key_group_rates"] for s in series)
    from abs.keygroups import key_group

    held = {key_group(k, 16) for k in range(NUM_KEYS)}  # the key groups holding a key
    assert set(metrics["state_bytes"]["count"]) == held and min(metrics["state_bytes"]["count"].values()) > 0
    import dataclasses

    assert series == [dataclasses.asdict(s) for s in job._driver.load_series]  # made once per sample, same content
    next(s for s in series if s["key_group_rates"])["key_group_rates"].clear()
    metrics["state_bytes"]["count"].clear()
    again = job.metrics()  # what a caller changes is its own copy
    assert again["load"] == [dataclasses.asdict(s) for s in job._driver.load_series] and again["state_bytes"]["count"]
    # and the dashboard's snapshot and /metrics list the decisions
    import json

    from prometheus_client.parser import text_string_to_metric_families

    from abs.observe.prometheus import exposition, job_registry
    from abs.observe.snapshot import job_snapshot

    snap = json.loads(json.dumps(job_snapshot(job._driver)))
    assert snap["autoscale"]["config"]["max_workers"] == 3 and snap["autoscale"]["decisions"] == decisions
    body, _type = exposition(job_registry(lambda: job_snapshot(job._driver)))
    samples = {(s.name, s.labels["kind"], s.labels["outcome"]): s.value
               for fam in text_string_to_metric_families(body.decode()) for s in fam.samples
               if s.name == "abs_job_autoscale_decisions_total"}
    assert samples[("abs_job_autoscale_decisions_total", "scale_out", "COMPLETED")] == sum(
        d["outcome"] == "COMPLETED" for d in outs)


def test_autoscale_must_be_an_autoscale():
    with pytest.raises(abs.ConfigError, match="abs.Autoscale"):
        abs.run(flow(), autoscale={"max_workers": 3})


@pytest.mark.parametrize("checkpoint", [abs.CheckpointConfig(interval=0.5, mode="unaligned"),
                                        abs.CheckpointConfig(interval=0.5, alignment_timeout=0.05)])
def test_autoscale_of_a_job_that_cannot_be_reconfigured_live_is_refused(tmp_path, checkpoint):
    """Decisions are carried out by live reconfiguration, which a job with unaligned barriers
    refuses: such a job once ran on at one worker, every scale-out FAILED ("takes unaligned
    checkpoints: live reconfiguration ... not supported yet"), nothing said so at the start."""
    with pytest.raises(abs.ConfigError, match=r"autoscale=: job 'autoscaled' takes unaligned checkpoints .* could "
                                              r"never scale"):
        abs.submit(flow(), storage=str(tmp_path / "root"), checkpoint=checkpoint,
                   autoscale=abs.Autoscale(min_workers=1, max_workers=3))


@pytest.mark.parametrize("parallelism", [1, 4])
def test_a_parallelism_outside_the_autoscale_bounds_is_refused(tmp_path, parallelism):
    """The policy keeps a job within min_workers..max_workers but never brings it into them:
    started at 1 with min_workers=2, a job that was not overloaded ran at 1 worker to its end
    without a decision."""
    with pytest.raises(abs.ConfigError, match=rf"parallelism={parallelism} is outside autoscale's min_workers\.\."
                                              r"max_workers \(2\.\.3\)"):
        abs.submit(flow(), parallelism=parallelism, storage=str(tmp_path / "root"),
                   autoscale=abs.Autoscale(min_workers=2, max_workers=3))


def test_autoscale_of_a_loop_is_refused():
    f = abs.Dataflow("looping")
    f.source("src", abs.GeneratorSource(10)).iterate(
        "loop", lambda loop: (loop.filter(lambda r: False, uid="again").rebalance(), loop.map(lambda r: r, uid="done"))
    ).sink("out", abs.CollectSink())
    with pytest.raises(abs.ConfigError, match=r"job 'looping' has an iteration .* could never scale"):
        abs.run(f, autoscale=abs.Autoscale(min_workers=1, max_workers=2))


def test_a_kill_during_an_automatic_rescale_restores_exactly(tmp_path):
    """A worker is killed (SIGKILL) at the routing switch of the first automatic rescale: the
    job restores its latest checkpoint, the decision is reported as failed, and the output is
    exact (autoscaling goes on after the restart)."""
    from abs.faults import Fault

    config = abs.Autoscale(min_workers=1, max_workers=3, stabilization=2.0, cooldown=3.0, interval=0.5)
    result = abs.run(flow(), parallelism=1, storage=str(tmp_path / "root"),
                     checkpoint=abs.CheckpointConfig(interval=0.5, retained=1), autoscale=config,
                     restart=abs.RestartStrategy(max_restarts=1, delay=0.1),
                     runtime=abs.RuntimeOptions(faults=(Fault("after_routing_switch", "*", nth=1),)))
    assert result.status == "FINISHED" and len(result.restarts) == 1
    first = result.autoscale_decisions[0]
    assert first["kind"] == "scale_out" and first["outcome"].startswith("FAILED") and "restarted" in first["outcome"]
    check_exact(result)

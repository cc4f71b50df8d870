"""The autoscaling policy (abs.autoscale) against recorded-style load traces: steady, ramp,
spike, skew and oscillating load; no I/O, time passed in."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.autoscale import Autoscale, AutoscalePolicy, LoadSample
from abs.errors import ConfigError
from abs.reconfig.plan import check_strategy

CAP = 10_000.0  # records one worker processes per busy second


def sample(t: float, workers: int, input_rate: float, lag: float = 0.0, shares=None, owners=None, rates=None):
    """What a stage of ``workers`` workers, each able to do CAP/s, reports at input_rate (the
    excess over capacity becomes lag)."""
    shares = shares or [1 / workers] * workers
    processed = [min(input_rate * sh, CAP) for sh in shares]
    busy = tuple(p / CAP for p in processed)
    return LoadSample(t, busy, tuple(processed), input_rate, lag, rates or {}, owners or ())


def run(policy: AutoscalePolicy, rate_at, workers: int, seconds: float, step: float = 1.0):
    """Feed a trace, carrying out each decision at once; the decisions made."""
    decisions = []
    lag = 0.0
    t = 0.0
    while t < seconds:
        t += step
        rate = rate_at(t)
        lag = max(0.0, lag + (rate - workers * CAP) * step)
        policy.observe(sample(t, workers, rate, lag))
        d = policy.decide(t)
        if d is not None:
            decisions.append(d)
            policy.decided(t)
            workers = d.workers
    return decisions, workers


CFG = Autoscale(min_workers=1, max_workers=8, stabilization=10, cooldown=20, catch_up=1000)


def test_a_steady_load_decides_nothing():
    decisions, workers = run(AutoscalePolicy(CFG), lambda t: 0.55 * 2 * CAP, 2, 300)
    assert decisions == [] and workers == 2


def test_a_ramp_scales_out_to_the_parallelism_it_needs_in_one_decision():
    decisions, workers = run(AutoscalePolicy(CFG), lambda t: 1_000 if t < 30 else 41_000, 1, 120)
    outs = [d for d in decisions if d.kind == "scale_out"]
    assert outs and outs[0].workers == math.ceil(41_000 / (CAP * 0.7))  # 6, not 2
    assert "needs 6 workers" in outs[0].reason and "input" in outs[0].reason
    assert workers >= 6


def test_a_short_spike_within_the_stabilization_window_decides_nothing():
    decisions, _ = run(AutoscalePolicy(CFG), lambda t: 30_000 if 50 <= t < 54 else 5_000, 2, 200)
    assert [d for d in decisions if d.kind == "scale_out"] == []


def test_low_load_scales_in_and_never_below_the_minimum():
    cfg = Autoscale(min_workers=2, max_workers=8, stabilization=10, cooldown=20)
    decisions, workers = run(AutoscalePolicy(cfg), lambda t: 2_000, 6, 200)
    assert decisions and all(d.kind == "scale_in" for d in decisions)
    assert workers == 2


def test_an_oscillating_load_does_not_flap():
    """Load swinging every 6 s between 40 % and 60 % of two workers: inside the hysteresis,
    and shorter than the stabilization window: no decision at all; a slower swing decides at
    most once per cool-down."""
    fast, _ = run(AutoscalePolicy(CFG), lambda t: (0.8 if int(t / 6) % 2 else 1.2) * CAP, 2, 300)
    assert fast == []
    slow, _ = run(AutoscalePolicy(CFG), lambda t: 30_000 if int(t / 40) % 2 else 3_000, 2, 400)
    times = [d.time for d in slow]
    assert all(b - a >= CFG.cooldown for a, b in zip(times, times[1:]))


def test_a_hot_key_group_is_isolated_by_moving_the_others_off_its_worker():
    """Key group 3 carries 30 % of the records; worker 0 owns it and seven more: the policy
    moves others off worker 0, never key group 3 itself to a worker that would then be hotter."""
    M, P = 16, 2
    owners = tuple(kg * P // M for kg in range(M))
    total = 14_000.0
    rates = {kg: (0.3 * total if kg == 3 else 0.7 * total / (M - 1)) for kg in range(M)}
    share0 = sum(r for kg, r in rates.items() if owners[kg] == 0) / total
    policy = AutoscalePolicy(Autoscale(min_workers=2, max_workers=2, stabilization=10, cooldown=20, skew=1.2))
    decision = None
    for t in range(1, 15):
        policy.observe(sample(t, P, total, 0.0, [share0, 1 - share0], owners, rates))
        decision = decision or policy.decide(t)
    assert decision is not None and decision.kind == "rebalance" and decision.workers == 2
    assert 3 not in decision.moves and all(owners[kg] == 0 and w == 1 for kg, w in decision.moves.items())
    load = [0.0, 0.0]
    for kg, r in rates.items():
        load[decision.moves.get(kg, owners[kg])] += r
    assert max(load) < max(sum(r for kg, r in rates.items() if owners[kg] == w) for w in (0, 1))
    assert "worker 0" in decision.reason


@settings(max_examples=200, deadline=None)
@given(rates=st.lists(st.floats(0, 80_000), min_size=3, max_size=30), workers=st.integers(1, 8))
def test_decisions_stay_in_bounds_and_respect_the_cool_down(rates, workers):
    cfg = Autoscale(min_workers=1, max_workers=8, stabilization=5, cooldown=15)
    decisions, final = run(AutoscalePolicy(cfg), lambda t: rates[int(t / 10) % len(rates)], workers, 10 * len(rates))
    assert 1 <= final <= 8
    assert all(1 <= d.workers <= 8 for d in decisions)
    times = [d.time for d in decisions]
    assert all(b - a >= cfg.cooldown for a, b in zip(times, times[1:]))


def test_bad_settings_are_refused():
    for kwargs, match in [(dict(min_workers=3, max_workers=2), "min_workers"),
                          (dict(scale_in_utilization=0.8), "scale_in_utilization"),
                          (dict(cooldown=0), "cooldown"), (dict(skew=1.0), "skew")]:
        with pytest.raises(ConfigError, match=match):
            Autoscale(**kwargs)


@pytest.mark.parametrize("strategy,batch", [("all_at_once", None), ("fluid", None), ("batched", None), ("batched", 3)])
def test_every_strategy_gives_decisions_the_reconfiguration_accepts(strategy, batch):
    """A decision is carried out as JobHandle.rescale(workers, strategy=, batch=), which
    check_strategy validates. The batch once defaulted to 8 whatever the strategy, so with
    strategy='fluid' or 'all_at_once' every decision failed ("batch=8 is only for
    strategy='batched'") and the job never scaled."""
    cfg = Autoscale(strategy=strategy, **({} if batch is None else {"batch": batch}))
    assert check_strategy(cfg.strategy, cfg.batch) == {"all_at_once": 0, "fluid": 1}.get(strategy, batch or 8)


def test_settings_that_no_decision_could_use_are_refused_at_once():
    for kwargs, match in [(dict(strategy="gradual"), "strategy='gradual'"),
                          (dict(strategy="fluid", batch=4), "only for strategy='batched'"),
                          (dict(batch=0), "positive int"), (dict(target_utilization="0.7"), "target_utilization"),
                          (dict(interval=math.nan), "interval"), (dict(cooldown=math.inf), "cooldown")]:
        with pytest.raises(ConfigError, match=match):
            Autoscale(**kwargs)


def test_a_backlog_asks_for_the_workers_that_work_it_off_within_catch_up():
    cfg = Autoscale(min_workers=1, max_workers=16, stabilization=10, cooldown=20, catch_up=20)
    policy = AutoscalePolicy(cfg)
    for t in range(1, 12):  # 2 workers at full speed, 30k/s coming in: the lag grows 10k/s
        policy.observe(sample(t, 2, 30_000, lag=10_000.0 * t))
    d = policy.decide(11)
    assert d is not None and d.kind == "scale_out"
    assert d.workers == math.ceil((30_000 + 110_000 / 20) / (CAP * 0.7))  # 6: 5 for the input alone


def test_a_load_between_the_target_and_the_scale_out_threshold_keeps_its_workers():
    """Two workers 80 % busy: above the 70 % target, below the 90 % at which the stage scales
    out; at 95 % it scales out to the parallelism that runs the workers at the target."""
    kept, workers = run(AutoscalePolicy(CFG), lambda t: 0.8 * 2 * CAP, 2, 300)
    assert kept == [] and workers == 2
    out, workers = run(AutoscalePolicy(CFG), lambda t: 0.95 * 2 * CAP, 2, 300)
    assert [(d.kind, d.workers) for d in out] == [("scale_out", 3)]  # 19,000/s at 70 %: 2.7 -> 3
    assert "would keep 2 worker(s) 95% busy (over 90%)" in out[0].reason


def test_the_scale_out_threshold_is_not_below_the_target():
    with pytest.raises(ConfigError, match="scale_out_utilization"):
        Autoscale(target_utilization=0.8, scale_out_utilization=0.75)


def test_three_workers_a_third_busy_scale_in_to_the_two_that_stay_under_the_target():
    """35 % busy: below the 40 % scale-in threshold; two workers would be about 53 % busy,
    one 105 %: two it is, and they stay (53 % is far from the 90 % of a scale-out)."""
    decisions, workers = run(AutoscalePolicy(CFG), lambda t: 0.35 * 3 * CAP, 3, 300)
    assert [(d.kind, d.workers) for d in decisions] == [("scale_in", 2)] and workers == 2
    assert "2 workers suffice at about 52% busy" in decisions[0].reason

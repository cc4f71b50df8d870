"""The autoscaling policy: from the load a job reports to decisions (SEEP's idea, with the
arithmetic of Flink's autoscaler), pure: samples in, decisions out, time passed in, no I/O.

A :class:`LoadSample` is what the driver sees of the keyed stage over one interval: per worker
the share of time its keyed task was busy and how many records it processed per second, the
records per second the sources took in, how far behind their input they are (``lag``, records),
and per key group the records per second (to find hot key groups).

What :meth:`AutoscalePolicy.decide` returns:

* **scale out** when the stage is close to not keeping up: each worker's *true* rate is what
  it processed per second of busy time (``processed / busy``: a worker busy half the time at
  10 k/s could do 20 k/s); the demand is the input rate plus the lag to work off within
  ``catch_up`` seconds; when the demand would keep the workers busier than
  ``scale_out_utilization``, the stage gets the parallelism that runs them at
  ``target_utilization``: ``ceil(demand / (true rate * target_utilization))`` (not a +1
  step), bounded by ``min_workers`` and ``max_workers``;
* **scale in** when fewer workers suffice at the target and every worker stayed under
  ``scale_in_utilization`` busy with no lag. The target sits between the two thresholds (as
  in Flink's autoscaler, whose utilisation boundary is the same idea): after a decision the
  load is that far from either, which keeps an oscillating load from flapping, and a load
  between the target and ``scale_out_utilization`` keeps its workers (scaling out at the
  target itself would pay for idle headroom at every step of a rising load);
* **rebalance** when the parallelism is right but one worker is overloaded: key groups move
  from the busiest worker to the least busy ones, hottest fitting first, until their loads are
  as even as whole key groups allow (one key group with 30 % of the records gets a worker of
  its own rather than a share of one).

Every decision needs its condition to hold over the whole stabilisation window (averages of
the samples in the last ``stabilization`` seconds, which must span most of it), and after a
decision nothing is decided for ``cooldown`` seconds (the reconfiguration runs and the new
workers warm up). Each decision names its reason with the figures it was made from.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from .errors import ConfigError

__all__ = ["Autoscale", "LoadSample", "Decision", "AutoscalePolicy"]

DEFAULT_BATCH = 8  # key groups per step of the "batched" strategy when Autoscale(batch=) is not given


@dataclasses.dataclass(frozen=True)
class Autoscale:
    """Autoscaling settings (``abs.run(..., autoscale=abs.Autoscale(...))``)."""

    min_workers: int = 1
    max_workers: int = 4
    target_utilization: float = 0.7  # size the stage to run each worker about this busy
    scale_in_utilization: float = 0.4  # scale in only when every worker stays below this
    scale_out_utilization: float = 0.9  # scale out only when the demand would keep the workers busier
    stabilization: float = 10.0  # seconds a condition must hold
    cooldown: float = 20.0  # seconds after a decision before the next one
    catch_up: float = 10.0  # seconds to work a lag off in
    skew: float = 1.6  # rebalance when the busiest worker's load exceeds the mean by this factor
    interval: float = 1.0  # seconds between samples
    strategy: str = "batched"  # how the decisions' key groups move (see JobHandle.rescale)
    batch: int | None = None  # key groups per step of "batched" (None: 8); only for "batched"

    def __post_init__(self) -> None:
        from .reconfig.plan import check_strategy

        if self.strategy == "batched" and self.batch is None:
            object.__setattr__(self, "batch", DEFAULT_BATCH)
        try:  # checked here: every decision would fail with it, and the job would never scale
            check_strategy(self.strategy, self.batch)
        except ConfigError as exc:
            raise ConfigError(f"Autoscale: {exc}") from None
        for name in ("target_utilization", "scale_in_utilization", "scale_out_utilization"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value):
                raise ConfigError(f"Autoscale: {name} must be a number (a share of busy time, e.g. 0.7), got {value!r}")
        if type(self.min_workers) is not int or type(self.max_workers) is not int or not (
                1 <= self.min_workers <= self.max_workers):
            raise ConfigError(f"Autoscale: need 1 <= min_workers <= max_workers (ints), got min_workers="
                              f"{self.min_workers!r}, max_workers={self.max_workers!r}")
        if not 0 < self.scale_in_utilization < self.target_utilization <= self.scale_out_utilization:
            raise ConfigError(f"Autoscale: need 0 < scale_in_utilization < target_utilization <= "
                              f"scale_out_utilization, got {self.scale_in_utilization!r}, {self.target_utilization!r} "
                              f"and {self.scale_out_utilization!r}")
        for name in ("stabilization", "cooldown", "catch_up", "interval"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"Autoscale: {name} must be a positive number of seconds, got {getattr(self, name)!r}")
        if type(self.skew) not in (int, float) or not math.isfinite(self.skew) or self.skew <= 1:
            raise ConfigError(f"Autoscale: skew must be a factor above 1, got {self.skew!r}")


@dataclasses.dataclass(frozen=True)
class LoadSample:
    """The keyed stage over one interval ending at ``time`` (see the module docstring)."""

    time: float
    busy: tuple[float, ...]  # per worker, 0..1
    processed: tuple[float, ...]  # per worker, records/s
    input_rate: float  # records/s taken in by the sources
    lag: float = 0.0  # records the sources are behind their input
    key_group_rates: Mapping[int, float] = dataclasses.field(default_factory=dict)  # records/s
    owners: tuple[int, ...] = ()  # key group -> worker, when key_group_rates is given

    @property
    def workers(self) -> int:
        return len(self.busy)


@dataclasses.dataclass(frozen=True)
class Decision:
    time: float
    kind: str  # "scale_out", "scale_in", "rebalance"
    workers: int  # the parallelism after it
    reason: str
    moves: Mapping[int, int] = dataclasses.field(default_factory=dict)  # rebalance: key group -> worker


class AutoscalePolicy:
    """Decisions from samples (see the module docstring). Feed :meth:`observe`, ask
    :meth:`decide`; :meth:`decided` records that a decision was carried out (or tried)."""

    def __init__(self, config: Autoscale) -> None:
        self.config = config
        self.samples: list[LoadSample] = []
        self.last_decision: float | None = None

    def observe(self, sample: LoadSample) -> None:
        if self.samples and sample.workers != self.samples[-1].workers:
            self.samples = []  # another parallelism: the old samples say nothing about it
        self.samples.append(sample)
        horizon = sample.time - 2 * self.config.stabilization
        while self.samples and self.samples[0].time < horizon:
            self.samples.pop(0)

    def decided(self, now: float) -> None:
        self.last_decision = now
        self.samples = []

    def forget(self) -> None:
        """Drop the samples so far (the job restarted: its new workers restored an older state
        and count from zero); the cool-down of the last decision still holds."""
        self.samples = []

    def _window(self, now: float) -> Sequence[LoadSample]:
        c = self.config
        window = [s for s in self.samples if s.time > now - c.stabilization]
        if not window or window[-1].time - window[0].time < 0.8 * c.stabilization - c.interval:
            return []
        return window

    def _need(self, s: LoadSample, utilization: float | None = None) -> int | None:
        """Workers needed for sample ``s``'s demand to keep each of them ``utilization`` busy
        (default: the target), before the bounds; None when the stage was idle (no measure of
        capacity)."""
        c = self.config
        busy = sum(s.busy)
        done = sum(s.processed)
        if busy <= 0.01 * s.workers or done <= 0:
            return None
        true_rate = done / busy  # records per busy second of one worker
        demand = s.input_rate + s.lag / c.catch_up
        return max(1, math.ceil(demand / (true_rate * (utilization or c.target_utilization)) - 1e-9))

    def decide(self, now: float) -> Decision | None:
        c = self.config
        if self.last_decision is not None and now - self.last_decision < c.cooldown:
            return None
        window = self._window(now)
        if not window:
            return None
        P = window[-1].workers
        n = len(window)
        busy = [sum(s.busy[w] for s in window) / n for w in range(P)]
        processed = [sum(s.processed[w] for s in window) / n for w in range(P)]
        input_rate = sum(s.input_rate for s in window) / n
        lag = window[-1].lag
        figures = (f"input {input_rate:,.0f}/s, lag {lag:,.0f} records, busy "
                   f"{'/'.join(f'{b:.0%}' for b in busy)}")
        per_sample = [self._need(s) for s in window]
        # the whole window's averages, the latest lag: what the decision sizes for
        mean = LoadSample(now, tuple(busy), tuple(processed), input_rate, lag)
        needed = self._need(mean)
        if needed is not None:
            figures += f", true rate {sum(processed) / sum(busy):,.0f}/s per worker"
            bounded = max(c.min_workers, min(c.max_workers, needed))
            # out when every sample's demand would keep the workers busier than
            # scale_out_utilization, to the parallelism that runs them at the target
            over = [self._need(s, c.scale_out_utilization) for s in window]
            if bounded > P and all(x is not None and x > P for x in over):
                demand = input_rate + lag / c.catch_up
                load = demand / (P * sum(processed) / sum(busy))
                return Decision(now, "scale_out", bounded,
                                f"{figures}: {demand:,.0f}/s would keep {P} worker(s) {load:.0%} busy (over "
                                f"{c.scale_out_utilization:.0%}), needs {needed} workers at "
                                f"{c.target_utilization:.0%} busy" + (f" (max_workers={c.max_workers})"
                                                                      if bounded < needed else ""))
            quiet = all(max(s.busy) < c.scale_in_utilization and s.lag <= c.interval * max(s.input_rate, 1.0)
                        for s in window)
            fewest = max([x for x in per_sample if x is not None] + [needed, c.min_workers])
            if quiet and fewest < P:
                # the workers left must stay under the target: each is about P / fewest times as busy
                after = max(busy) * P / fewest
                if after <= c.target_utilization:
                    return Decision(now, "scale_in", fewest,
                                    f"{figures}: {fewest} workers suffice at about {after:.0%} busy")
        elif P > c.min_workers and all(s.lag <= 0 and s.input_rate <= 0 for s in window):
            return Decision(now, "scale_in", c.min_workers, f"{figures}: no input")
        return self._rebalance(now, window, busy, figures)

    def _rebalance(self, now: float, window: Sequence[LoadSample], busy: list[float], figures: str) -> Decision | None:
        c = self.config
        P = len(busy)
        last = window[-1]
        if P < 2 or not last.key_group_rates or not last.owners:
            return None
        mean = sum(busy) / P
        hot = max(range(P), key=lambda w: busy[w])
        if busy[hot] < c.target_utilization or busy[hot] < c.skew * mean:
            return None
        rates: dict[int, float] = {}
        for s in window:
            for kg, r in s.key_group_rates.items():
                rates[kg] = rates.get(kg, 0.0) + r / len(window)
        load = [0.0] * P
        for kg, r in rates.items():
            load[last.owners[kg]] += r
        target = sum(load) / P
        moves: dict[int, int] = {}
        # hottest key groups of the hot worker first, each to the least loaded worker while
        # that lowers the larger of the two loads (a key group hotter than the gap stays)
        for kg in sorted((kg for kg in rates if last.owners[kg] == hot), key=lambda k: -rates[k]):
            if load[hot] <= target:
                break
            cool = min(range(P), key=lambda w: load[w])
            r = rates[kg]
            if max(load[hot] - r, load[cool] + r) < load[hot] and load[hot] - r > 0:
                moves[kg] = cool
                load[hot] -= r
                load[cool] += r
        if not moves:
            return None
        return Decision(now, "rebalance", P, f"{figures}: worker {hot} carries {busy[hot]:.0%} busy against a "
                        f"mean of {mean:.0%}; {len(moves)} key group(s) move off it", moves)

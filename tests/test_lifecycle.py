"""The pure job-lifecycle state machine (abs.runtime.lifecycle): final checkpoint, finish,
shutdown, heartbeat and failover, driven with an injected clock and random event sequences."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from abs.runtime import lifecycle as life

TASKS = ("task0#0", "task0#1", "task1#0", "task1#1")
SOURCES = ("task0#0", "task0#1")


def machine(checkpointing: bool = True, timeout: float = 10.0) -> life.JobLifecycle:
    return life.JobLifecycle(TASKS, SOURCES, (0, 1), checkpointing=checkpointing, heartbeat_timeout=timeout, now=0.0)


def test_the_final_checkpoint_is_requested_once_every_source_is_exhausted_and_finish_follows_its_completion():
    lc = machine()
    assert lc.tick(False) == [life.TickCoordinator()]
    assert lc.on_source_exhausted("task0#0") is False
    assert lc.tick(False) == [life.TickCoordinator()]
    lc.on_triggered(3)  # triggered before the last source ran out: not the final one
    assert lc.on_source_exhausted("task0#1") is True
    assert lc.tick(True) == [life.TickCoordinator()]  # checkpoint 3 still in flight: no request
    assert lc.on_completed(3) == []
    assert lc.tick(False) == [life.RequestFinalCheckpoint(1), life.TickCoordinator()]
    lc.on_triggered(4)
    assert lc.tick(True) == [life.TickCoordinator()]
    assert lc.on_completed(4) == [life.FinishSources()]
    assert lc.on_completed(5) == []  # finish once
    assert lc.tick(False) == []  # finishing: the coordinator triggers nothing more
    for t in TASKS:
        lc.on_task_done(t)
    assert lc.tick(False) == [life.ShutDown()]


def test_an_aborted_final_checkpoint_is_requested_again_and_the_job_gives_up_after_five():
    lc = machine()
    for t in SOURCES:
        lc.on_source_exhausted(t)
    for n in range(1, 6):
        assert lc.tick(False) == [life.RequestFinalCheckpoint(n), life.TickCoordinator()]
        lc.on_triggered(10 + n)
        lc.on_aborted(10 + n)
    assert lc.tick(False) == [life.GiveUp(5)]


def test_without_checkpointing_the_sources_finish_as_soon_as_they_are_exhausted():
    lc = machine(checkpointing=False)
    for t in SOURCES:
        lc.on_source_exhausted(t)
    assert lc.tick(False) == [life.FinishSources()]
    assert lc.tick(False) == []


def test_a_job_with_loops_finishes_after_a_final_checkpoint_that_found_nothing_in_flight():
    """Final checkpoints that found records circulating (or overtaken) are not the last: with
    periodic checkpoints the next periodic one is the next candidate, without them one is
    requested at once; none of them counts as a failed attempt. Without storage: probes."""
    for periodic in (True, False):
        lc = life.JobLifecycle(TASKS, SOURCES, (0, 1), checkpointing=True, heartbeat_timeout=10.0, now=0.0,
                               loops=True, periodic=periodic)
        for t in SOURCES:
            lc.on_source_exhausted(t)
        for cid in range(1, 8):  # more rounds than MAX_FINAL_ATTEMPTS: not a give-up
            asked = lc.tick(False)
            if periodic and cid > 1:
                assert asked == [life.TickCoordinator()]  # waits for the periodic trigger
            else:
                assert asked == [life.RequestFinalCheckpoint(1), life.TickCoordinator()]
            lc.on_triggered(cid)
            assert lc.on_completed(cid, quiet=False) == []
        assert lc.loop_rounds == 7
        lc.on_triggered(8)
        assert lc.on_completed(8, quiet=True) == [life.FinishSources()]
    probes = life.JobLifecycle(TASKS, SOURCES, (0, 1), checkpointing=False, heartbeat_timeout=10.0, now=0.0, loops=True)
    for t in SOURCES:
        probes.on_source_exhausted(t)
    assert probes.tick(False) == [life.RequestFinalCheckpoint(1), life.TickCoordinator()]  # a probe, not a finish
    probes.on_triggered(1)
    assert probes.on_completed(1, quiet=True) == [life.FinishSources()]


def test_a_worker_silent_longer_than_the_heartbeat_timeout_is_reported_by_the_injected_clock():
    lc = machine(timeout=10.0)
    lc.on_seen(0, 5.0)
    assert lc.silent_workers(10.0) == []
    assert lc.silent_workers(10.5) == [life.WorkerSilent(1, 10.5)]
    lc.on_seen(1, 10.5)
    assert lc.silent_workers(15.0) == []
    assert lc.silent_workers(16.0) == [life.WorkerSilent(0, 11.0)]


def test_failover_restarts_while_restarts_are_left_and_the_error_is_not_permanent():
    assert life.failover(0, canceled=False, restartable=True, max_restarts=2, delay=0.5) == life.Restart(1, 0.5)
    assert life.failover(2, canceled=False, restartable=True, max_restarts=2, delay=0.5) == life.Stop("FAILED")
    assert life.failover(0, canceled=False, restartable=False, max_restarts=2, delay=0.5) == life.Stop("FAILED")
    assert life.failover(0, canceled=True, restartable=True, max_restarts=2, delay=0.5) == life.Stop("CANCELED")


events = st.lists(
    st.one_of(
        st.tuples(st.just("exhausted"), st.sampled_from(SOURCES)),
        st.tuples(st.just("done"), st.sampled_from(TASKS)),
        st.tuples(st.just("trigger")),
        st.tuples(st.just("abort")),
        st.tuples(st.just("complete")),
        st.tuples(st.just("tick")),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(events=events, checkpointing=st.booleans())
def test_random_event_sequences_keep_the_lifecycle_invariants(events, checkpointing):
    """A model coordinator (ids increase; one checkpoint in flight at a time) against the
    lifecycle: sources are finished at most once, and with checkpointing only after a checkpoint
    triggered once every source was exhausted completed; no final checkpoint is requested
    before then or while one is in flight; shutdown only once every task is done; at most
    five final requests before giving up."""
    lc = machine(checkpointing=checkpointing)
    next_id, in_flight = 1, None
    exhausted_at_trigger: dict[int, bool] = {}
    finishes = requests = 0
    completed_final = False
    gave_up = shut_down = False
    for event in events:
        kind = event[0]
        if kind == "exhausted":
            lc.on_source_exhausted(event[1])
        elif kind == "done":
            lc.on_task_done(event[1])
        elif kind == "trigger" and checkpointing and in_flight is None and not lc.finishing:
            in_flight, next_id = next_id, next_id + 1
            exhausted_at_trigger[in_flight] = lc.sources_exhausted
            lc.on_triggered(in_flight)
        elif kind == "abort" and in_flight is not None:
            lc.on_aborted(in_flight)
            in_flight = None
        elif kind == "complete" and in_flight is not None:
            completed_final |= exhausted_at_trigger[in_flight]
            actions = lc.on_completed(in_flight)
            if actions:
                assert actions == [life.FinishSources()]
                assert exhausted_at_trigger[in_flight], "finished after a checkpoint that is not the final one"
                finishes += 1
            in_flight = None
        elif kind == "tick":
            was_exhausted, was_done, was_finishing = lc.sources_exhausted, lc.all_done, lc.finishing
            actions = lc.tick(in_flight is not None)
            for a in actions:
                if isinstance(a, life.ShutDown):
                    assert was_done
                    shut_down = True
                elif isinstance(a, life.FinishSources):
                    assert not checkpointing and was_exhausted and not was_finishing
                    finishes += 1
                elif isinstance(a, life.RequestFinalCheckpoint):
                    assert checkpointing and was_exhausted and in_flight is None and not was_finishing
                    requests += 1
                    assert a.attempt == requests <= life.MAX_FINAL_ATTEMPTS
                elif isinstance(a, life.GiveUp):
                    assert requests == life.MAX_FINAL_ATTEMPTS
                    gave_up = True
                else:
                    assert isinstance(a, life.TickCoordinator)
            if was_done:
                assert actions == [life.ShutDown()]
            elif was_finishing:
                assert actions == []
        if gave_up or shut_down:
            break
    assert finishes <= 1
    if checkpointing and finishes:
        assert completed_final

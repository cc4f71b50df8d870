"""Live reconfiguration in the driver: requests of the job's handle, steps injected at the
sources, handovers relayed from old owners to new ones, installs counted (see
:mod:`abs.reconfig` for the protocol).

:class:`LiveReconfiguration` is a part of :class:`~abs.runtime.driver.JobDriver`; it works on
the driver's own attributes (``flow``, ``P``, ``store``, ``_manifests``, ...). While a
reconfiguration runs, every checkpoint from the one its first step builds on stays out of
GC's reach (:meth:`reconfig_live_bases`): new owners read the moved key groups' chains from
it.
"""
from __future__ import annotations

import logging
from typing import Any

from ..reconfig.coordinator import Reconfiguration, ReconfigurationRecord
from ..reconfig.plan import (DRAIN, JOIN, RETIRE, Assignment, ReconfigurationError, move_target, plan_rescale,
                             plan_steps, rebalance_target, check_strategy)
from ..errors import WorkerLostError
from . import messages as m
from .rescale import Rescaling

log = logging.getLogger(__name__)

__all__ = ["LiveReconfiguration", "KEYED_KINDS"]

KEYED_KINDS = ("process", "reduce", "aggregate")
"""Node kinds whose operators keep keyed state (their key groups move)."""


class LiveReconfiguration(Rescaling):
    """The reconfiguration part of :class:`~abs.runtime.driver.JobDriver`."""

    def _reconfig_init(self) -> None:
        """In the driver's constructor: no reconfiguration yet."""
        self._rescale_init()
        self.reconfigurations: list[ReconfigurationRecord] = []
        self._reconf: Reconfiguration | None = None
        self._reconf_reply: Any = None
        self._reconf_base: int | None = None
        self._reconfig_reset()

    def _reconfig_reset(self) -> None:
        """At each attempt's start: the assignment the workers start with (contiguous ranges; a
        restore puts every key group back at its default owner)."""
        self._reconfig_fail("the job restarted during the reconfiguration; every key group is back at its "
                            "default owner")
        self._splits_relayed = {}  # the new attempt's source tasks have gained no split yet
        self.assignment = Assignment.initial(self.flow.max_parallelism, self.P)
        self.assignment_at: dict[int, tuple[int, ...]] = {}  # checkpoint id -> owners, when moved

    def _reconfig_ended(self) -> None:
        """The job ended: a reconfiguration still running fails (its caller is told)."""
        self._reconfig_fail(f"the job ended ({self.status}) before the reconfiguration was done")

    def _reconfig_fail(self, why: str) -> None:
        running = self._reconf
        if running is not None:
            running.fail(why)
            self._reply_reconfig(running)
            self._reconf = None
            self._reconf_base = None
        joining, self._joining = self._joining, None
        if joining is not None:  # workers started for a join that never ran: stopped
            for p in joining.procs:
                p.kill()
                p.wait()
        self._drain_from = None
        # the counts of splits relayed to the source tasks stay: a join that failed before its
        # first step leaves the tasks running (had they been forgotten, an end of input reported
        # before a later handover's splits arrived would be taken for the task's end)

    def _record_assignment(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` is about to be triggered: the assignment it holds is
        the one after every step already sent to the sources (their markers go before its
        barriers on every channel). Recorded in its manifest when it is not the default."""
        owners = self.assignment
        reconf = self._reconf
        if reconf is not None and reconf.current is not None:
            owners = owners.applied(reconf.current.moves)
        if owners != Assignment.initial(self.flow.max_parallelism, self.P):
            self.assignment_at[checkpoint_id] = owners.owners

    def reconfig_live_bases(self) -> set[int]:
        """Checkpoints GC must keep while a reconfiguration runs (see the module docstring)."""
        base = self._reconf_base
        if self._reconf is None or base is None:
            return set()
        return {cid for cid in self._manifests if cid >= base}

    # ------------------------------------------------------------------ requests
    def _serve_reconfig(self, run: Any, req: m.ReconfigRequest) -> None:
        try:
            if run.life.sources_exhausted:
                raise ReconfigurationError(f"job {self.flow.name!r} is finishing (its input has ended): nothing "
                                           "is left to move key groups for")
            reconf = self._plan_reconfig(req)
        except ReconfigurationError as exc:
            req.reply.put(exc)
            return
        self._reconf, self._reconf_reply = reconf, req.reply
        self.reconfigurations.append(reconf.record)
        self._reconf_base = self._last_completed_id
        log.info(f"[abs] job {self.flow.name!r}: reconfiguration {reconf.record.id} ({req.kind}, {req.strategy}): "
                 f"{reconf.record.before} -> {reconf.record.after}, {len(reconf.steps)} step(s)")
        if reconf.steps[0].phase == JOIN:
            try:
                self._prepare_join(run, reconf.steps[0].workers)  # the join step starts once they are connected
            except ReconfigurationError as exc:  # nothing changed: the job runs on
                self._reconfig_fail(str(exc))
            except WorkerLostError as exc:
                if any(p.poll() not in (None, 0) for p in run.procs):  # not a new one: a worker of the job
                    self._reconfig_fail(f"a worker of the job was lost while the new workers started: {exc}")
                else:
                    self._reconfig_fail(f"the new workers failed while they connected: {type(exc).__name__}: {exc}")
                raise
            except Exception as exc:
                self._reconfig_fail(f"the new workers failed while they connected: {type(exc).__name__}: {exc}")
                raise
            return
        self._start_step(run)

    def _plan_reconfig(self, req: m.ReconfigRequest) -> Reconfiguration:
        if self._reconf is not None:
            raise ReconfigurationError(
                f"job {self.flow.name!r}: reconfiguration {self._reconf.record.id} is still running; wait for it "
                "(the call that started it returns when it is done) and ask again"
            )
        if self.config.priority_barriers:
            raise ReconfigurationError(
                f"job {self.flow.name!r} takes unaligned checkpoints: live reconfiguration of such a job is not "
                "supported yet; take a savepoint and restore the job from it, or use mode='aligned' without "
                "alignment_timeout"
            )
        if self.flow.has_loops:
            raise ReconfigurationError(
                f"job {self.flow.name!r} has an iteration: live reconfiguration of loops is not supported yet; take "
                "a savepoint (handle.savepoint(...)) and restore the job from it at the new parallelism"
            )
        keyed = [n.uid for n in self.flow.nodes if n.kind in KEYED_KINDS]
        if not keyed and req.kind != "rescale":
            raise ReconfigurationError(
                f"job {self.flow.name!r} has no keyed operator (process, reduce, aggregate): there are no key "
                "groups to move"
            )
        check_strategy(req.strategy, req.batch)
        if req.kind == "move":
            key_groups, to = req.args
            target = move_target(self.assignment, key_groups, to)
        elif req.kind == "rebalance":
            (assignment,) = req.args
            target = rebalance_target(self.assignment, assignment)
        elif req.kind == "rescale":
            (workers,) = req.args
            self._check_rescale(workers)
            target, steps = plan_rescale(self.assignment, workers, req.strategy, req.batch)
            start = self.assignment.widened(max(self.P, workers))
            return Reconfiguration(len(self.reconfigurations) + 1, req.kind, req.strategy, start, target, steps, keyed,
                                   1 + max((s.step for r in self.reconfigurations for s in r.steps), default=0),
                                   self.clock)
        else:
            raise ReconfigurationError(f"unknown reconfiguration {req.kind!r}")
        steps = plan_steps(self.assignment, target, req.strategy, req.batch)
        rid = len(self.reconfigurations) + 1
        return Reconfiguration(rid, req.kind, req.strategy, self.assignment, target, steps, keyed,
                               1 + max((s.step for r in self.reconfigurations for s in r.steps), default=0),
                               self.clock)

    def _reply_reconfig(self, reconf: Reconfiguration) -> None:
        reply, self._reconf_reply = self._reconf_reply, None
        if reply is None:
            return
        if reconf.record.status == "COMPLETED":
            reply.put(reconf.record)
        else:
            reply.put(ReconfigurationError(f"reconfiguration {reconf.record.id} failed: {reconf.record.error}"))

    # ------------------------------------------------------------------ steps
    def _start_step(self, run: Any) -> None:
        reconf = self._reconf
        assert reconf is not None
        nxt = reconf.start_next()
        if nxt is None:
            return
        sid, step = nxt
        base = self._last_completed_id
        manifest = self._manifests.get(base) if base else None
        if manifest is not None:  # Rhino: the new owners read the moved key groups' chains now
            by_target: dict[int, dict] = {}
            for mv in step.moves:
                for uid, states in manifest.keyed.items():
                    for state, by_kg in states.items():
                        chain = by_kg.get(mv.key_group)
                        if chain:
                            by_target.setdefault(mv.target, {}).setdefault(uid, {}).setdefault(state, {})[
                                mv.key_group] = list(chain)
                            reconf.on_full_size(sum(ref.bytes for ref in chain))
            for target, chains in by_target.items():
                run.conns[target].send(m.Preload(sid, base, chains))
        moves = tuple((mv.key_group, mv.target) for mv in step.moves)
        run.coord.defer_periodic = True  # see CheckpointCoordinator.defer_periodic
        split_moves: tuple = ()
        if step.phase in (JOIN, DRAIN):  # the sources' splits even out over the workers
            split_moves = self._split_moves(step.workers)
            reconf.expect(*(("splits", uid, a, b) for uid, a, b, _splits in split_moves))
        if step.phase == DRAIN and self.checkpointing:
            reconf.expect(("checkpoint",))
        elif step.phase == RETIRE:
            leaving, _sources = self._task_keys(range(step.workers, self.P))
            reconf.expect(*(("done", key) for key in leaving))
            for key in leaving:  # checkpoints triggered after the retire step do not wait for them
                run.coord.on_task_finished(key)
        self._broadcast(run, m.StartStep(sid, moves, base, step.workers, step.phase, split_moves))
        if step.phase == DRAIN and self.checkpointing and not split_moves:
            self._drain_from = run.coord.next_id
            self._request_drain_checkpoint(run)
        # nothing to wait for (a join when no operator keeps keyed state, a drain of workers that
        # read no split when the job does not checkpoint): the step is complete at once
        if reconf.complete_idle():
            self._step_done(run)

    def _on_reconfig_message(self, run: Any, msg: Any) -> None:
        if isinstance(msg, m.PeersAdded):
            self._on_peers_added(run, msg.index)
            return
        if isinstance(msg, m.SplitsHandover):
            self._on_splits(run, msg)
            return
        reconf = self._reconf
        if reconf is None:
            raise m.unexpected(msg, f"job {self.flow.name!r}: the driver", f"worker {getattr(msg, 'source', '?')}",
                               "no reconfiguration message: none runs")
        if isinstance(msg, m.KeyGroupHandover):
            reconf.on_handover(msg.nbytes, msg.full)
            run.conns[msg.target].send(msg)  # relayed to the new owner's installer
            return
        if reconf.on_installed(msg.operator, msg.key_group, msg.read_bytes):
            self._step_done(run)

    def _step_done(self, run: Any) -> None:
        """The current step is complete: the next one, or the end of the reconfiguration."""
        reconf = self._reconf
        assert reconf is not None
        # a periodic checkpoint that fell due during the step goes now, between two steps
        run.coord.defer_periodic = False
        self._handle(run, run.coord.tick())
        self.assignment = reconf.assignment
        if reconf.done:
            self._reconf = None
            self._reconf_base = None
            log.info(f"[abs] job {self.flow.name!r}: reconfiguration {reconf.record.id} done in "
                     f"{reconf.record.duration:.3f} s, {reconf.record.bytes_moved} bytes moved")
            self._reply_reconfig(reconf)
        else:
            self._start_step(run)

"""Workers joining and leaving a running job: the driver's part of a rescale
(:func:`abs.reconfig.plan.plan_rescale` plans it; :mod:`abs.runtime.reconfigure` runs its
steps). :class:`Rescaling` is a part of :class:`~abs.runtime.driver.JobDriver`.

Growing from ``P`` to ``P'`` workers (before the first step, the *join*):

1. the executor starts workers ``P .. P'-1``; they go through the usual start-up handshake
   with no source splits and no key groups, and connect their channels to every worker;
2. every running worker gets :class:`~abs.runtime.messages.AddPeers`: it connects its
   outgoing channels to the new workers (the senders wait in their writers until the join
   step's marker) and accepts theirs (each reaches its task as a new input channel before
   anything arrives on it), then answers ``PeersAdded``;
3. the new workers start, the coordinator and the job's lifecycle count their tasks from
   here, and the join step goes to every source: its marker is the first element on every new
   channel, so the new channels enter each task's alignment there (no checkpoint before the
   join waits for them, every one after does). Its moves and the next steps' fill the new
   workers with key groups.

Shrinking (after the steps that move every key group off workers ``P' .. P-1``):

* *drain*: the leaving workers' source tasks hand their splits over (offsets at the marker,
  relayed to the new owners, which wait for them before their next snapshot) and no record is
  sent to the leaving workers any more; when checkpointing, a checkpoint after the drain
  commits what their sinks wrote;
* *retire*: the channels to and from the leaving workers end; once their tasks are done the
  workers shut down and leave the job's bookkeeping.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from multiprocessing.connection import Listener, wait
from typing import Any

from ..errors import WorkerLostError
from ..reconfig.plan import DRAIN, ReconfigurationError, spread_splits
from . import messages as m
from .plan import task_key
from .supervision import Acceptor

log = logging.getLogger(__name__)

__all__ = ["Rescaling"]


class RunningWorkerLost(WorkerLostError):
    """A running worker died, closed its connection or went silent (heartbeat timeout) while a
    rescale started new workers: the attempt fails, as it would in the message loop."""


@dataclasses.dataclass
class _Joining:
    """Workers started for a join, not yet part of the running job."""

    workers: int  # the number of workers with them
    procs: list  # indexed from the first new worker
    conns: dict  # worker index -> control connection
    waiting: set  # running workers that have not answered PeersAdded


class Rescaling:
    """The rescale part of :class:`~abs.runtime.driver.JobDriver` (see the module docstring)."""

    def _rescale_init(self) -> None:
        self._joining: _Joining | None = None
        self._drain_from: int | None = None  # the first checkpoint id after a drain step
        self._splits_relayed: dict[str, int] = {}  # source task -> split handovers relayed to it
        self._retired_records: dict[str, int] = {}  # records counted by workers that left
        self._split_owners: dict[str, dict] = {}  # source uid -> split -> the worker reading it

    def _check_rescale(self, workers: Any) -> None:
        if type(workers) is not int:
            raise ReconfigurationError(f"rescale({workers!r}): the number of workers must be an int")
        if workers > self.P and not hasattr(self.executor, "launch"):
            raise ReconfigurationError(
                f"rescale({workers}): {type(self.executor).__name__} cannot start workers while the job runs "
                "(it starts all of them at once); stop the job with a savepoint and restore it with the new "
                "parallelism, or run on LocalExecutor"
            )
        why = self.executor.check_launch(workers - self.P) if workers > self.P and hasattr(
            self.executor, "check_launch") else None
        if why:
            raise ReconfigurationError(f"rescale({workers}): {why}")

    # ------------------------------------------------------------------ join
    def _task_keys(self, workers: range) -> tuple[list[str], list[str]]:
        keys = [task_key(t.index, w) for t in self.plan.tasks for w in workers]
        sources = [task_key(t.index, w) for t in self.plan.tasks if t.is_source for w in workers]
        return keys, sources

    def _prepare_join(self, run: Any, workers: int) -> None:
        """Steps 1 and 2 of a join (see the module docstring); step 3 runs once every running
        worker answered (:meth:`_on_peers_added`)."""
        import cloudpickle

        first = self.P
        new = range(first, workers)
        host = self.executor.driver_host() if hasattr(self.executor, "driver_host") else "127.0.0.1"
        bind = self.executor.driver_bind_host() if hasattr(self.executor, "driver_bind_host") else host
        listener = Listener((bind, 0), authkey=self._secret, backlog=128)  # the new workers connect at once
        address = [host, listener.address[1]]  # where the new workers reach it (as at start)
        procs: list = []
        conns: dict[int, Any] = {}
        told = False  # the running workers heard of the new ones: a failure from here fails the attempt
        acceptor: Acceptor | None = None
        try:
            for i in new:
                procs.append(self.executor.launch(i, {"driver": address, "secret": self._secret.hex(), "index": i}))
            view = list(run.procs) + procs  # index = worker index, for the start-up checks
            accepted: list = []
            acceptor = Acceptor(listener, len(new), accepted)
            deadline = time.monotonic() + self.startup_timeout
            while acceptor.thread.is_alive() and time.monotonic() < deadline:
                acceptor.thread.join(0.1)
                self._check_procs(view, run.conns)
                self._watch_running(run)
            if len(accepted) < len(new):
                raise WorkerLostError(f"only {len(accepted)} of {len(new)} new workers connected within "
                                      f"{self.startup_timeout:.0f} s")
            for c in accepted:
                hello = c.recv()
                if not isinstance(hello, m.Hello) or hello.index not in new:
                    raise m.unexpected(hello, f"job {self.flow.name!r}: the driver", "a joining worker", "Hello")
                conns[hello.index] = c
                if hasattr(view[hello.index], "bind_pid"):
                    view[hello.index].bind_pid(hello.pid)
            spec = dataclasses.replace(self._spec({}, self._attempt), parallelism=workers,
                                       routing=tuple(self.assignment.owners))
            payload = cloudpickle.dumps(spec)
            for i, c in conns.items():
                c.send(m.JobSpec(payload, m.WorkerAssignment(i, {}, key_groups=())))
            listening = self._gather(conns, m.Listening, view, idle=lambda: self._watch_running(run))
            known = list(self._addresses[:first]) + [listening[i].address for i in new]
            for c in conns.values():
                c.send(m.Peers(tuple(known)))
            told = True
            self._broadcast(run, m.AddPeers(first, tuple(known[first:]), workers))
            self._gather(conns, m.Ready, view, idle=lambda: self._watch_running(run))
        except Exception as exc:
            for c in conns.values():
                c.close()
            for p in procs:
                p.kill()
                p.wait()
            if told or isinstance(exc, RunningWorkerLost) or any(p.poll() not in (None, 0) for p in run.procs):
                raise  # told, or a running worker was lost: the attempt fails (and restarts)
            raise ReconfigurationError(f"rescale({workers}): the new workers did not start ({type(exc).__name__}: "
                                       f"{exc}); nothing was changed") from exc
        finally:
            if acceptor is not None:
                acceptor.close()
            else:
                listener.close()
        self._addresses = tuple(known)
        self._joining = _Joining(workers, procs, conns, set(run.conns))

    def _watch_running(self, run: Any) -> None:
        """While a join waits on its new workers: read what the running workers sent (kept for
        the message loop, which handles it first, in order), so that they count as seen, and
        fail the attempt on one silent for longer than the heartbeat timeout (hung: stopped,
        or stuck), as the loop would. Without it a running worker that hung while new workers
        started was found only when they gave up connecting to it (a minute or more)."""
        for conn in wait(list(run.conns.values()), timeout=0):
            i = run.by_conn[id(conn)]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                try:
                    self._connection_lost(run, i)  # names the dead worker, or the lost connection
                except WorkerLostError as exc:
                    raise RunningWorkerLost(str(exc)) from None
            run.life.on_seen(i, self.clock())
            run.deferred.append((i, msg))
        for silent in run.life.silent_workers(self.clock()):
            raise RunningWorkerLost(
                f"job {self.flow.name!r}: worker {silent.worker} sent nothing for {silent.silent_for:.0f} s while new "
                "workers started (heartbeat timeout); it is hung or overloaded"
            )

    def _on_peers_added(self, run: Any, i: int) -> None:
        joining = self._joining
        if joining is None:
            raise m.unexpected(m.PeersAdded(i), f"job {self.flow.name!r}: the driver", f"worker {i}", "no PeersAdded")
        joining.waiting.discard(i)
        if joining.waiting:
            return
        # step 3: the new workers run, and count from the join step on
        self._joining = None
        first = self.P
        for i, c in joining.conns.items():
            c.send(m.Start())
            run.conns[i] = c
            run.by_conn[id(c)] = i
        run.procs.extend(joining.procs)
        keys, sources = self._task_keys(range(first, joining.workers))
        run.coord.add_tasks(keys)
        run.life.add_tasks(keys, sources, joining.conns, self.clock())
        self._resize(joining.workers)
        log.info(f"[abs] job {self.flow.name!r}: workers {first}..{joining.workers - 1} joined")
        self._start_step(run)

    def _resize(self, workers: int) -> None:
        """The driver's per-worker lists follow the number of workers."""
        for name, empty in (("_bytes_restored", 0), ("_restore_seconds", 0.0), ("restored_key_groups", None)):
            values = getattr(self, name)
            del values[workers:]
            values.extend((empty if empty is not None else {}) for _ in range(workers - len(values)))
        self.P = workers
        self._addresses = tuple(self._addresses[:workers])  # workers that left are no peers

    # ------------------------------------------------------------------ drain
    def _track_splits(self, assignments: list) -> None:
        """At each attempt's start: which worker reads which split of each source."""
        self._split_owners = {}
        for i, a in enumerate(assignments):
            for uid, splits in a.source_splits.items():
                for split in splits:
                    self._split_owners.setdefault(uid, {})[split] = i

    def _split_moves(self, workers: int) -> tuple:
        """The source splits a join or drain hands over: every source's splits evened out
        over ``workers`` workers with the fewest moves (workers that leave keep none)."""
        moves = []
        for uid, owners in sorted(self._split_owners.items()):
            for a, b, splits in spread_splits(owners, workers):
                moves.append((uid, a, b, splits))
        return tuple(moves)

    def _on_splits(self, run: Any, msg: m.SplitsHandover) -> None:
        reconf = self._reconf
        event = ("splits", msg.operator, msg.source, msg.target)
        if reconf is None or not reconf.waits_for(event):
            raise m.unexpected(msg, f"job {self.flow.name!r}: the driver", f"worker {msg.source}",
                               "no split handover: no step moves these splits")
        head = next(t.index for t in self.plan.tasks if t.is_source and self.flow.nodes[t.head].uid == msg.operator)
        target = task_key(head, msg.target)
        self._splits_relayed[target] = self._splits_relayed.get(target, 0) + 1
        run.life.on_splits_gained(target)
        for split in msg.splits:
            self._split_owners.setdefault(msg.operator, {})[split] = msg.target
        run.conns[msg.target].send(msg)
        draining = reconf.current is not None and reconf.current.phase == DRAIN
        if reconf.on_event(event):
            self._step_done(run)
        elif draining and self.checkpointing and not reconf.waits_for_any("splits"):
            # every split is at its new owner: a checkpoint now commits what the leaving
            # workers' sinks wrote (its barriers come after the drain marker everywhere)
            self._drain_from = run.coord.next_id
            self._request_drain_checkpoint(run)

    def _request_drain_checkpoint(self, run: Any) -> None:
        if not run.coord.pending_ids() and not run.coord.queued_requests():
            run.coord.request()
            self._handle(run, run.coord.tick())

    def _rescale_tick(self, run: Any) -> None:
        """Every round of the driver's loop: a drain step waiting for its checkpoint."""
        reconf = self._reconf
        if reconf is None or self._drain_from is None or not reconf.waits_for(("checkpoint",)):
            return
        if self._last_completed_id >= self._drain_from:
            self._drain_from = None
            if reconf.on_event(("checkpoint",)):
                self._step_done(run)
        else:
            self._request_drain_checkpoint(run)  # the one after the drain failed: another

    def is_stale_exhaustion(self, msg: m.SourceExhausted) -> bool:
        """A source reported its end before the splits relayed to it arrived: it reads again."""
        return msg.splits_gained < self._splits_relayed.get(msg.task, 0)

    # ------------------------------------------------------------------ retire
    def _on_leaving_done(self, run: Any, task: str) -> None:
        """A task of a leaving worker is done; once all are, the leaving workers shut down
        (their last acks and their Done arrive through the loop like any message)."""
        reconf = self._reconf
        if reconf is None or not reconf.waits_for(("done", task)):
            return
        if reconf.pending("done") == [("done", task)]:  # the last of them
            leaving = [w for w in sorted(run.conns) if w >= reconf.current.workers]
            reconf.expect(*(("gone", w) for w in leaving))
            for w in leaving:
                run.conns[w].send(m.Shutdown())
        if reconf.on_event(("done", task)):
            self._step_done(run)

    def _on_worker_done(self, run: Any, i: int, msg: m.Done) -> None:
        """Worker ``i`` sent its last report: a leaving worker is gone."""
        reconf = self._reconf
        if reconf is None or not reconf.waits_for(("gone", i)):
            raise m.unexpected(msg, f"job {self.flow.name!r}: the driver", f"worker {i}", "no Done: it is not leaving")
        for uid, n in msg.metrics.records_in.items():
            self._retired_records[uid] = self._retired_records.get(uid, 0) + n
        self._records.pop(i, None)
        self._worker_metrics.pop(i, None)
        proc = run.procs[i]
        try:
            proc.wait(30)
        except Exception:  # noqa: BLE001 - a worker that does not exit is killed
            proc.kill()
            proc.wait()
        conn = run.conns.pop(i)
        run.by_conn.pop(id(conn), None)
        conn.close()
        if reconf.on_event(("gone", i)):
            workers = reconf.assignment.workers
            del run.procs[workers:]
            keys, _sources = self._task_keys(range(workers, self.P))
            run.life.remove_tasks(keys, range(workers, self.P))
            for key in keys:
                self.task_load.pop(key, None)
                # a worker that joins later under the same index runs new tasks, whose count
                # of splits gained starts at 0 (else their end would look stale for ever)
                self._splits_relayed.pop(key, None)
            log.info(f"[abs] job {self.flow.name!r}: workers {workers}..{self.P - 1} left")
            self._resize(workers)
            self._step_done(run)

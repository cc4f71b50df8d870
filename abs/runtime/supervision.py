"""Supervising the workers of an attempt from the driver: launching them through an executor
and the start-up handshake, noticing a worker that died (and naming it rather than the
collateral failures of its peers), collecting their final reports, tearing them down,
driver-side fault injection, and failover (the restart log, the error of a job that gave up).

Waits are on the workers' connections and processes, each with a deadline; nothing sleeps a
fixed time. :class:`Supervision` is a part of :class:`~abs.runtime.driver.JobDriver`.
"""
from __future__ import annotations

import logging
import secrets
import socket
import subprocess
import threading
import time
from multiprocessing.connection import Listener, wait
from typing import Any, Callable

from ..errors import JobFailedError, StartupError, WorkerLostError
from ..options import RESTORE_KEYWORDS
from storage.errors import StorageError

from . import messages as m
from .restore_progress import RestoreProgress
from .worker import WorkerSpec

log = logging.getLogger(__name__)

__all__ = ["Supervision", "wait_for_exits", "Acceptor"]


class Acceptor:
    """Accepts ``n`` connections on ``listener`` in a daemon thread, into ``accepted``.

    A start-up (or a join) that fails before every worker connected (a worker died, a
    deadline passed) closes the listener with :meth:`close`: that wakes an ``accept`` still
    waiting (a plain close leaves it blocked, and the port listening, for the process's
    life) and the thread ends quietly. It used to die with a traceback on stderr
    ("OSError: listener is closed") when a worker connected as the listener closed."""

    def __init__(self, listener: Listener, n: int, accepted: list) -> None:
        self.listener = listener
        self._closed = False
        self.thread = threading.Thread(target=self._run, args=(n, accepted), daemon=True, name="abs-acceptor")
        self.thread.start()

    def _run(self, n: int, accepted: list) -> None:
        from multiprocessing import AuthenticationError

        try:
            for _ in range(n):
                accepted.append(self.listener.accept())
        except (OSError, EOFError, AuthenticationError):
            if not self._closed:
                raise

    def close(self) -> None:
        self._closed = True
        if self.thread.is_alive():
            sock = getattr(getattr(self.listener, "_listener", None), "_socket", None)
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (EINVAL)
            except OSError:
                pass
        self.listener.close()
        self.thread.join(5.0)


def wait_for_exits(procs: list, seconds: float, check: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
    """Give the workers' processes up to ``seconds`` to exit, calling ``check`` (which raises
    to end the wait) after each exit seen and once at the end. A worker's failure is often
    collateral (its peer died): this lets the peer's exit status arrive first."""
    deadline = clock() + seconds
    for p in procs:
        left = deadline - clock()
        if left <= 0:
            break
        try:
            p.wait(left)
        except subprocess.TimeoutExpired:
            continue
        check()
    check()


class Supervision:
    """The supervision steps of :class:`~abs.runtime.driver.JobDriver` (see the module docstring)."""

    _restore_tracker: RestoreProgress | None = None

    def _launch(self, spec: WorkerSpec, assignments: list, procs: list, conns: dict[int, Any]) -> None:
        """Start the workers and take them through the start-up handshake to the running
        state. Fills ``procs`` and ``conns`` as it goes, so that the caller tears down every
        worker started when any step fails: a failure here is a failure of the attempt,
        retried by the restart strategy like any other."""
        import cloudpickle

        secret = self._secret = secrets.token_bytes(32)  # a rescale's joining workers get it too
        host = self.executor.driver_host() if hasattr(self.executor, "driver_host") else "127.0.0.1"
        bind = self.executor.driver_bind_host() if hasattr(self.executor, "driver_bind_host") else host
        # every worker may connect at the same moment (forked ones start within milliseconds):
        # with the default backlog of 1, the kernel dropped the others' connection requests
        # while the driver authenticated one, and they retried a second later
        listener = Listener((bind, 0), authkey=secret, backlog=max(128, self.P))
        acceptor: Acceptor | None = None
        try:
            address = [host, listener.address[1]]  # where workers reach it (bind may be 0.0.0.0 or a NAT'd address)
            boots = [{"driver": address, "secret": secret.hex(), "index": i} for i in range(self.P)]
            if hasattr(self.executor, "launch_all"):  # e.g. a Spark barrier stage: all workers at once
                procs.extend(self.executor.launch_all(boots, self.flow.name))
            else:
                for i, boot in enumerate(boots):
                    procs.append(self.executor.launch(i, boot))
            accepted: list = []
            acceptor = Acceptor(listener, self.P, accepted)
            deadline = time.monotonic() + self.startup_timeout
            while acceptor.thread.is_alive() and time.monotonic() < deadline:
                acceptor.thread.join(0.1)
                self._check_procs(procs, conns)
            if len(accepted) < self.P:
                raise WorkerLostError(f"only {len(accepted)} of {self.P} workers connected within {self.startup_timeout:.0f} s")
            for c in accepted:
                hello = c.recv()
                if not isinstance(hello, m.Hello):
                    raise m.unexpected(hello, f"job {self.flow.name!r}: the driver", "a worker", "Hello")
                conns[hello.index] = c
                if hasattr(procs[hello.index], "bind_pid"):
                    procs[hello.index].bind_pid(hello.pid)
            self._restore_tracker = RestoreProgress.start(self.progress, assignments)
            payload = cloudpickle.dumps(spec)
            for i, c in conns.items():
                c.send(m.JobSpec(payload, assignments[i]))
            listening = self._gather(conns, m.Listening, procs)
            addresses = self._addresses = tuple(listening[i].address for i in range(self.P))
            for c in conns.values():
                c.send(m.Peers(addresses))
            for i, ready in self._gather(conns, m.Ready, procs).items():
                if self._restore_tracker is not None:
                    self._restore_tracker.report(i, ready.stats.bytes_restored)
                self._bytes_restored[i] = ready.stats.bytes_restored
                self._restore_seconds[i] = ready.stats.restore_seconds
                self.restored_key_groups[i] = ready.stats.key_groups
            for c in conns.values():
                c.send(m.Start())
        finally:
            if acceptor is not None:
                acceptor.close()
            else:
                listener.close()
            self._drop_probe()
            if self._restore_tracker is not None:
                self._restore_tracker.close()
                self._restore_tracker = None
        return procs, conns

    def _drop_probe(self) -> None:
        token, self._probe = self._probe, None
        if token is not None and self.store is not None:
            try:
                self.store.delete_probe(token)
            except StorageError as exc:  # a leftover probe is harmless (GC leaves it alone)
                log.warning(f"could not delete the storage probe: {exc}")

    def _gather(self, conns: dict[int, Any], kind: type, procs: list, idle: Any = None) -> dict[int, Any]:
        """The ``kind`` message of every worker (in any order); a worker that reports a
        failure, dies or closes its connection first fails the attempt with the cause.
        ``idle``: called between rounds of waiting (a join watches the running workers)."""
        pending = dict(conns)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.startup_timeout
        last_seen = {i: time.monotonic() for i in pending}  # starting workers send heartbeats
        while pending:
            now = time.monotonic()
            if now > deadline:
                raise WorkerLostError(
                    f"job {self.flow.name!r}: worker(s) {sorted(pending)} did not report {kind.__name__} within "
                    f"{self.startup_timeout:.0f} s"
                )
            silent = [i for i in pending if now - last_seen[i] > self.heartbeat_timeout]
            if silent:
                raise WorkerLostError(
                    f"job {self.flow.name!r}: worker {silent[0]} sent nothing for {now - last_seen[silent[0]]:.0f} s "
                    f"while starting (waiting for {kind.__name__}; heartbeat timeout); it is hung or overloaded"
                )
            for conn in wait(list(pending.values()), timeout=0.1):
                i = next(k for k, c in pending.items() if c is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._settle(procs, conns)
                    raise WorkerLostError(
                        f"job {self.flow.name!r}: worker {i} closed its connection while starting (waiting for {kind.__name__})"
                    ) from None
                last_seen[i] = time.monotonic()
                if isinstance(msg, kind):
                    got[i] = msg
                    del pending[i]
                elif isinstance(msg, m.TaskFailed):
                    self._startup_failed(i, msg, procs, conns)
                elif isinstance(msg, m.Heartbeat):
                    if msg.restored_bytes and self._restore_tracker is not None:
                        self._restore_tracker.report(i, msg.restored_bytes)
                elif isinstance(msg, (m.CollectCommit, m.Metrics)):
                    pass  # alive; a restored CollectSink re-commits what this driver committed with the manifest
                else:
                    raise m.unexpected(msg, f"job {self.flow.name!r}: the driver", f"worker {i}", kind.__name__)
            self._settle(procs, conns, wait_s=0.0)
            if idle is not None:
                idle()
        return got

    def _settle(self, procs: list, conns: dict, wait_s: float = 0.5) -> None:
        """While starting: a worker that died fails the attempt, with the failure it reported
        when it reported one (it exits after reporting), else as a lost worker. ``wait_s``
        lets exit statuses arrive: a worker's failure is often collateral (its peer died)."""
        wait_for_exits(procs, wait_s, lambda: self._settle_once(procs, conns))

    def _settle_once(self, procs: list, conns: dict) -> None:
        for i, p in enumerate(procs):
            code = p.poll()
            if code is None or code == 0:
                continue
            conn = conns.get(i)
            try:
                reported = conn.recv() if conn is not None and code > 0 and conn.poll(0.2) else None
            except (EOFError, OSError):
                reported = None
            if isinstance(reported, m.TaskFailed):
                self._startup_failed(i, reported, procs, conns, settle=False)
            self._check_procs(procs, conns)

    def _startup_failed(self, i: int, msg: m.TaskFailed, procs: list, conns: dict, settle: bool = True) -> None:
        """Raise the :class:`StartupError` of worker ``i``'s :class:`TaskFailed` report; first,
        a peer that was killed (the usual cause of a failure to connect) fails it instead."""
        phase = msg.phase or "starting"
        cause = msg.cause or (msg.traceback.strip().splitlines() or ["?"])[-1]

        def killed_peer() -> None:
            for k, p in enumerate(procs):
                code = p.poll()
                if k != i and code is not None and code < 0:
                    raise WorkerLostError(
                        f"job {self.flow.name!r}: worker {k} (pid {p.pid}) was killed by signal {-code} while the "
                        f"workers started; worker {i} failed with it while {phase}: {cause}"
                    )

        if settle:
            wait_for_exits(procs, 0.5, killed_peer)
        else:
            killed_peer()  # the peer's exit status is in already when this worker's is
        raise StartupError(
            f"job {self.flow.name!r}: worker {i} failed while {phase}: {cause}\n{msg.traceback}",
            permanent=msg.permanent,
        )

    def _check_procs(self, procs: list, conns: dict) -> None:
        for i, p in enumerate(procs):
            code = p.poll()
            if code is not None and code != 0:
                how = (getattr(p, "exit_detail", None)
                       or (f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"))
                raise WorkerLostError(
                    f"job {self.flow.name!r}: worker {i} (pid {p.pid}) {how}; no checkpoint after the last "
                    "complete one is used"
                )

    def _collect_done(self, conns: dict, procs: list) -> None:
        pending = set(conns)
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for conn in wait([conns[i] for i in pending], timeout=0.1):
                i = next(k for k, c in conns.items() if c is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    pending.discard(i)
                    continue
                if isinstance(msg, m.Done):
                    self._records[msg.index] = msg.metrics.records_in
                    self._worker_metrics[msg.index] = msg.metrics  # the final counts (subtask series)
                    for key, sample in msg.metrics.load.items():
                        self.task_load[key] = (self.task_load.get(key, (None, None))[1], sample)
                    pending.discard(i)
                elif isinstance(msg, (m.Collect, m.CollectCommit)):
                    self._on_collect(msg)

    def _teardown(self, procs: list, conns: dict) -> None:
        for c in conns.values():
            try:
                c.send(m.Stop())
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for c in conns.values():
            try:
                c.close()
            except OSError:
                pass


    def _driver_fault(self, point: str, procs: list) -> None:
        """Driver-side fault points kill a worker (``Fault.task`` ``"task<t>#<i>"`` names
        worker ``i``; ``"*"`` worker 0) with SIGKILL at the n-th hit."""
        for f in self.faults:
            if f.point != point or f.attempt != self._attempt:
                continue
            self._driver_hits[f] = self._driver_hits.get(f, 0) + 1
            if self._driver_hits[f] == f.nth:
                index = 0 if f.task in ("*", "driver") else int(f.task.split("#")[1])
                procs[index].kill()
                procs[index].wait()

    def _prepare_restart(self, attempt: int, exc: BaseException, delay: float) -> None:
        """Global failover: every worker is stopped; after the strategy's delay the next attempt
        restores this run's newest checkpoint that can be restored, else what the run started
        from (or starts over), rolling the sinks back to it (see ``_resolve_restore``)."""
        self._gc.drain()  # the restore reads the root as the last GC left it
        first_line = self._summary(exc)
        # the job is restarting from here on, through the back-off too: its dashboard and
        # metrics say so at once and show none of the stopped workers' figures as live ones
        self.restarts.append({
            "attempt": attempt,
            "error": first_line,
            "at": time.monotonic() - self.t_start,
            "restored_from": None,  # filled in once the restore is resolved
        })
        self.restored_from = None
        self._records = {}
        self._retired_records = {}
        self._worker_metrics = {}
        self.task_load = {}
        self._manifests = {}
        self._bases = {}
        self._last_completed_id = 0
        self.status = "RESTARTING"
        log.info(f"[abs] job {self.flow.name!r}: {first_line}; restart {attempt} of "
                 f"{self.restart.max_restarts} in {delay:.1f} s from the latest complete checkpoint")
        time.sleep(delay)  # the restart strategy's back-off (lifecycle.failover decided it)

    def _summary(self, exc: BaseException) -> str:
        """One line for the restart log and ``JobResult.restarts``: the first line of the error
        (it names the worker or operator), then its last one (the cause, e.g. the last line of
        a remote traceback) when the first does not hold it already; without the job's own
        ``job 'name': `` prefix, which the log line puts in front once."""
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        if not lines:
            return type(exc).__name__
        first = lines[0].removeprefix(f"job {self.flow.name!r}: ")
        if not isinstance(exc, JobFailedError):
            first = f"{type(exc).__name__}: {first}"  # e.g. a storage error while opening the root
        if len(lines) > 1 and lines[-1].split(": ", 1)[-1] not in first:
            first += f" {lines[-1]}"
        return first

    def _gave_up(self, exc: Exception) -> Exception:
        """The error of a job that has no restart left: our own errors now advise the restore
        (while restarts are left, the job restores itself and the advice would mislead). A
        storage error (a disk full or an object store down at every attempt) says so too: it
        is raised as itself, and without the advice it read as if no restart had been tried."""
        if isinstance(exc, (JobFailedError, StorageError)) and self.checkpointing:
            used = len(self.restarts)
            sep = "\n" if "\n" in str(exc) else "; "
            exc.args = (f"{exc}{sep}the job gave up after {used} restart(s) (RestartStrategy.max_restarts="
                        f"{self.restart.max_restarts}); {self._rerun_advice()}",) + exc.args[1:]
        return exc

    def _rerun_advice(self) -> str:
        """How to run a job that gave up again: restore='latest' only where its root holds a
        checkpoint to continue from (else that restore is refused, or a savepoint the run
        started from would be left behind)."""
        rs = self._restore_state
        latest = "run it again with restore='latest' to continue from its latest complete checkpoint"
        if self.completed or rs.origin == "latest" or (rs.origin == "exact" and rs.origin_url == self.storage_url):
            return latest
        if isinstance(self.restore, str) and self.restore not in RESTORE_KEYWORDS:
            # a savepoint elsewhere, and no checkpoint of this run completed
            return (f"no checkpoint of this run completed; run it again with restore={self.restore!r} as before to "
                    "start from that savepoint")
        try:
            holds = None if self.store is None else bool(self.store.list_checkpoints())
        except Exception:  # noqa: BLE001 - the root may be what failed; then it cannot be told
            holds = None
        if holds:
            return latest
        if holds is False:
            return ("its storage root holds no complete checkpoint yet, so restore='latest' would find nothing: run "
                    "it again as before (restore='latest-if-any' continues from a checkpoint when there is one)")
        return ("once the storage root is reachable, run it again with restore='latest-if-any' (it continues from the "
                "latest complete checkpoint when there is one, else starts fresh)")

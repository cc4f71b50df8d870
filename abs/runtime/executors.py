"""Executors: where a job's workers run. :class:`LocalExecutor` starts them as processes on
this machine (the embedded default); ``abs.runtime.spark`` has the Spark barrier-stage one.

An executor has ``launch(index, boot) -> process`` (or ``launch_all(boots, job_name)``), and
optionally ``check(parallelism, storage_url)``, ``driver_host()`` (where workers reach the driver)
and ``driver_bind_host()`` (where it listens); a process has ``poll``,
``wait``, ``kill`` and ``pid`` like :class:`subprocess.Popen`."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

from ..errors import ConfigError

__all__ = ["LocalExecutor"]

log = logging.getLogger(__name__)


class LocalExecutor:
    """Runs the workers as processes on this machine (the embedded default).

    ``pin_cpus=True`` binds worker ``i`` to one CPU, the ``i mod N``-th of the ``N`` CPUs
    this process may run on (Linux, ``sched_setaffinity``); each worker's snapshot writer
    process stays free to run on any of them. A worker's Python threads (task threads,
    source readers, the uploader) share one GIL, so it uses about one CPU at a time; kept on
    one CPU, the GIL's hand-overs between its threads stay in one core's caches. Measured on
    2 cores in interleaved rounds: +13 % throughput of the keyed ``process`` job without
    checkpoints at p=1 (5 of 5 rounds higher), +15 % with ABS at p=2 (3 of 4 rounds); runs
    of the reference workload an hour later, one setting after the other, were mixed, and the
    ABS cost relative to "off" did not shrink. Off by default: jobs sharing a machine would
    pin their workers to the same CPUs.

    ``start="auto"`` (the default) forks each worker from this process when that is safe (see
    :mod:`abs.runtime.forked`: Linux, and no other thread running here), and starts a fresh
    interpreter otherwise; ``start="spawn"`` always starts a fresh interpreter. A forked
    worker has its modules loaded already: measured on 2 cores, start-up to the first event
    of a tiny job fell from 0.29-0.86 s to 0.02-0.08 s (the driver's part of ``abs.run``).
    """

    def __init__(self, *, pin_cpus: bool = False, start: str = "auto") -> None:
        if pin_cpus and not hasattr(os, "sched_setaffinity"):
            raise ConfigError("LocalExecutor(pin_cpus=True) needs os.sched_setaffinity (Linux); leave pin_cpus off here")
        if start not in ("auto", "spawn"):
            raise ConfigError(f"LocalExecutor(start={start!r}): expected 'auto' (fork when safe) or 'spawn' "
                              "(always a fresh interpreter)")
        self.pin_cpus = pin_cpus
        self.start = start
        self._cpus = sorted(os.sched_getaffinity(0)) if pin_cpus else []

    def launch(self, index: int, boot: dict) -> Any:
        if self.pin_cpus:
            boot = {**boot, "cpu": self._cpus[index % len(self._cpus)]}
        if self.start == "auto":
            from .forked import fork_refusal, fork_worker

            refusal = fork_refusal()
            if refusal is None:
                return fork_worker(boot)
            log.debug("worker %d starts as a fresh interpreter: %s", index, refusal)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.Popen(
            [sys.executable, "-c", "from abs.runtime.worker_main import main; main()"], stdin=subprocess.PIPE, env=env, close_fds=True
        )
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(boot) + "\n").encode())
        proc.stdin.close()
        return proc

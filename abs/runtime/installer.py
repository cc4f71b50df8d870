"""A worker's installer thread (live reconfiguration, :mod:`abs.reconfig`): reads what the key
groups the worker gains build on -- ahead of the step for a :class:`~abs.runtime.messages.Preload`
(Rhino), else when their :class:`~abs.runtime.messages.KeyGroupHandover` arrives -- and gives
each key group's state, decoded, to the task that runs its operator
(:class:`~abs.runtime.messages.InstallState` on the task's control queue). Reading happens
here, off the task's thread, so the task's other key groups keep flowing meanwhile."""
from __future__ import annotations

import queue
import threading
import traceback
from typing import Any, Callable

import pyarrow as pa

from ..reconfig.transfer import unpack
from . import messages as m

__all__ = ["Installer"]


class Installer:
    def __init__(self, index: int, store: Any, tasks: Callable[[], Any], send: Callable[[Any], None]) -> None:
        self.index = index
        self.store = store  # the job's storage (None without)
        self._tasks = tasks  # -> the worker's tasks
        self._send = send  # to the driver
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._preloaded: dict[tuple, pa.Table] = {}  # chain (file ids) -> its resolved table
        self._thread = threading.Thread(target=self._run, name="installer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, msg: "m.Preload | m.KeyGroupHandover") -> None:
        self._queue.put(msg)

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            msg = self._queue.get()
            if msg is None:
                return
            try:
                if isinstance(msg, m.Preload):
                    # what an earlier step preloaded and no handover took (the old owner's chain
                    # had moved on by then) is not asked for again
                    self._preloaded.clear()
                    for by_state in msg.chains.values():
                        for by_kg in by_state.values():
                            for chain in by_kg.values():
                                self._read_base(chain, take=False)
                    continue
                read = 0
                base = {}
                for state, chain in msg.chains.items():
                    table, nbytes = self._read_base(chain, take=True)
                    base[state] = table
                    read += nbytes
                install = m.InstallState(msg.step, msg.operator, msg.key_group, base, unpack(msg.changes), read)
                tasks = [t for t in self._tasks() if t.keyed is not None and t.keyed.uid == msg.operator]
                if not tasks:
                    raise m.unexpected(msg, f"worker {self.index}", "the driver", "the state of a keyed operator")
                tasks[0].gate.put_control(install)
            except Exception:  # noqa: BLE001 - reported to the driver, which fails the job
                self._send(m.TaskFailed(f"worker{self.index}", "<reconfiguration>", traceback.format_exc()))
                return

    def _read_base(self, chain: list, *, take: bool) -> tuple[pa.Table, int]:
        """The resolved table of ``chain`` and the bytes read for it now (0 when preloaded);
        ``take``: for an install (the preloaded copy is dropped), else kept for one."""
        key = tuple(ref.id for ref in chain)
        table = self._preloaded.pop(key, None) if take else self._preloaded.get(key)
        if table is not None:
            return table, 0
        if self.store is None:
            raise RuntimeError(f"worker {self.index}: a key group's state builds on stored chains, but this "
                               "worker has no storage (a bug: handovers without storage carry the whole state)")
        table = self.store.read_chain(chain)
        if not take:
            self._preloaded[key] = table
        return table, sum(ref.bytes for ref in chain)

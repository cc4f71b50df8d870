"""A worker's data channels to its peers: at start-up one authenticated connection per
outgoing remote channel (and, when barriers are announced for unaligned checkpoints, one
more for the announcements), the incoming ones accepted and fed into the tasks' gates; later,
the channels of workers that join a running job (a rescale). A part of
:class:`~abs.runtime.worker.Worker`."""
from __future__ import annotations

import json
import threading
import traceback
from typing import Any

from ..dataflow import FORWARD
from . import messages as m
from .channels import InputGate, LocalSender, RemoteSender, accept_channel, connect_channel, decode

__all__ = ["WorkerChannels"]


class WorkerChannels:
    """Channel set-up of :class:`~abs.runtime.worker.Worker` (see the module docstring)."""

    index: int
    spec: Any
    plan: Any
    gates: dict
    secret: bytes
    listener: Any

    def connect(self, peers: list) -> None:
        """Open one connection per outgoing remote channel, accept the incoming ones."""
        P, i = self.spec.parallelism, self.index
        self.fault("before_connect", None)
        incoming = []  # (task, channel) expected from other workers
        for t in self.plan.tasks:
            for edge, _up, partition in t.inputs:
                if partition != FORWARD:
                    incoming += [(t.index, t.channel_of(edge, s, P)) for s in range(P) if s != i]
        if self.spec.priority_barriers:  # and a connection for each one's barrier announcements
            incoming += [(task, ch, "priority") for task, ch in incoming]
        accepted: dict[tuple, Any] = {}
        acceptor = threading.Thread(target=self._accept, args=(len(incoming), accepted), daemon=True)
        acceptor.start()
        self.senders: dict[tuple, list] = {}
        self.joining: dict[tuple, list] = {}  # senders to joining workers, per writer (see add_peers)
        for t in self.plan.tasks:
            for out in t.outputs:
                target = self.plan.tasks[out.target_task]
                dests = [i] if out.partition == FORWARD else list(range(P))
                senders = []
                for d in dests:
                    ch = target.channel_of(out.edge_index, i, P)
                    if d == i:
                        senders.append(LocalSender(self.gates[target.index], ch))
                    else:
                        hello = json.dumps({"task": target.index, "channel": ch}).encode()
                        conn = connect_channel(tuple(peers[d]), self.secret, hello)
                        priority = None
                        if self.spec.priority_barriers:
                            hello = json.dumps({"task": target.index, "channel": ch, "priority": True}).encode()
                            priority = connect_channel(tuple(peers[d]), self.secret, hello)
                        senders.append(RemoteSender(conn, priority))
                self.senders[(t.index, out.from_node, out.target_task, out.edge_index)] = senders
                self.joining[(t.index, out.from_node, out.target_task, out.edge_index)] = []
        acceptor.join(timeout=60)
        if len(accepted) != len(incoming):
            raise RuntimeError(f"worker {i}: only {len(accepted)} of {len(incoming)} input channels connected")
        for (task, ch, *priority), conn in accepted.items():
            receive = self._receive_announcements if priority else self._receive
            threading.Thread(target=receive, args=(conn, self.gates[task], ch), daemon=True).start()
        # from now on a channel that connects comes from a worker joining the running job
        self._joined_channels = threading.Semaphore(0)
        threading.Thread(target=self._accept_joining, name="join-acceptor", daemon=True).start()

    def _accept(self, expected: int, accepted: dict) -> None:
        while len(accepted) < expected:
            conn = accept_channel(self.listener)
            hello = json.loads(conn.recv_bytes())
            accepted[(hello["task"], hello["channel"]) + (("priority",) if hello.get("priority") else ())] = conn

    def _accept_joining(self) -> None:
        """Channels of joining workers (a rescale): each becomes a new input channel of its
        task's gate, announced to the task before its first element (ChannelAdded)."""
        while True:
            try:
                conn = accept_channel(self.listener)
                hello = json.loads(conn.recv_bytes())
            except (OSError, EOFError):
                return  # the listener closed: the worker stops
            gate = self.gates[hello["task"]]
            channel = gate.add_channel(m.ChannelAdded)
            threading.Thread(target=self._receive, args=(conn, gate, channel), daemon=True).start()
            self._joined_channels.release()

    def add_peers(self, msg: m.AddPeers) -> None:
        """Workers joined the running job: connect this worker's outgoing channels to them (the
        senders wait in their writers' ``joining`` lists for the join step's marker) and wait
        until each of their channels into this worker's tasks has connected."""
        i, workers = self.index, msg.workers
        expected = 0
        for t in self.plan.tasks:
            expected += sum(len(msg.addresses) for _e, _up, p in t.inputs if p != FORWARD)
            for out in t.outputs:
                if out.partition == FORWARD:
                    continue
                target = self.plan.tasks[out.target_task]
                joining = self.joining[(t.index, out.from_node, out.target_task, out.edge_index)]
                for k, address in enumerate(msg.addresses):
                    conn = connect_channel(tuple(address), self.secret)
                    ch = target.channel_of(out.edge_index, i, workers)
                    conn.send_bytes(json.dumps({"task": target.index, "channel": ch}).encode())
                    joining.append(RemoteSender(conn))
        for _ in range(expected):
            if not self._joined_channels.acquire(timeout=60):
                raise RuntimeError(f"worker {i}: the channels of joining workers {msg.first}.. did not connect "
                                   "within 60 s")
        self.send_to_driver(m.PeersAdded(i))

    def _receive(self, conn: Any, gate: InputGate, channel: int) -> None:
        try:
            while True:
                item = decode(conn.recv_bytes())
                gate.put(channel, item)
        except (EOFError, OSError):
            pass  # the sender closed the channel (after EOS, or it died: the driver sees that)
        except Exception:  # noqa: BLE001
            self.send_to_driver(m.TaskFailed(f"worker{self.index}", "<channel>", traceback.format_exc()))

    def _receive_announcements(self, conn: Any, gate: InputGate, channel: int) -> None:
        try:
            while True:
                gate.put_priority(channel, decode(conn.recv_bytes()))
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001
            self.send_to_driver(m.TaskFailed(f"worker{self.index}", "<channel>", traceback.format_exc()))

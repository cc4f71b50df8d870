"""Remote channels: bounded in-flight data on real loopback TCP connections."""
from __future__ import annotations

import os
import struct
import threading
import time
from multiprocessing.connection import Listener

import pytest

from abs.runtime.channels import SOCKET_BUFFER_BYTES, accept_channel, connect_channel

# the write system call's number, by machine: multiprocessing's Connection sends with os.write
_WRITE_SYSCALL = {"x86_64": 1, "aarch64": 64, "arm64": 64, "ppc64le": 4, "s390x": 4, "riscv64": 64}


def _can_see_system_calls() -> bool:
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/syscall") as f:
            f.read()
    except OSError:
        return False
    return os.uname().machine in _WRITE_SYSCALL


pytestmark = pytest.mark.skipif(not _can_see_system_calls(),
                                reason="needs Linux's /proc/<pid>/task/<tid>/syscall to see a thread blocked in write")

FRAME = 64 * 1024  # about one batch of 4096 (key, value) int64 rows


def _pair():
    listener = Listener(("127.0.0.1", 0), authkey=b"secret")
    accepted: dict = {}
    acceptor = threading.Thread(target=lambda: accepted.setdefault("conn", accept_channel(listener)))
    acceptor.start()
    sender = connect_channel(listener.address, b"secret")
    acceptor.join(timeout=10)
    return listener, sender, accepted["conn"]


def _blocked_in_write(thread: threading.Thread) -> bool:
    """Whether ``thread`` sleeps inside a ``write`` system call: what a blocking socket does
    when the kernel's buffers are full, and only then (it waits for room). Read from
    ``/proc/self/task/<tid>``: the thread's state and the system call it is in."""
    task = f"/proc/self/task/{thread.native_id}"
    try:
        with open(f"{task}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"{task}/syscall") as f:
            call = f.read().split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False  # the thread ended, or it is between two reads
    return state == "S" and call == str(_WRITE_SYSCALL[os.uname().machine])


def _sent_until_stalled(count: list, sender: threading.Thread, limit: float = 120.0) -> int:
    """Wait until the sending thread sleeps in ``write`` with its count settled (the kernel
    takes no more: the receiver reads nothing, so the thread stays there); return the count.
    A look too early only finds fewer frames in flight; ``limit`` only bounds a hang."""
    deadline = time.monotonic() + limit
    seen, times = None, 0
    while time.monotonic() < deadline and sender.is_alive():
        if not _blocked_in_write(sender):
            seen, times = None, 0
        elif seen != count[0]:
            seen, times = count[0], 1
        else:
            times += 1
            if times == 3:
                return seen  # blocked at the same count, looked at three times: for good
        time.sleep(0.01)
    pytest.fail(f"the sender never blocked against a receiver that reads nothing ({count[0]} frames sent)")


def test_a_stalled_receiver_holds_a_bounded_amount_and_loses_nothing():
    listener, sender, receiver = _pair()
    count = [0]

    def send() -> None:
        try:
            while True:
                sender.send_bytes(struct.pack("<q", count[0]) + bytes(FRAME - 8))
                count[0] += 1
        except OSError:
            pass  # the receiver closed at the end of the test

    sending = threading.Thread(target=send, daemon=True)
    sending.start()
    try:
        stalled_at = _sent_until_stalled(count, sending)
        in_flight = stalled_at * FRAME
        # both kernels' buffers (Linux reserves twice the requested size), plus a frame in the
        # sender's hands; unbounded, loopback buffers took ~3.9 MB here
        assert in_flight <= 4 * SOCKET_BUFFER_BYTES + 2 * FRAME, f"{in_flight} bytes in flight"
        assert stalled_at >= 1
        # everything the sender got rid of arrives, whole and in order, and the channel moves on
        for i in range(stalled_at + 5):
            frame = receiver.recv_bytes()
            assert len(frame) == FRAME and struct.unpack_from("<q", frame)[0] == i
    finally:
        receiver.close()  # the sender's next write fails, and its thread ends
        sending.join(timeout=10)
        sender.close()
        listener.close()

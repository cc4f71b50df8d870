"""Remote channels: bounded in-flight data on real loopback TCP connections."""
from __future__ import annotations

import struct
import threading
import time
from multiprocessing.connection import Listener

import pytest

from abs.runtime.channels import SOCKET_BUFFER_BYTES, accept_channel, connect_channel

FRAME = 64 * 1024  # about one batch of 4096 (key, value) int64 rows


def _pair():
    listener = Listener(("127.0.0.1", 0), authkey=b"secret")
    accepted: dict = {}
    acceptor = threading.Thread(target=lambda: accepted.setdefault("conn", accept_channel(listener)))
    acceptor.start()
    sender = connect_channel(listener.address, b"secret")
    acceptor.join(timeout=10)
    return listener, sender, accepted["conn"]


def _sent_until_stalled(count: list, limit: float = 10.0) -> int:
    """Wait until the sender's count stops moving for 0.3 s; return it."""
    deadline = time.monotonic() + limit
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        if count[0] != last:
            last, since = count[0], time.monotonic()
        elif time.monotonic() - since > 0.3:
            return last
        time.sleep(0.02)
    pytest.fail(f"the sender never stalled against a receiver that reads nothing ({count[0]} frames sent)")


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
        stalled_at = _sent_until_stalled(count)
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

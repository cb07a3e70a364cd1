"""``writev_full``: every piece written, in order, after a real short write (a pipe write cut by a signal)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvdi.connectors.shared_storage.fileio import writev_full


@pytest.mark.parametrize("told", [True, False])
def test_a_short_write_goes_on_where_it_stopped(told: bool) -> None:
    """A blocking pipe write of more than the pipe holds, interrupted by SIGALRM once the pipe is full, returns
    short (PEP 475 retries only a call that moved nothing); the rest follows once a reader drains the pipe."""
    pieces = [os.urandom(n) for n in (1000, 70_000, 0, 3, 200_000, 64 * 1024)]
    want = b"".join(pieces)
    r, w = os.pipe()
    got: list[bytes] = []

    def drain() -> None:
        time.sleep(0.4)  # after the alarm cut the first write
        while chunk := os.read(r, 1 << 16):
            got.append(chunk)

    old = signal.signal(signal.SIGALRM, lambda *_: None)
    reader = threading.Thread(target=drain)
    reader.start()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        done = writev_full(w, pieces, len(want) if told else None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.close(w)
        reader.join()
        os.close(r)
    assert done == len(want)
    assert b"".join(got) == want

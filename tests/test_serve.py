"""`epd serve`'s stop while its children start, with a stand-in child."""

import os
import signal
import sys
import threading
import time

import pytest

from epd import serve
from epd.runtime.process import stop_event

# A child that takes its time to start and shrugs off SIGTERM, as a role loading its model
# does until it has loaded.
LOADING = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('loading', flush=True); time.sleep(30)"
)


def test_a_second_stop_signal_while_the_children_start_kills_them_soon(monkeypatch):
    monkeypatch.setattr(serve, "HURRY_S", 0.5)
    child = serve.Child("prefill", [sys.executable, "-c", LOADING])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def ctrl_c_twice() -> None:
        while not child.tail:  # it shrugs off SIGTERM from now on
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # the first: the children stop
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)  # the second: was ignored until they had stopped

    again = threading.Thread(target=ctrl_c_twice, daemon=True)
    started = time.monotonic()
    try:
        stop = stop_event(grace_s=3600)  # as `epd serve` runs (its exit timer out of the way)
        serve.stop_at_once_when_asked_again([child], stop)
        again.start()
        with pytest.raises(SystemExit) as exited:
            serve.start_all([child], stop)
    finally:
        again.join(5)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert exited.value.code == 0
    assert time.monotonic() - started < 5  # not STOP_TIMEOUT_S (10 s)
    assert child.process is not None and child.process.returncode == -signal.SIGKILL

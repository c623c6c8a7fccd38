"""The others count as idle while they keep less than a share of a core busy."""

import subprocess
import sys
import time

import pytest

from epd.runtime import idle
from epd.runtime.idle import OthersIdle


@pytest.fixture
def machine(monkeypatch):
    """A fake machine: ticks of every process, of this one, and the clock (seconds)."""
    state = {"all": 0, "own": 0, "now": 0.0}
    monkeypatch.setattr(idle, "machine_busy_ticks", lambda: state["all"])
    monkeypatch.setattr(idle, "own_busy_ticks", lambda: state["own"])
    monkeypatch.setattr(idle, "TICKS", 100)
    return state


def test_others_are_idle_while_they_use_little_of_a_core(machine):
    others_idle = OthersIdle(window_s=0.1, idle_cores=0.3, clock=lambda: machine["now"])
    assert not others_idle()  # nothing measured yet
    machine.update(now=0.2, all=40, own=38)  # this process on 1.9 cores, the others 0.1
    assert others_idle()
    machine.update(now=0.25, all=100)  # within the window: the verdict holds
    assert others_idle()
    machine.update(now=0.4, all=100, own=58)  # 60 ticks in 0.2 s, 20 of them ours: 2 cores
    assert not others_idle()


def test_without_proc_the_others_never_count_as_idle(monkeypatch):
    def unreadable():
        raise OSError("no /proc")

    monkeypatch.setattr(idle, "machine_busy_ticks", unreadable)
    clock = iter([0.0, 1.0, 2.0, 3.0])
    others_idle = OthersIdle(clock=lambda: next(clock))
    assert not others_idle() and not others_idle()


def test_this_machines_counts_are_read():
    assert idle.own_busy_ticks() >= 0 and idle.machine_busy_ticks() >= idle.own_busy_ticks()


def test_a_lone_hand_off_counts_as_idle_at_once_until_a_window_says_otherwise(machine):
    others_idle = OthersIdle(window_s=0.1, idle_cores=0.3, clock=lambda: machine["now"])
    machine.update(now=0.05, all=15)  # prefill's forward, on both cores, in this window
    others_idle.assume_idle()  # a decoder given its one request
    assert others_idle()
    machine.update(now=0.2, all=55, own=20)  # then the others took 20 ticks in 0.15 s
    assert not others_idle()


def test_another_process_at_work_is_runnable_now():
    """`now` reads this moment, not a window: a process spinning elsewhere is runnable."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 5
        seen = idle.runnable_elsewhere()
        while seen < 1 and time.monotonic() < deadline:  # once it has started
            time.sleep(0.01)
            seen = idle.runnable_elsewhere()
        assert seen >= 1 and not OthersIdle().now()
    finally:
        spinner.kill()
        spinner.wait()


def test_without_proc_a_decoder_given_its_one_request_assumes_nothing(monkeypatch):
    def unreadable():
        raise OSError("no /proc")

    monkeypatch.setattr(idle, "machine_busy_ticks", unreadable)
    others_idle = OthersIdle()
    others_idle.assume_idle()
    assert not others_idle() and not others_idle()


def test_without_proc_nothing_is_idle_now(monkeypatch):
    def unreadable():
        raise OSError("no /proc")

    monkeypatch.setattr(idle, "runnable_elsewhere", unreadable)
    assert not OthersIdle().now()

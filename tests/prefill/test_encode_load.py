import pytest

import epd.prefill.encode_load as encode_load
from epd.prefill.encode_load import EncodeLoad
from epd.prefill.errors import Overloaded


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(encode_load.time, "perf_counter", lambda: now[0])
    return now


def test_with_nothing_out_any_request_goes(clock):
    EncodeLoad(timeout_s=60).admit([("e1", 10**9)])  # nothing ahead of it: waiting would not help


def measured(clock, patches_per_s: float = 1000, encoder: str = "e1") -> EncodeLoad:
    """A load whose encoder has answered one part at `patches_per_s`, now idle."""
    load = EncodeLoad(timeout_s=60)
    load.sending(("warm", 0), encoder, int(patches_per_s))
    clock[0] += 1.0
    load.replied(("warm", 0))
    return load


def test_an_encoder_not_measured_yet_holds_at_most_one_request_at_the_limits(clock):
    load = EncodeLoad(timeout_s=60, first_patches=1000)
    load.admit([("e1", 5000)])  # alone: it goes whatever its size
    load.sending(("huge", 0), "e1", 5000)
    with pytest.raises(Overloaded) as refused:  # however small: its pace is not known
        load.admit([("e1", 1)])
    assert refused.value.retry_after_s == 1
    assert "encode_timeout_s" in str(refused.value)
    load.failed("huge")
    load.sending(("a", 0), "e1", 600)
    load.admit([("e1", 400)])  # 1000 in all: as much as one request at the limits
    load.sending(("b", 0), "e1", 400)
    with pytest.raises(Overloaded):
        load.admit([("e1", 1)])
    load.admit([("e2", 5000)])  # another encoder, idle: nothing is ahead there
    assert load.expected_s("b") is None  # nor is it refused later: nothing tells its end yet
    clock[0] = 0.5
    load.replied(("a", 0))
    assert load.rate() == pytest.approx(1200)
    assert load.expected_s("b") == pytest.approx(400 / 1200)


def test_admission_follows_the_measured_pace(clock):
    load = measured(clock)
    assert load.rate() == pytest.approx(1000)
    load.sending(("b", 0), "e1", 30_000)  # 30 s of work out
    load.admit([("e1", 10_000)])  # back in 40 s: within 0.75 of 60
    with pytest.raises(Overloaded) as refused:
        load.admit([("e1", 20_000)])  # 50 s
    assert refused.value.retry_after_s == 5  # the 5 s over what it may wait
    assert "30000 image patches" in str(refused.value)
    assert load.status() == {"encode_backlog_patches": 30_000, "encode_patches_per_s": 1000.0}


def test_each_part_waits_behind_its_own_encoder(clock):
    load = measured(clock, 1000, "e1")
    load.sending(("w2", 0), "e2", 1000)
    clock[0] += 1.0
    load.replied(("w2", 0))
    load.sending(("b", 0), "e1", 40_000)  # e1 is busy for 40 s, e2 idle
    load.admit([("e2", 40_000)])  # 40 s on e2
    with pytest.raises(Overloaded):
        load.admit([("e1", 10_000), ("e2", 1)])  # its first part would be back after 50 s


def test_an_encoder_busy_with_one_part_is_not_timed_on_the_next(clock):
    load = EncodeLoad(timeout_s=60)
    load.sending(("a", 0), "e1", 1000)
    load.sending(("b", 0), "e1", 1000)
    clock[0] = 1.0
    load.replied(("a", 0))
    clock[0] = 2.0
    load.replied(("b", 0))  # sent at 0, but begun at 1: a second of work, not two
    assert load.rate() == pytest.approx(1000)


def test_encoders_add_up(clock):
    load = EncodeLoad(timeout_s=60)
    load.sending(("a", 0), "e1", 1000)
    load.sending(("a", 1), "e2", 500)
    clock[0] = 1.0
    load.replied(("a", 0))
    load.replied(("a", 1))
    assert load.rate() == pytest.approx(1500)


def test_a_slower_reply_counts_at_once(clock):
    load = measured(clock, 1000)
    for part in range(5):
        load.sending(("a", part), "e1", 1000)
        clock[0] += 1.0
        load.replied(("a", part))
    load.sending(("slow", 0), "e1", 1000)
    clock[0] += 4.0  # the machine got busy: 250 a second
    load.replied(("slow", 0))
    assert load.paces["e1"].patches / load.paces["e1"].seconds > 500  # the average: twice it
    assert load.rate() == pytest.approx(250)  # the pace does not
    load.sending(("c", 0), "e1", 250)  # 1 s ahead
    load.admit([("e1", 11_000)])  # 45 s
    with pytest.raises(Overloaded):
        load.admit([("e1", 12_000)])  # 49 s


def test_a_part_running_late_slows_the_pace_while_it_runs(clock):
    load = measured(clock, 1000)
    load.sending(("a", 0), "e1", 1000)  # due back in 1 s
    clock[0] += 4.0  # not back yet: at most 250 a second
    assert load.rate() == pytest.approx(250)
    with pytest.raises(Overloaded):
        load.admit([("e1", 11_500)])  # 46 s at 250 (11.5 s at the measured pace)


def test_an_admitted_request_is_refused_once_its_encoder_slows(clock):
    load = measured(clock, 1000)
    start = clock[0]
    load.sending(("a", 0), "e1", 10_000)
    load.sending(("b", 0), "e1", 20_000)
    assert load.expected_s("b") == pytest.approx(30)
    load.check_in_time("b", waited=0)
    clock[0] = start + 20  # a should have been back at 10: 500 a second at most
    assert load.expected_s("b") == pytest.approx(40)
    load.check_in_time("b", waited=20)  # 60 s in all: just in time
    clock[0] = start + 25  # 400 a second: b back after 75 s
    with pytest.raises(Overloaded) as refused:
        load.check_in_time("b", waited=25)
    assert refused.value.retry_after_s == 15
    assert "encode_timeout_s" in str(refused.value)
    assert load.expected_s("gone") == 0  # nothing out: nothing to wait for


def test_parts_that_will_not_come_back_leave_the_backlog(clock):
    load = EncodeLoad(timeout_s=60)
    load.sending(("a", 0), "e1", 100)
    load.sending(("a", 1), "e2", 200)
    load.sending(("b", 0), "e1", 400)
    load.failed("a")
    assert load.backlog == 400
    load.sending(("c", 0), "e2", 800)
    load.lost("e1")
    assert load.backlog == 800
    clock[0] = 200.0
    load.sending(("d", 0), "e2", 1)
    load.expire(older_than_s=120)  # an encoder that never answers holds nothing up for ever
    assert load.backlog == 1
    load.replied(("unknown", 0))  # a reply for nothing sent: ignored
    assert load.backlog == 1


def test_an_idle_encoder_takes_a_part_whatever_its_pace(clock):
    """One stalled reply put e1 at 10 patches a second; with e2 busy, e1 was refused even
    small parts, and never measured again. Idle, it takes one, and its reply measures it."""
    load = measured(clock, 1000, "e2")
    load.sending(("stalled", 0), "e1", 1000)
    clock[0] += 100.0
    load.replied(("stalled", 0))
    load.sending(("b", 0), "e2", 20_000)  # e2 busy: work is out
    load.admit([("e1", 1000)])  # 100 s at e1's pace, but nothing is ahead of it
    load.sending(("c", 0), "e1", 1000)
    with pytest.raises(Overloaded):  # behind c, its pace counts
        load.admit([("e1", 1000)])
    clock[0] += 1.0
    load.replied(("c", 0))  # measured again: 1000 a second this time
    assert load.paces["e1"].latest == pytest.approx(1000)
    load.admit([("e1", 5000)])  # idle again


def test_the_quickest_encoder_comes_first(clock):
    load = measured(clock, 1000, "e1")
    load.first_patches = 2000
    load.sending(("w", 0), "e3", 1000)  # e3 not measured yet, busy: trusted up to 2000
    load.sending(("a", 0), "e1", 5000)  # 5 s
    assert load.quickest(["e3", "e1", "e2", "e4"], 500) == ["e2", "e4", "e3", "e1"]
    assert load.quickest(["e3", "e1", "e2", "e4"], 1500) == ["e2", "e4", "e1", "e3"]


def test_a_refusal_counts_the_backlog_of_the_encoder_it_judged(clock):
    load = measured(clock, 1000, "e1")
    load.sending(("w", 0), "e2", 1000)
    clock[0] += 1.0
    load.replied(("w", 0))
    load.sending(("a", 0), "e1", 40_000)
    load.sending(("b", 0), "e2", 5_000)
    with pytest.raises(Overloaded) as refused:
        load.admit([("e1", 10_000), ("e2", 1)])
    assert "40000 image patches to get through before this request's 10000" in str(refused.value)


def test_a_failure_drops_the_requests_parts_on_every_encoder(clock):
    """A Failure names no part: which encoder sent it is not known, and the one that did
    will not answer its part (see EncodeLoad.failed). A part the outbox gave up on is
    dropped from its own encoder only: the others have theirs to do."""
    load = EncodeLoad(timeout_s=60)
    for part, encoder in enumerate(("e1", "e2")):
        load.sending(("a", part), encoder, 100)
        load.sending(("b", part), encoder, 10)
    load.failed("b", "e1")
    assert (load.held("e1"), load.held("e2")) == (100, 110)
    load.failed("a")
    assert (load.held("e1"), load.held("e2")) == (0, 10)

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
    EncodeLoad(timeout_s=60).admit(10**9)  # nothing ahead of it: waiting would not help


def test_an_encoder_not_measured_yet_is_trusted_until_its_first_part_shows_it_slow(clock):
    load = EncodeLoad(timeout_s=60)
    load.sending(("a", 0), "e1", 100)
    load.admit(400)  # nothing known of e1's pace: it goes
    clock[0] = 10.0  # 100 patches not back in 10 s: at most 10 a second
    with pytest.raises(Overloaded) as refused:
        load.admit(400)  # (100 + 400) / 10 = 50 s, over 45
    assert refused.value.retry_after_s == 5
    load.admit(300)  # 40 s


def test_admission_follows_the_measured_pace(clock):
    load = EncodeLoad(timeout_s=60)
    load.sending(("a", 0), "e1", 1000)
    clock[0] = 1.0
    load.replied(("a", 0))
    assert load.rate() == pytest.approx(1000)
    load.sending(("b", 0), "e1", 30_000)  # 30 s of work out
    load.admit(10_000)  # back in 40 s: within 0.75 of 60
    with pytest.raises(Overloaded) as refused:
        load.admit(20_000)  # 50 s
    assert refused.value.retry_after_s == 5  # the 5 s over what it may wait
    assert "30000 image patches" in str(refused.value)
    assert load.status() == {"encode_backlog_patches": 30_000, "encode_patches_per_s": 1000.0}


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

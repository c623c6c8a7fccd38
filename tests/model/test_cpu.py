import io

import pytest

from epd.model import cpu


@pytest.fixture(autouse=True)
def fresh():
    cpu.vendor.cache_clear()
    yield
    cpu.vendor.cache_clear()


@pytest.mark.parametrize(
    "text, vendor",
    [
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n", "AuthenticAMD"),
        ("processor\t: 0\nvendor_id\t: GenuineIntel\n", "GenuineIntel"),
        ("processor\t: 0\nCPU implementer\t: 0x41\n", ""),  # an ARM CPU names no vendor_id
    ],
)
def test_the_vendor_is_read_from_cpuinfo(monkeypatch, text, vendor):
    monkeypatch.setattr(cpu, "open", lambda *a, **k: io.StringIO(text), raising=False)
    assert cpu.vendor() == vendor


def test_no_cpuinfo_is_an_unknown_vendor(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr(cpu, "open", missing, raising=False)
    assert cpu.vendor() == ""


def test_amx_is_a_yes_or_no():
    assert cpu.has_amx() in (True, False)

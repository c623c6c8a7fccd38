"""Which encoders and decoders a prefill uses: configured addresses, with host names resolved.

A literal address (`tcp://10.0.0.1:7101`, `ipc://...`) is one peer. An address whose host is a
name is a service: on Kubernetes the DNS name of a headless Service, which resolves to the
address of every ready pod behind it. It becomes one peer per address it resolves to, resolved
again every `RESOLVE_S`, so scaling a StatefulSet up or down needs no restart of prefill: a
new pod is used from its next resolution, one that goes away is no longer picked. A lookup that
fails keeps the last answer, so a DNS hiccup does not drop every peer at once.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)
RESOLVE_S = 5.0
Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP addresses


def resolve_host(host: str, port: int) -> list[str]:
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in found})


def service_of(address: str) -> tuple[str, int] | None:
    """(host, port) when `address` names its host (a service to resolve), else None."""
    # (an https:// name stays a name: its certificate is for the name, not an address)
    if not address.startswith(("tcp://", "http://")):
        return None
    parts = urlsplit(address)
    host, port = parts.hostname or "", parts.port
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        return (host, port) if host and port else None


class PeerSet:
    """The current peers of one role (encode or decode)."""

    def __init__(self, role: str, addresses: tuple[str, ...], resolve: Resolver = resolve_host):
        self.role, self.configured, self.resolve_host = role, addresses, resolve
        self.found: dict[str, tuple[str, ...]] = {}  # a service's last answer
        self.current: tuple[str, ...] = ()
        self.turns = itertools.count()  # round robin over this role's peers alone
        self.resolve()

    @property
    def services(self) -> list[str]:
        return [a for a in self.configured if service_of(a)]

    def resolve(self) -> tuple[set[str], set[str]]:
        """Look every service up again (blocking); the peers added and removed."""
        for address in self.services:
            host, port = service_of(address) or ("", 0)
            try:
                ips = self.resolve_host(host, port)
            except (OSError, UnicodeError) as e:
                log.warning("cannot resolve %s peers at %s: %s", self.role, address, e)
                continue
            bracketed = (f"[{ip}]" if ":" in ip else ip for ip in ips)
            scheme = address.split("://", 1)[0]  # a router's prefills are http:// URLs
            self.found[address] = tuple(f"{scheme}://{ip}:{port}" for ip in bracketed)
        peers: list[str] = []
        for address in self.configured:
            peers += self.found.get(address, ()) if service_of(address) else (address,)
        before, self.current = set(self.current), tuple(dict.fromkeys(peers))
        added, removed = set(self.current) - before, before - set(self.current)
        if added or removed:
            log.info("%s peers now %s", self.role, ", ".join(self.current) or "none")
        return added, removed

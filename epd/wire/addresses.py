"""Which reply addresses a role may send to: the prefills it is configured to serve.

A request names the address its answer goes to, so without a check anyone who can reach a role
could make it connect anywhere. An allowed address is given exactly (`tcp://prefill:7102`,
`ipc:///run/epd/prefill`) or, for TCP, as a network and a port (`tcp://10.0.0.0/8:7102`,
`tcp://127.0.0.1:*`). Only a literal IP address can match a network: libzmq resolves host names
in its one I/O thread, so a stranger's slow DNS name could stall every socket of the process.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _host_port(address: str) -> tuple[str, str]:
    """("10.0.0.5", "7102") from "tcp://10.0.0.5:7102" (or "tcp://[::1]:7102")."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.removeprefix("[").removesuffix("]"), port


@dataclass(frozen=True)
class Prefills:
    exact: frozenset[str]
    networks: tuple[tuple[Network, int | None], ...]  # None: any port

    @classmethod
    def parse(cls, patterns: tuple[str, ...]) -> Prefills:
        """Raises ValueError naming a pattern that is neither an address nor a network."""
        exact, networks = set(), []
        for pattern in patterns:
            host, port = _host_port(pattern)
            if not pattern.startswith("tcp://") or ("/" not in host and port != "*"):
                exact.add(pattern)
                continue
            try:
                network = ipaddress.ip_network(host, strict=False)
                networks.append((network, None if port == "*" else int(port)))
            except ValueError:
                raise ValueError(
                    f"prefills: {pattern!r} is not an address, nor tcp://NETWORK:PORT "
                    "such as tcp://10.0.0.0/8:7102 or tcp://127.0.0.1:*"
                ) from None
        return cls(frozenset(exact), tuple(networks))

    def allows(self, address: str) -> bool:
        if address in self.exact:
            return True
        if not address.startswith("tcp://") or ";" in address:  # no source;destination form
            return False
        host, port = _host_port(address)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:  # a host name
            return False
        if not (port.isascii() and port.isdigit()):
            return False
        return any(ip in net and want in (None, int(port)) for net, want in self.networks)

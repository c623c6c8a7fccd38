"""Getting a request's image bytes: data: URLs (base64), and http(s) URLs fetched from public
addresses only, under one hard deadline per image.

Why each rule (a URL is chosen by the client, so it is an attacker's input):
- the host is resolved once and every address it resolves to must be public; the connection
  then goes to the checked address (the URL's host stays in the Host header and TLS name), so a
  DNS answer that changes between check and connect cannot reach the loopback or the private
  network;
- a redirect is a new URL, checked the same way, at most `MAX_REDIRECTS` of them;
- the deadline covers the whole fetch (lookup, headers, body): the fetch is a coroutine that is
  cancelled, so a server that trickles its headers cannot hold it;
- lookups and data: decoding have their own small thread pools, so slow URLs cannot delay
  another request's data: image; with every lookup thread held (a name server that never
  answers), a new lookup is refused at once rather than queued;
- the body is taken as sent (`Accept-Encoding: identity`; a compressed one is refused), so a
  small response cannot inflate past the size limit;
- a refusal never depends on a connection to a refused address, and every failure to connect or
  read says the same words, so answers cannot map which internal ports are open.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx

from epd.api.errors import APIError, bad_request, overloaded
from epd.api.local_images import from_file_url
from epd.config.roles import PrefillConfig

MAX_REDIRECTS = 5
MAX_FETCHES = 128
LOOKUP_THREADS = 16
REDIRECTS = (301, 302, 303, 307, 308)
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv6 that a NAT64 gateway maps onto IPv4


@dataclass(frozen=True)
class MediaPolicy:
    """What an image may be: its size, how long fetching it may take, and where from."""

    max_bytes: int
    timeout_s: float
    # When set, only these hosts may be fetched, and at any address (the operator trusts them,
    # e.g. an internal image store); when empty, any host that resolves to public addresses.
    allowed_domains: tuple[str, ...] = ()
    local_root: Path | None = None  # file:// URLs may name files under it (None: none)

    @classmethod
    def of(cls, config: PrefillConfig) -> MediaPolicy:
        domains = tuple(d.lower().rstrip(".") for d in config.allowed_media_domains)
        local = config.allowed_local_media_path
        root = Path(local).resolve() if local else None
        return cls(config.max_image_bytes, config.image_fetch_timeout_s, domains, root)


class ImageLoader:
    """Loads the images of requests; one per process, shared by all of them."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="dns")
        self._looking_up = 0  # lookups not finished: a cancelled fetch's lookup still runs
        self._decoding = ThreadPoolExecutor(2, thread_name_prefix="data-url")
        # Open fetches at once, over all requests: each holds a socket (a file descriptor).
        self._fetching = asyncio.Semaphore(MAX_FETCHES)

    async def load(self, urls: list[str]) -> list[bytes]:
        """Each URL's encoded file, in order; a 400 naming the first image that cannot be had.
        The first failure cancels the request's other fetches: they would hold sockets for
        nothing."""
        tasks = [asyncio.ensure_future(self.load_one(url, i)) for i, url in enumerate(urls)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def load_one(self, url: str, index: int) -> bytes:
        limit = self.policy.max_bytes
        scheme = url[:8].lower()  # schemes are case-insensitive (RFC 3986): DATA:, HTTP://
        if scheme.startswith("data:"):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._decoding, from_data_url, url, index, limit)
        if scheme.startswith("file:"):
            root, loop = self.policy.local_root, asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._decoding, from_file_url, url, index, root, limit
            )
        if not scheme.startswith(("http://", "https://")):
            raise bad_request(
                f"image {index}: only data:, http(s): and (with --allowed-local-media-path) "
                "file: URLs are supported",
                code="invalid_image",
            )
        timeout = self.policy.timeout_s
        try:
            return await asyncio.wait_for(self._fetch_when_free(url, index), timeout)
        except TimeoutError:
            raise _refused(index, f"fetching {_short(url)} took over {timeout}s") from None

    def _lookup_done(self, _: object) -> None:
        self._looking_up -= 1

    def close(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._decoding.shutdown(wait=False, cancel_futures=True)

    async def _fetch_when_free(self, url: str, index: int) -> bytes:
        async with self._fetching:
            return await self._fetch(url, index)

    async def _fetch(self, url: str, index: int) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            response_or_next = await self._get(url, index)
            if isinstance(response_or_next, bytes):
                return response_or_next
            url = response_or_next
        raise _refused(index, f"more than {MAX_REDIRECTS} redirects")

    async def _get(self, url: str, index: int) -> bytes | str:
        """The body of `url`, or the URL it redirects to."""
        try:
            parts = urlsplit(url)
            hostname = parts.hostname  # parsed here: "[zz]" and "[::1" raise ValueError
        except ValueError:
            raise _refused(index, f"{_short(url)} is not a valid URL") from None
        if parts.scheme not in ("http", "https") or not hostname:
            raise _refused(index, f"{_short(url)} is not an http(s) URL with a host")
        try:  # an internationalised name, as DNS, Host and TLS spell it
            host = hostname.encode("idna").decode("ascii")
        except UnicodeError:
            raise _refused(index, f"{_short(url)} has an invalid host name") from None
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise _refused(index, f"{_short(url)} has an invalid port") from None
        address = await self._checked_address(host, port, index)
        pinned = parts._replace(netloc=f"{_bracketed(address)}:{port}").geturl()
        default_port = port == (443 if parts.scheme == "https" else 80)
        host_header = _bracketed(host) if default_port else f"{_bracketed(host)}:{port}"
        client = httpx.AsyncClient(verify=_tls(), trust_env=False, follow_redirects=False)
        async with client:
            request = client.build_request(
                "GET",
                pinned,
                # Compressed bodies are refused: a small one can inflate past any limit.
                headers={"Host": host_header, "Accept-Encoding": "identity"},
                extensions={"sni_hostname": host} if parts.scheme == "https" else {},
            )
            try:
                response = await client.send(request, stream=True)
                try:
                    if response.status_code in REDIRECTS and "location" in response.headers:
                        return urljoin(url, response.headers["location"])
                    if response.status_code != 200:
                        raise _refused(
                            index, f"fetching {_short(url)} gave HTTP {response.status_code}"
                        )
                    return await self._body(response, index)
                finally:
                    await response.aclose()
            except httpx.HTTPError:
                # One message for every network failure: no open/closed port oracle.
                raise _refused(index, f"{_short(url)} could not be fetched") from None

    async def _body(self, response: httpx.Response, index: int) -> bytes:
        limit = self.policy.max_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _refused(index, f"larger than {limit} bytes")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise _refused(index, f"the server sent it compressed ({encoding[:40]}): not taken")
        data = bytearray()
        async for chunk in response.aiter_raw():  # the bytes as sent, never inflated
            data += chunk
            if len(data) > limit:
                raise _refused(index, f"larger than {limit} bytes")
        return bytes(data)

    async def _checked_address(self, host: str, port: int, index: int) -> str:
        """The one address this fetch will connect to, after checking all that `host` has."""
        allowed = self.policy.allowed_domains
        trusted = host.lower().rstrip(".") in allowed
        if allowed and not trusted:
            raise _refused(index, f"host {host[:100]!r} is not in the allowed media domains")
        if self._looking_up >= LOOKUP_THREADS:  # slow name servers hold every lookup thread
            raise overloaded("too many host lookups are in progress; retry shortly")
        self._looking_up += 1
        future = asyncio.get_running_loop().run_in_executor(
            self._lookups, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM
        )
        future.add_done_callback(self._lookup_done)  # when the thread is free, not before
        try:
            found = await asyncio.shield(future)
        except (OSError, UnicodeError):
            raise _refused(index, f"host {host[:100]!r} cannot be resolved") from None
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in found]
        if not addresses:
            raise _refused(index, f"host {host[:100]!r} cannot be resolved")
        for address in addresses:
            problem = None if trusted else not_public(address)
            if problem:
                raise _refused(index, not_public_hint(host, problem))
        return str(addresses[0])


def not_public(address: IPAddress) -> str | None:
    """What kind of non-public address this is, or None for a public one."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return not_public(embedded)
        if address.is_site_local:  # fec0::/10, deprecated but still routed on some networks
            return "site-local"
    # Most specific first: Python counts 0.0.0.0/8 and 169.254/16 as private too.
    for kind in ("loopback", "unspecified", "link_local", "multicast", "private", "reserved"):
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if address.is_global else "non-public"


def not_public_hint(host: str, problem: str) -> str:
    """Why a host is refused, and how an operator who trusts it lets it through: the
    refusal is by design (a client must not reach the server's own network), but an image
    store on the private network is a common setup, and the flag is not easy to guess."""
    name = host[:100]
    return (
        f"host {name!r} is not a public address ({problem}); to fetch images from it, start "
        f"the server with --allowed-media-domains {name}"
    )


def from_data_url(url: str, index: int, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise bad_request(f"image {index}: data URL must be base64 encoded", code="invalid_image")
    if len(payload) * 3 // 4 > max_bytes:
        raise bad_request(f"image {index}: larger than {max_bytes} bytes", code="invalid_image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"image {index}: invalid base64 data", code="invalid_image") from None


def load_images_now(policy: MediaPolicy, urls: list[str]) -> list[bytes]:
    """`ImageLoader.load` outside an event loop (the one-process path)."""

    async def load() -> list[bytes]:
        loader = ImageLoader(policy)
        try:
            return await loader.load(urls)
        finally:
            loader.close()

    return asyncio.run(load())


@cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _short(url: str) -> str:
    return url if len(url) <= 100 else url[:97] + "..."


def _refused(index: int, reason: str) -> APIError:
    return bad_request(f"image {index}: {reason}", code="invalid_image")

"""Image URLs as an attacker writes them: only public addresses, one hard deadline, no oracle."""

import asyncio
import base64
import gzip
import http.server
import socket
import threading
import time

import pytest

from epd.api.errors import APIError
from epd.api.images import ImageLoader, MediaPolicy, not_public

PNG = b"\x89PNG fake image bytes"


def load(url, **policy):
    async def run():
        loader = ImageLoader(MediaPolicy(**{"max_bytes": 1000, "timeout_s": 2.0} | policy))
        try:
            return await loader.load_one(url, 0)
        finally:
            loader.close()

    return asyncio.run(run())


def refusal(url, **policy) -> str:
    with pytest.raises(APIError) as caught:
        load(url, **policy)
    assert caught.value.status == 400
    return caught.value.message


@pytest.fixture
def web():
    """A loopback web server: /png, /redirect?to=URL, /loop/N (N redirects), /trickle-headers,
    /drop (closes the connection). It records each request's Host header."""
    hosts = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hosts.append(self.headers["Host"])
            if self.path == "/png":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(PNG)
            elif self.path.startswith("/redirect?to="):
                self.send_response(302)
                self.send_header("Location", self.path.split("=", 1)[1])
                self.end_headers()
            elif self.path.startswith("/loop/"):
                self.send_response(301)
                self.send_header("Location", f"/loop/{int(self.path[6:]) + 1}")
                self.end_headers()
            elif self.path == "/trickle-headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                for _ in range(100):
                    self.wfile.write(b"X-Slow: 1\r\n")
                    self.wfile.flush()
                    time.sleep(0.1)
            elif self.path == "/drop":
                self.connection.shutdown(socket.SHUT_RDWR)
            elif self.path == "/gzip":  # 1 KB that would inflate to 10 MB
                body = gzip.compress(b"\0" * 10_000_000)
                self.send_response(200)
                self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], hosts
    server.shutdown()


@pytest.mark.parametrize(
    "url,kind",
    [
        ("http://127.0.0.1/a.png", "loopback"),
        ("http://127.1/a.png", "loopback"),
        ("http://0x7f000001/a.png", "loopback"),
        ("http://2130706433/a.png", "loopback"),
        ("http://017700000001/a.png", "loopback"),
        ("http://localhost:8000/a.png", "loopback"),
        ("http://[::1]/a.png", "loopback"),
        ("http://[::ffff:127.0.0.1]/a.png", "loopback"),
        ("http://0.0.0.0/a.png", "unspecified"),
        ("http://[::]/a.png", "unspecified"),
        ("http://10.1.2.3/a.png", "private"),
        ("http://192.168.0.1/a.png", "private"),
        ("https://172.16.0.1/a.png", "private"),
        ("http://[fd00::1]/a.png", "private"),
        ("http://[::ffff:10.0.0.1]/a.png", "private"),
        ("http://[64:ff9b::a00:1]/a.png", "private"),  # NAT64 of 10.0.0.1
        ("http://169.254.169.254/latest/meta-data", "link-local"),  # cloud metadata
        ("http://[fe80::1]/a.png", "link-local"),
        ("http://224.0.0.1/a.png", "multicast"),
        ("http://100.64.0.1/a.png", "non-public"),  # carrier-grade NAT
        ("http://[fec0::1]/a.png", "site-local"),
    ],
)
def test_non_public_addresses_are_refused_before_connecting(url, kind):
    message = refusal(url)
    assert message.startswith("image 0: host")
    assert f"is not a public address ({kind}); " in message


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://127.0.0.1:8000/a.png", "127.0.0.1"),
        ("http://LocalHost/a.png", "localhost"),
        ("http://[::1]/a.png", "::1"),
        ("http://10.1.2.3/a.png", "10.1.2.3"),
    ],
)
def test_a_non_public_refusal_names_the_flag_and_the_host_to_list(url, host):
    assert refusal(url).endswith(f"start the server with --allowed-media-domains {host}")


def test_listing_the_host_a_refusal_names_lets_it_through(web):
    port, _ = web
    url = f"http://127.0.0.1:{port}/png"
    named = refusal(url).rsplit(" ", 1)[1]
    assert load(url, allowed_domains=(named,)) == PNG


def test_public_addresses_pass_the_check():
    import ipaddress

    for address in ("8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"):
        assert not_public(ipaddress.ip_address(address)) is None


def test_a_listed_host_is_fetched_at_its_address_with_its_own_host_header(web, monkeypatch):
    port, hosts = web
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):  # images.internal is this loopback server
        return real("127.0.0.1" if host == "images.internal" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    allowed = {"allowed_domains": ("images.internal",)}
    assert load(f"http://images.internal:{port}/png", **allowed) == PNG
    assert hosts == [f"images.internal:{port}"]
    assert "not in the allowed media domains" in refusal(f"http://127.0.0.1:{port}/png", **allowed)
    assert "not a public address (loopback)" in refusal(f"http://images.internal:{port}/png")


def test_each_redirect_is_checked_and_counted(web):
    port, _ = web
    allowed = {"allowed_domains": ("127.0.0.1",)}
    base = f"http://127.0.0.1:{port}"
    assert load(f"{base}/redirect?to=/png", **allowed) == PNG
    to_other = refusal(f"{base}/redirect?to=http://localhost:{port}/png", **allowed)
    assert "'localhost' is not in the allowed media domains" in to_other
    assert "more than 5 redirects" in refusal(f"{base}/loop/0", **allowed)
    assert "file: URLs are refused" in refusal("file:///etc/passwd")
    assert "not an http(s) URL" in refusal(f"{base}/redirect?to=file:///etc/passwd", **allowed)


def test_the_deadline_covers_trickled_headers(web):
    port, _ = web
    start = time.monotonic()
    message = refusal(
        f"http://127.0.0.1:{port}/trickle-headers", allowed_domains=("127.0.0.1",), timeout_s=1.0
    )
    assert "took over 1.0s" in message and time.monotonic() - start < 2


def test_a_closed_port_and_a_dropped_connection_read_the_same(web):
    port, _ = web
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
    allowed = {"allowed_domains": ("127.0.0.1",)}
    closed_answer = refusal(f"http://127.0.0.1:{closed_port}/x", **allowed)
    dropped_answer = refusal(f"http://127.0.0.1:{port}/drop", **allowed)
    assert closed_answer.replace(str(closed_port), "P").replace("/x", "/drop") == (
        dropped_answer.replace(str(port), "P")
    )
    assert dropped_answer.endswith("could not be fetched")


def test_size_limit_holds_while_fetching(web):
    port, _ = web
    message = refusal(f"http://127.0.0.1:{port}/png", allowed_domains=("127.0.0.1",), max_bytes=5)
    assert "larger than 5 bytes" in message


def test_slow_urls_do_not_delay_a_data_url(web):
    port, _ = web
    data = "data:image/png;base64," + base64.b64encode(PNG).decode()

    async def run():
        loader = ImageLoader(MediaPolicy(1000, 3.0, ("127.0.0.1",)))
        slow = [
            asyncio.ensure_future(loader.load_one(f"http://127.0.0.1:{port}/trickle-headers", i))
            for i in range(8)
        ]
        await asyncio.sleep(0.2)
        start = time.monotonic()
        assert await loader.load_one(data, 0) == PNG
        waited = time.monotonic() - start
        for task in slow:
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        loader.close()
        return waited

    assert asyncio.run(run()) < 0.5


def test_compressed_bodies_are_refused_not_inflated(web):
    port, _ = web
    message = refusal(
        f"http://127.0.0.1:{port}/gzip", allowed_domains=("127.0.0.1",), max_bytes=100_000
    )
    assert "compressed (gzip)" in message


def test_an_international_host_name_is_a_400_not_a_500():
    assert "cannot be resolved" in refusal("http://bücher.invalid/a.png")
    assert "invalid host name" in refusal("http://a..b/a.png")


@pytest.mark.parametrize("url", ["http://[zz]/a.png", "http://[::1/a.png", "https://[1:2]x/"])
def test_a_malformed_url_is_a_400_not_a_500(url):
    assert "is not a valid URL" in refusal(url)


def test_schemes_are_case_insensitive(web):
    png = base64.b64encode(PNG).decode()
    assert load(f"DATA:image/png;BASE64,{png}") == PNG
    port = web[0]
    assert load(f"HTTP://127.0.0.1:{port}/png", allowed_domains=("127.0.0.1",)) == PNG


def test_the_first_failure_cancels_the_requests_other_fetches(web):
    port, _ = web

    async def run():
        loader = ImageLoader(MediaPolicy(1000, 5.0, ("127.0.0.1",)))
        slow = [f"http://127.0.0.1:{port}/trickle-headers"] * 5
        start = time.monotonic()
        with pytest.raises(APIError, match="image 5: only data:, http"):
            await loader.load([*slow, "ftp://x/y.png"])
        took = time.monotonic() - start
        free = loader._fetching._value  # every slot back at once: nothing left running
        loader.close()
        return took, free

    took, free = asyncio.run(run())
    assert took < 1 and free == 128


def test_lookups_past_the_pool_are_refused_at_once(monkeypatch):
    def stuck(*args, **kwargs):  # a name server that does not answer
        time.sleep(1.5)
        raise OSError("timed out")

    monkeypatch.setattr(socket, "getaddrinfo", stuck)

    async def run():
        loader = ImageLoader(MediaPolicy(1000, 0.5, ()))
        first = [
            asyncio.ensure_future(loader.load_one(f"http://n{i}.example/a", i)) for i in range(16)
        ]
        await asyncio.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(APIError) as more:
            await loader.load_one("http://n16.example/a", 16)
        refused_in = time.monotonic() - start
        await asyncio.gather(*first, return_exceptions=True)
        loader.close()
        return more.value, refused_in

    error, refused_in = asyncio.run(run())
    assert error.status == 503 and "host lookups" in error.message and refused_in < 0.2

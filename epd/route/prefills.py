"""The prefills behind the router: found from URLs (a host name is looked up again every few
seconds, `prefill/peers.py`), each one's state read from its GET /health.

A prefill is chosen only while its /health says ok: not one that is down, draining or missing a
peer. Its load is the requests this router has on it, or those it reports in flight
(other routers' too), whichever is higher. Its /health also names the key its block hashes
start from and the topic of its KV events (`api/app.py`, `kv_status`), which the router needs
to follow its blocks; a prefill that stops answering, or answers with another pid (it
restarted, its cache empty: a new instance id), is forgotten by the index.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from epd.kv.index import BlockIndex
from epd.prefill.peers import PeerSet

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 2.0


@dataclass
class Prefill:
    url: str
    up: bool = False
    in_flight: int = 0  # this router's requests on it now
    reported: int = 0  # in flight, as its /health last said
    model_key: bytes = b""
    topic: str | None = None
    instance: str = ""  # its process's, as its /health says: another one is a restart

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported)


class PrefillSet:
    def __init__(self, urls: tuple[str, ...], index: BlockIndex, api_key: str = "") -> None:
        self.peers = PeerSet("prefill", urls)
        self.index = index
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.prefills: dict[str, Prefill] = {}
        # Topic → prefill, swapped whole after each poll: the KV events' thread reads it.
        self.topics: dict[str, str] = {}
        self.polling: asyncio.Task[None] | None = None
        self.sync()

    def sync(self) -> None:
        """Follow the peers found: new ones added (down until their /health says ok), gone
        ones dropped with what the index held of them."""
        current = self.peers.current
        for url in current:  # in the order given: equals take turns in it
            if url not in self.prefills:
                self.prefills[url] = Prefill(url)
        for url in self.prefills.keys() - set(current):
            del self.prefills[url]
            self.index.forget(url)

    def live(self) -> list[Prefill]:
        return [p for p in self.prefills.values() if p.up]

    def owner(self, topic: str) -> str | None:
        """The prefill whose KV events carry `topic` (when exactly one does); from any thread."""
        return self.topics.get(topic)

    async def poll(self, client: httpx.AsyncClient) -> None:
        """Read every prefill's /health at once."""
        await asyncio.gather(*(self.read(client, p) for p in list(self.prefills.values())))
        topics = [p.topic for p in self.prefills.values() if p.topic]
        self.topics = {  # a topic two prefills claim is neither's
            p.topic: p.url for p in self.prefills.values() if p.topic and topics.count(p.topic) == 1
        }

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        """`poll`, shared by every caller while one runs (requests finding no prefill up)."""
        if self.polling is None or self.polling.done():
            self.polling = asyncio.ensure_future(self.poll(client))
        await asyncio.shield(self.polling)

    async def read(self, client: httpx.AsyncClient, prefill: Prefill) -> None:
        try:
            reply = await client.get(
                f"{prefill.url}/health", headers=self.headers, timeout=HEALTH_TIMEOUT_S
            )
            body: dict[str, Any] = reply.json()
        except (httpx.HTTPError, ValueError):
            self.down(prefill)
            return
        if not isinstance(body, dict):
            self.down(prefill)
            return
        kv = body.get("kv", {})
        kv = kv if isinstance(kv, dict) else {}
        instance = str(kv.get("instance", ""))
        if prefill.instance and instance != prefill.instance:  # restarted: its cache is empty
            self.index.forget(prefill.url)
        prefill.instance = instance
        was_up, prefill.up = prefill.up, reply.status_code == 200 and body.get("status") == "ok"
        if prefill.up != was_up:
            log.info("prefill %s is %s", prefill.url, "up" if prefill.up else "not ready")
        in_flight = body.get("in_flight", 0)  # a key holder's view; 0 where the key is not held
        prefill.reported = in_flight if isinstance(in_flight, int) else 0
        try:
            prefill.model_key = bytes.fromhex(str(kv.get("model_key", "")))
        except ValueError:
            prefill.model_key = b""
        topic = kv.get("events_topic")
        prefill.topic = topic if isinstance(topic, str) else None

    def down(self, prefill: Prefill) -> None:
        if prefill.up:
            log.warning("prefill %s does not answer its /health: not chosen", prefill.url)
        prefill.up = False

    async def follow(self, client: httpx.AsyncClient, interval_s: float) -> None:
        """Poll for ever: /health every `interval_s`, names looked up again every RESOLVE_S."""
        resolved = 0.0
        loop = asyncio.get_running_loop()
        while True:
            if self.peers.services and loop.time() - resolved >= 5.0:
                await asyncio.to_thread(self.peers.resolve)
                resolved = loop.time()
                self.sync()
            await self.poll(client)
            await asyncio.sleep(interval_s)

"""A TCP proxy that can cut the traffic it carries, as a network partition does.

`cut()` stops moving bytes both ways on every connection, open or new, without closing any:
what was sent waits in the sockets' buffers, as it does behind a dropped link while TCP keeps
retransmitting, and flows again after `heal()`. `cut(involving=...)` holds only the connections
whose first bytes either way contain that marker (a nats-server's id, which both its INFO and
its route CONNECT carry): every link of one node, whichever side dialled it; given several
markers, only the links whose opening messages, the first read each way (a route's INFO and
CONNECT), carry all of them: the links between two nodes, the others left flowing (a partial
partition). Later messages are not looked at for that: a route between two other nodes goes on
to mention the third one's id. The proxy runs its
own event loop in a thread, so it keeps its pace whatever the test's loop is doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Collection
from types import TracebackType

from strata import procutil


class _Link:
    """One proxied connection: the first bytes seen on it, either way."""

    SNIFFED = 16384

    def __init__(self) -> None:
        self.seen = bytearray()
        self.opening = bytearray()
        """The first bytes read each way, together."""

    def saw(self, data: bytes, first: bool = False) -> None:
        if first:
            self.opening += data[: self.SNIFFED]
        if len(self.seen) < self.SNIFFED:
            self.seen += data[: self.SNIFFED - len(self.seen)]

    def carries(self, markers: tuple[bytes, ...]) -> bool:
        if len(markers) == 1:
            return markers[0] in self.seen
        return all(marker in self.opening for marker in markers)


class Proxy:
    """Listens on `port` (chosen free) of 127.0.0.1 and forwards to `upstream_port`.

    `avoid`: ports chosen for servers not started yet (free now, so the kernel may hand one of
    them out again): the proxy must not take one, or the server could not bind it."""

    def __init__(
        self, upstream_port: int, host: str = "127.0.0.1", avoid: Collection[int] = ()
    ) -> None:
        self.host = host
        self.upstream_port = upstream_port
        self.port = procutil.free_port(host)
        while self.port in avoid:
            self.port = procutil.free_port(host)
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="netproxy", daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()
        self._involving: tuple[bytes, ...] = ()
        self.connections = 0

    def __enter__(self) -> Proxy:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the proxy did not start within 10 s")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        """The proxy as a NATS client's server."""
        return f"nats://{self.host}:{self.port}"

    @property
    def route_url(self) -> str:
        """The proxy as a nats-server route."""
        return f"nats-route://{self.host}:{self.port}"

    def cut(self, involving: bytes | tuple[bytes, ...] | None = None) -> None:
        markers = (involving,) if isinstance(involving, bytes) else tuple(involving or ())

        def cut() -> None:
            self._involving = markers
            self._open.clear()

        self._loop.call_soon_threadsafe(cut)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    async def _pass(self, link: _Link) -> None:
        """Wait while this link is cut."""
        while not self._open.is_set():
            if not link.carries(self._involving):
                return
            await self._open.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._open.set()
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, self.host, self.port)
        )
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for writer in self._writers:
                writer.close()
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        link = _Link()
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            writer.close()
            return
        self._writers.add(up_writer)
        await asyncio.gather(
            self._pump(link, reader, up_writer),
            self._pump(link, up_reader, writer),
            return_exceptions=True,
        )

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        first = True
        try:
            while True:
                await self._pass(link)
                data = await reader.read(65536)
                if not data:
                    break
                link.saw(data, first)
                first = False
                await self._pass(link)  # read just before a cut: held like the rest
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                writer.close()


class Proxies:
    """Several proxies cut and healed together: every link of one side of a partition."""

    def __init__(self, proxies: list[Proxy]) -> None:
        self.proxies = proxies

    def cut(self, involving: bytes | tuple[bytes, ...] | None = None) -> None:
        for proxy in self.proxies:
            proxy.cut(involving)

    def heal(self) -> None:
        for proxy in self.proxies:
            proxy.heal()

"""uvicorn's HTTP protocols with a header deadline, a header size bound, and disconnects seen through pipelining.

uvicorn times out idle keep-alive connections (``timeout_keep_alive``) but not a
connection that opens and then sends half a request line, or sends the next request's
headers a byte a minute: such a connection holds a socket and a slot of
``limit_concurrency`` for ever. The protocols here close a connection whose request
headers are not complete ``header_timeout_s`` after it opened (or after its previous
answer). Request line and headers are bounded by ``max_header_bytes``: the h11 protocol
by uvicorn's own ``h11_max_incomplete_event_size``, the httptools one here.

``/healthz`` and ``/readyz`` are answered even when ``max_connections`` (uvicorn's
``limit_concurrency``) is reached, by the httptools protocol (the default: httptools is a
dependency of the service): the probes are cheap, and a flood of idle connections must not
fail them.

A client that pipelines a second request behind a long one and then goes away must stop
the running one as it would without pipelining. uvicorn marks only its newest request
disconnected when the connection is lost, and it stops reading a connection while a
pipelined request waits, so the loss is not even seen. The protocols here mark every
unfinished request of a lost connection, and while a connection is paused with a request
running they look at the socket every :data:`PEER_POLL_S` for the peer's hangup
(``POLLRDHUP``: seen even with unread bytes queued) and close it when it is gone.

The classes are module-level (uvicorn pickles its config for worker processes); they read
``header_timeout_s`` and ``max_header_bytes`` from the environment once per process, as
:func:`treepack.service.serve.run_serve` exports every setting there.
"""

from __future__ import annotations

import asyncio
import functools
import select
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "guarded_protocol"]


_PROBES = (b"/healthz", b"/readyz")
PEER_POLL_S = 0.1
"""How often a paused connection with a request running is checked for the peer's hangup."""
_HANGUP = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


def peer_hung_up(transport: Any) -> bool:
    """Whether the peer of ``transport``'s socket closed it (or its sending half), even
    with bytes it sent still unread; False when that cannot be told."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(select, "poll"):
        return False
    try:
        p = select.poll()
        p.register(sock.fileno(), _HANGUP)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return False


@functools.lru_cache(maxsize=1)
def _limits() -> tuple[float, int]:
    from treepack.service.settings import Settings

    s = Settings()
    return s.header_timeout_s, s.max_header_bytes


class _HeaderDeadline:
    """Mixin: close the connection when a request's headers are late; tell every unfinished
    request of a lost connection, and watch a paused one for the peer's hangup (module docstring)."""

    _header_timer: asyncio.TimerHandle | None = None
    _peer_timer: asyncio.TimerHandle | None = None
    _cycles: list[Any] | None = None

    def _track(self, cycle: Any) -> None:
        """Remember ``cycle`` (a request of this connection) until it is answered."""
        if cycle is None:
            return
        live = [c for c in self._cycles or () if not c.response_complete]
        if cycle not in live:
            live.append(cycle)
        self._cycles = live

    def _unfinished(self) -> bool:
        return any(not c.response_complete for c in self._cycles or ())

    def _watch_peer(self) -> None:
        if self._peer_timer is None and self.flow.read_paused and self._unfinished():  # type: ignore[attr-defined]
            self._peer_timer = self.loop.call_later(PEER_POLL_S, self._poll_peer)  # type: ignore[attr-defined]

    def _poll_peer(self) -> None:
        self._peer_timer = None
        transport = self.transport  # type: ignore[attr-defined]
        if transport.is_closing() or not self.flow.read_paused or not self._unfinished():  # type: ignore[attr-defined]
            return  # reading again (uvicorn sees the loss itself), or nothing left to stop
        if peer_hung_up(transport):
            transport.close()  # connection_lost follows and tells every unfinished request
            return
        self._watch_peer()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(_limits()[0], self._headers_late)  # type: ignore[attr-defined]

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _in_request(self) -> bool:
        cycle = self.cycle  # type: ignore[attr-defined]
        return cycle is not None and not cycle.response_complete

    def _headers_late(self) -> None:
        self._header_timer = None
        transport = self.transport  # type: ignore[attr-defined]
        if not self._in_request() and not transport.is_closing():
            transport.close()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        self._track(self.cycle)  # type: ignore[attr-defined]
        if self._in_request():
            self._disarm()
        self._watch_peer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._peer_timer is not None:
            self._peer_timer.cancel()
            self._peer_timer = None
        # uvicorn tells only its newest request; a pipelined one may stand before the one running.
        for cycle in self._cycles or ():
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self._cycles = None
        super().connection_lost(exc)  # type: ignore[misc]


class GuardedH11Protocol(_HeaderDeadline, H11Protocol):
    """uvicorn's h11 protocol with the header deadline."""


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is optional
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

if HttpToolsProtocol is not None:

    class GuardedHttpToolsProtocol(_HeaderDeadline, HttpToolsProtocol):
        """uvicorn's httptools protocol with the header deadline and the header size bound."""

        _header_bytes = 0

        def on_message_begin(self) -> None:
            self._header_bytes = 0
            super().on_message_begin()

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > _limits()[1] and not self.transport.is_closing():
                self.transport.close()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            # The probes are answered even at the connection limit: a flood of idle
            # connections must not make a liveness probe restart a working sidecar.
            if self.url.split(b"?", 1)[0] in _PROBES:
                limit, self.limit_concurrency = self.limit_concurrency, None
                try:
                    super().on_headers_complete()
                finally:
                    self.limit_concurrency = limit
            else:
                super().on_headers_complete()
            # Each request as it is parsed: one chunk may hold a request and one pipelined behind it.
            self._track(self.cycle)

    __all__.append("GuardedHttpToolsProtocol")


def guarded_protocol() -> type:
    """The protocol class for ``uvicorn.run(http=...)``: httptools when installed (faster), else h11."""
    return GuardedHttpToolsProtocol if HttpToolsProtocol is not None else GuardedH11Protocol

"""uvicorn's HTTP protocols with a header deadline and a header size bound.

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

The classes are module-level (uvicorn pickles its config for worker processes); they read
``header_timeout_s`` and ``max_header_bytes`` from the environment once per process, as
:func:`treepack.service.serve.run_serve` exports every setting there.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "guarded_protocol"]


_PROBES = (b"/healthz", b"/readyz")


@functools.lru_cache(maxsize=1)
def _limits() -> tuple[float, int]:
    from treepack.service.settings import Settings

    s = Settings()
    return s.header_timeout_s, s.max_header_bytes


class _HeaderDeadline:
    """Mixin: close the connection when a request's headers are late (module docstring)."""

    _header_timer: asyncio.TimerHandle | None = None

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
        if self._in_request():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
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

    __all__.append("GuardedHttpToolsProtocol")


def guarded_protocol() -> type:
    """The protocol class for ``uvicorn.run(http=...)``: httptools when installed (faster), else h11."""
    return GuardedHttpToolsProtocol if HttpToolsProtocol is not None else GuardedH11Protocol

"""The client's pluggable part, as Protocols: a backend plans (embedded) or sends (HTTP).

:class:`~treepack.client.Packer` drives a :class:`Backend`, :class:`~treepack.client.AsyncPacker`
an :class:`AsyncBackend`; the request objects (:class:`~treepack.proto.batch.PackInput`,
:class:`~treepack.proto.whatif.WhatIfQuery`) and the answers are the contract's types, so
every backend gives the same plan and raises the same errors. :class:`InThread` makes any
:class:`Backend` an :class:`AsyncBackend` (the embedded planner runs in a worker thread).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from treepack.proto.batch import PackInput
from treepack.proto.plan import Plan
from treepack.proto.whatif import WhatIfQuery, WhatIfResult

__all__ = ["Backend", "AsyncBackend", "InThread"]


class Backend(Protocol):
    """A synchronous backend: ``pack`` and ``whatif`` answer the contract's request objects."""

    def pack(self, request: PackInput) -> Plan: ...

    def whatif(self, query: WhatIfQuery) -> list[WhatIfResult]: ...

    def history(self) -> dict[str, Any]:
        """The history summary (``GET /v1/history``)."""
        ...

    def health(self) -> dict[str, Any]:
        """``{"status": "ok", "backend": ...}``; raises when the backend cannot answer."""
        ...

    def close(self) -> None: ...


class AsyncBackend(Protocol):
    """:class:`Backend` for asyncio: the same methods, awaitable."""

    async def pack(self, request: PackInput) -> Plan: ...

    async def whatif(self, query: WhatIfQuery) -> list[WhatIfResult]: ...

    async def history(self) -> dict[str, Any]: ...

    async def health(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class InThread:
    """An :class:`AsyncBackend` over a :class:`Backend`: each call runs in a worker thread
    (``asyncio.to_thread``), so the event loop never waits for the planner."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def pack(self, request: PackInput) -> Plan:
        return await asyncio.to_thread(self.backend.pack, request)

    async def whatif(self, query: WhatIfQuery) -> list[WhatIfResult]:
        return await asyncio.to_thread(self.backend.whatif, query)

    async def history(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.backend.history)

    async def health(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.backend.health)

    async def close(self) -> None:
        self.backend.close()

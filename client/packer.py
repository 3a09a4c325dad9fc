"""``Packer`` (sync) and ``AsyncPacker`` (async): one interface, embedded or HTTP backend.

``Packer()`` plans in this process (no server needed); ``Packer(url=...)`` talks to a
``treepack serve`` sidecar over HTTP (msgpack by default). Both return the same types:
:class:`~treepack.proto.plan.Plan` from :meth:`Packer.pack` (equal over both backends),
:class:`~treepack.proto.whatif.WhatIfResult` from :meth:`Packer.whatif`,
and raise the same exceptions (:mod:`treepack.proto.errors`), server messages and field
paths included.

The two share everything but the awaiting: the configuration (:class:`_Packers`), and the
request objects each call builds once (:class:`~treepack.proto.batch.PackInput`,
:class:`~treepack.proto.whatif.WhatIfQuery`) and hands to its backend
(:mod:`~treepack.client.protocols`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TypeVar

from treepack.client.protocols import AsyncBackend, Backend, InThread
from treepack.proto.batch import PackInput
from treepack.proto.codec import Format
from treepack.proto.cost import CostModel
from treepack.proto.errors import InputTypeError
from treepack.proto.options import PlanOptions
from treepack.proto.plan import Plan
from treepack.proto.whatif import CompositionLike, WhatIfQuery, WhatIfResult, as_composition

__all__ = ["Packer", "AsyncPacker", "CompositionLike", "as_composition"]

_P = TypeVar("_P", bound="_Packers")


class _Packers:
    """The configuration both packers share (see :class:`Packer` for the arguments)."""

    _asynchronous = False
    _b: Backend | AsyncBackend

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        retries: int = 4,
        backoff: float = 0.2,
        max_backoff: float = 30.0,
        fmt: Format = "msgpack",
        transport: Any = None,
        history_path: str | None = None,
        dedup: bool = True,
        total_timeout: float | None = None,
        idempotent: bool = True,
        cost_model: CostModel | None = None,
    ) -> None:
        self.url = url
        if url is None:
            from treepack.client.embedded import EmbeddedBackend

            embedded = EmbeddedBackend(history_path, cost_model=cost_model)
            self._b = InThread(embedded) if self._asynchronous else embedded
            return
        if cost_model is not None:
            raise InputTypeError(
                "cost_model is for the embedded packer; a sidecar uses its own cost file (its cost_model_path setting)",
                path="$.cost_model",
                rule="embedded_only",
            )
        try:
            from treepack.client.http import AsyncHttpBackend, HttpBackend
            from treepack.client.retry import RetryPolicy
        except ImportError as exc:
            raise ImportError(
                f"Packer({url!r}) talks to the sidecar through httpx, which is missing: in the clone, "
                "pip install '.[client]' (or Packer() with no URL plans in this process)"
            ) from exc

        policy = RetryPolicy(retries=retries, backoff=backoff, max_backoff=max_backoff, total_timeout=total_timeout)
        cls = AsyncHttpBackend if self._asynchronous else HttpBackend
        self._b = cls(
            url,
            token=token,
            timeout=timeout,
            policy=policy,
            fmt=fmt,
            transport=transport,
            dedup=dedup,
            idempotent=idempotent,
        )

    @classmethod
    def from_env(cls: type[_P], **kwargs: Any) -> _P:
        """A packer configured by ``TREEPACK_URL`` (unset or empty: embedded) and ``TREEPACK_TOKEN``.

        The sidecar deployments (``deploy/``) set these for the trainer container.
        """
        return cls(os.environ.get("TREEPACK_URL") or None, token=os.environ.get("TREEPACK_TOKEN") or None, **kwargs)


class Packer(_Packers):
    """Plan batches, embedded (default) or through a sidecar.

    Args:
        url: the sidecar's base URL (``http://127.0.0.1:8000``); None plans in-process.
        token: bearer token for a sidecar that requires one.
        timeout: seconds per HTTP attempt as a whole (connect, send, wait, receive).
        total_timeout: seconds for a whole call, retries and waits included (None: no bound).
        idempotent: HTTP only: send each pack with a fresh ``Idempotency-Key``, so a pack
            whose answer was cut off is retried safely (recorded once); False never
            retries a pack that may have reached the server.
        retries: retries on connection failures and 503 (module ``treepack.client.retry``).
        backoff: first retry wait in seconds (doubles each retry) when no Retry-After.
        max_backoff: cap on any single wait, Retry-After included.
        fmt: ``msgpack`` (default) or ``json`` on the wire.
        transport: an httpx transport (tests: ``httpx.ASGITransport`` with AsyncPacker).
        history_path: embedded only: a local SQLite shape history for what-if.
        dedup: HTTP only: send a sequence's prefix shared with its group's first sequence
            as a reference, not again (about half the bytes for GRPO groups; same plan).
        cost_model: embedded only: a :class:`~treepack.proto.cost.CostModel`: plans carry
            ``stats.predicted_ms``, ``placement="auto"`` picks tree or plain packing by
            predicted time, what-if results carry ``step_ms`` (a sidecar does the same
            with its ``cost_model_path`` setting).
    """

    _b: Backend

    def pack(self, sequences: Sequence[Any] | PackInput, options: PlanOptions | None = None, **kwargs: Any) -> Plan:
        """Pack a batch.

        Args:
            sequences: the sequences, with the rest of the batch as keywords named as
                :class:`~treepack.proto.batch.PackInput` names them (``trainable``,
                ``groups``, ``keys``, ``tags``: per sequence a task tag recorded with the
                shape, ``record``: record the shape in the history, default True);
                or one :class:`~treepack.proto.batch.PackInput` alone.
            options: a :class:`~treepack.proto.options.PlanOptions`, or its fields as
                keywords (``seq_len=...``, ``placement=...``).

        Returns:
            The :class:`Plan`.

        Raises:
            RequestError: (or a subclass) for invalid input, naming the field and rule.
            OverloadedError: the sidecar stayed busy through every retry.
            TransportError: the sidecar could not be reached.
        """
        return self._b.pack(PackInput.of(sequences, options, **kwargs))

    def whatif(
        self, compositions: Sequence[CompositionLike], options: PlanOptions | None = None, **kwargs: Any
    ) -> list[WhatIfResult]:
        """Row distributions of candidate compositions, from the history or ``shapes``.

        Args:
            compositions: each a :class:`Composition`, a group count, or a dict such as
                ``{"by_tag": {"math": 20, "code": 12}}``.
            options: the plan options of every trial (``seq_len`` is the row capacity to
                plan for), or their fields as keywords; as for ``pack``.
            **kwargs: the option keywords, and ``trials`` (32), ``seed`` (0), ``max_rows``,
                ``max_step_ms`` (with a cost model), ``history_batches``, ``history_seq_len``
                (default: sample only batches recorded at this ``seq_len``; ``"any"``: all),
                ``history_tags``, ``shapes`` as :class:`~treepack.proto.whatif.WhatIfQuery` describes them.

        Returns:
            One :class:`WhatIfResult` per composition.
        """
        return self._b.whatif(WhatIfQuery.of(compositions, options, **kwargs))

    def history(self) -> dict[str, Any]:
        """Summary of the recorded shapes (``GET /v1/history``)."""
        return self._b.history()

    def health(self) -> dict[str, Any]:
        """``{"status": "ok", "backend": "embedded" | "http", ...}``; raises if unreachable."""
        return self._b.health()

    def close(self) -> None:
        self._b.close()

    def __enter__(self) -> Packer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncPacker(_Packers):
    """:class:`Packer` for asyncio: the same arguments, awaitable methods.

    The embedded backend runs the planner in a worker thread (``asyncio.to_thread``).
    """

    _asynchronous = True
    _b: AsyncBackend

    async def pack(
        self, sequences: Sequence[Any] | PackInput, options: PlanOptions | None = None, **kwargs: Any
    ) -> Plan:
        """See :meth:`Packer.pack` (same arguments and defaults)."""
        return await self._b.pack(PackInput.of(sequences, options, **kwargs))

    async def whatif(
        self, compositions: Sequence[CompositionLike], options: PlanOptions | None = None, **kwargs: Any
    ) -> list[WhatIfResult]:
        """See :meth:`Packer.whatif` (same arguments and defaults)."""
        return await self._b.whatif(WhatIfQuery.of(compositions, options, **kwargs))

    async def history(self) -> dict[str, Any]:
        return await self._b.history()

    async def health(self) -> dict[str, Any]:
        return await self._b.health()

    async def close(self) -> None:
        await self._b.close()

    async def __aenter__(self) -> AsyncPacker:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

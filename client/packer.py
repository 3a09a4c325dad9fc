"""``Packer`` (sync) and ``AsyncPacker`` (async): one interface, embedded or HTTP backend.

``Packer()`` plans in this process (no server needed); ``Packer(url=...)`` talks to a
``treepack serve`` sidecar over HTTP (msgpack by default). Both return the same types:
:class:`~treepack.proto.plan.Plan` from :meth:`Packer.pack` (equal over both backends),
:class:`~treepack.proto.whatif.WhatIfResult` from :meth:`Packer.whatif`,
and raise the same exceptions (:mod:`treepack.proto.errors`), server messages and field
paths included.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Mapping, Sequence, Union

from treepack.proto.codec import Format
from treepack.proto.errors import InputTypeError
from treepack.proto.options import PlanOptions, as_options
from treepack.proto.plan import Plan
from treepack.proto.shape import BatchShape
from treepack.proto.whatif import Composition, WhatIfResult

__all__ = ["Packer", "AsyncPacker", "CompositionLike", "as_composition"]

CompositionLike = Union[Composition, int, Mapping[str, Any]]


def as_composition(c: CompositionLike, i: int = 0) -> Composition:
    """A :class:`Composition` from itself, a group count, or a dict (``groups``/``by_tag``/``name``)."""
    if isinstance(c, Composition):
        return c
    if isinstance(c, int) and not isinstance(c, bool):
        return Composition(groups=c)
    if isinstance(c, Mapping):
        unknown = set(c) - {"name", "groups", "by_tag"}
        if unknown:
            raise InputTypeError(f"unknown composition field(s) {sorted(unknown)}", path=f"$.compositions[{i}]", rule="unknown_field")
        return Composition(name=c.get("name", ""), groups=c.get("groups"), by_tag=c.get("by_tag"))
    raise InputTypeError(f"expected a Composition, an int or a dict, got {type(c).__name__}", path=f"$.compositions[{i}]", rule="type")


def _backend(
    url: str | None,
    token: str | None,
    timeout: float,
    retries: int,
    backoff: float,
    max_backoff: float,
    fmt: Format,
    transport: Any,
    history_path: str | None,
    dedup: bool,
    asynchronous: bool,
) -> Any:
    if url is None:
        from treepack.client.embedded import EmbeddedBackend

        return EmbeddedBackend(history_path)
    from treepack.client.http import AsyncHttpBackend, HttpBackend, RetryPolicy

    cls = AsyncHttpBackend if asynchronous else HttpBackend
    policy = RetryPolicy(retries=retries, backoff=backoff, max_backoff=max_backoff)
    return cls(url, token=token, timeout=timeout, policy=policy, fmt=fmt, transport=transport, dedup=dedup)


class Packer:
    """Plan batches, embedded (default) or through a sidecar.

    Args:
        url: the sidecar's base URL (``http://127.0.0.1:8000``); None plans in-process.
        token: bearer token for a sidecar that requires one.
        timeout: seconds per HTTP attempt (connect, write, read each).
        retries: retries on connection failures and 503 (module ``treepack.client.http``).
        backoff: first retry wait in seconds (doubles each retry) when no Retry-After.
        max_backoff: cap on any single wait, Retry-After included.
        fmt: ``msgpack`` (default) or ``json`` on the wire.
        transport: an httpx transport (tests: ``httpx.ASGITransport`` with AsyncPacker).
        history_path: embedded only: a local SQLite shape history for what-if.
        dedup: HTTP only: send a sequence's prefix shared with its group's first sequence
            as a reference, not again (about half the bytes for GRPO groups; same plan).
    """

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
    ) -> None:
        self.url = url
        self._b = _backend(url, token, timeout, retries, backoff, max_backoff, fmt, transport, history_path, dedup, False)

    @classmethod
    def from_env(cls, **kwargs: Any) -> "Packer":
        """A packer configured by ``TREEPACK_URL`` (unset or empty: embedded) and ``TREEPACK_TOKEN``.

        The sidecar deployments (``deploy/``) set these for the trainer container.
        """
        return cls(os.environ.get("TREEPACK_URL") or None, token=os.environ.get("TREEPACK_TOKEN") or None, **kwargs)

    def pack(
        self,
        sequences: Sequence[Any],
        options: PlanOptions | None = None,
        *,
        trainable: Sequence[Any] | None = None,
        groups: Sequence[Any] | None = None,
        keys: Sequence[Any] | None = None,
        tags: Sequence[str | None] | None = None,
        record: bool = True,
        **option_kwargs: Any,
    ) -> Plan:
        """Pack a batch; the arguments of :func:`~treepack.service.planner.plan_batch`, plus:

        Args:
            options: a :class:`~treepack.proto.options.PlanOptions`, or its fields as
                keywords (``seq_len=...``, ``placement=...``).
            tags: per sequence a task tag, recorded with the shape (what-if by tag).
            record: record the batch's shape in the history (opt out with False).

        Returns:
            The :class:`Plan`.

        Raises:
            RequestError: (or a subclass) for invalid input, naming the field and rule.
            OverloadedError: the sidecar stayed busy through every retry.
            TransportError: the sidecar could not be reached.
        """
        opts = as_options(options, option_kwargs)
        return self._b.pack(sequences, opts, trainable=trainable, groups=groups, keys=keys, tags=tags, record=record)

    def whatif(
        self,
        compositions: Sequence[CompositionLike],
        options: PlanOptions | None = None,
        *,
        trials: int = 32,
        seed: int = 0,
        max_rows: int | None = None,
        history_batches: int | None = None,
        shapes: Sequence[BatchShape] | None = None,
        **option_kwargs: Any,
    ) -> list[WhatIfResult]:
        """Row distributions of candidate compositions, from the history or ``shapes``.

        Args:
            compositions: each a :class:`Composition`, a group count, or a dict such as
                ``{"by_tag": {"math": 20, "code": 12}}``.
            options: the plan options of every trial (``seq_len`` is the row capacity to
                plan for), or their fields as keywords; as for ``pack`` (shapes record no
                trainable tokens: the generalized mode shares none in a trial).
            trials: trials per composition; ``seed`` makes them reproducible.
            max_rows: also report the probability of needing more rows than this.
            history_batches: sample only the most recent N recorded batches.
            shapes: sample these batches instead of the history.

        Returns:
            One :class:`WhatIfResult` per composition.
        """
        comps = [as_composition(c, i) for i, c in enumerate(compositions)]
        opts = as_options(options, option_kwargs)
        return self._b.whatif(comps, opts, trials=trials, seed=seed, max_rows=max_rows, history_batches=history_batches, shapes=shapes)

    def history(self) -> dict[str, Any]:
        """Summary of the recorded shapes (``GET /v1/history``)."""
        return self._b.history()

    def health(self) -> dict[str, Any]:
        """``{"status": "ok", "backend": "embedded" | "http", ...}``; raises if unreachable."""
        return self._b.health()

    def close(self) -> None:
        self._b.close()

    def __enter__(self) -> "Packer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncPacker:
    """:class:`Packer` for asyncio: the same arguments, awaitable methods.

    The embedded backend runs the planner in a worker thread (``asyncio.to_thread``).
    """

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
    ) -> None:
        self.url = url
        self._b = _backend(url, token, timeout, retries, backoff, max_backoff, fmt, transport, history_path, dedup, True)
        self._embedded = url is None

    @classmethod
    def from_env(cls, **kwargs: Any) -> "AsyncPacker":
        """See :meth:`Packer.from_env`."""
        return cls(os.environ.get("TREEPACK_URL") or None, token=os.environ.get("TREEPACK_TOKEN") or None, **kwargs)

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self._b, name)
        if self._embedded:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return await fn(*args, **kwargs)

    async def pack(
        self,
        sequences: Sequence[Any],
        options: PlanOptions | None = None,
        *,
        trainable: Sequence[Any] | None = None,
        groups: Sequence[Any] | None = None,
        keys: Sequence[Any] | None = None,
        tags: Sequence[str | None] | None = None,
        record: bool = True,
        **option_kwargs: Any,
    ) -> Plan:
        """See :meth:`Packer.pack` (same arguments and defaults)."""
        opts = as_options(options, option_kwargs)
        return await self._call("pack", sequences, opts, trainable=trainable, groups=groups, keys=keys, tags=tags, record=record)

    async def whatif(
        self,
        compositions: Sequence[CompositionLike],
        options: PlanOptions | None = None,
        *,
        trials: int = 32,
        seed: int = 0,
        max_rows: int | None = None,
        history_batches: int | None = None,
        shapes: Sequence[BatchShape] | None = None,
        **option_kwargs: Any,
    ) -> list[WhatIfResult]:
        """See :meth:`Packer.whatif` (same arguments and defaults)."""
        comps = [as_composition(c, i) for i, c in enumerate(compositions)]
        opts = as_options(options, option_kwargs)
        return await self._call("whatif", comps, opts, trials=trials, seed=seed, max_rows=max_rows, history_batches=history_batches, shapes=shapes)

    async def history(self) -> dict[str, Any]:
        return await self._call("history")

    async def health(self) -> dict[str, Any]:
        return await self._call("health")

    async def close(self) -> None:
        if self._embedded:
            self._b.close()
        else:
            await self._b.close()

    async def __aenter__(self) -> "AsyncPacker":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

"""``Packer`` (sync) and ``AsyncPacker`` (async): one interface, embedded or HTTP backend.

``Packer()`` plans in this process (no server needed); ``Packer(url=...)`` talks to a
``treepack serve`` sidecar over HTTP (msgpack by default). Both return the same types:
:class:`~treepack.service.planner.Plan` from :meth:`Packer.pack` (``tree`` is None over
HTTP), :class:`~treepack.service.planner.whatif.WhatIfResult` from :meth:`Packer.whatif`,
and raise the same exceptions (:mod:`treepack.proto.errors`), server messages and field
paths included.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Mapping, Sequence, Union

from treepack.proto.codec import Format
from treepack.proto.errors import InputTypeError
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
        *,
        seq_len: int,
        min_shared_len: int = 64,
        placement: str = "auto",
        trainable: Sequence[Any] | None = None,
        groups: Sequence[Any] | None = None,
        keys: Sequence[Any] | None = None,
        num_ranks: int = 1,
        on_overflow: str = "error",
        conv_width: int = 4,
        share_trainable: bool = False,
        tags: Sequence[str | None] | None = None,
        record: bool = True,
    ) -> Plan:
        """Pack a batch; the arguments of :func:`~treepack.service.planner.plan_batch`, plus:

        Args:
            tags: per sequence a task tag, recorded with the shape (what-if by tag).
            record: record the batch's shape in the history (opt out with False).

        Returns:
            The :class:`Plan`.

        Raises:
            RequestError: (or a subclass) for invalid input, naming the field and rule.
            OverloadedError: the sidecar stayed busy through every retry.
            TransportError: the sidecar could not be reached.
        """
        return self._b.pack(
            sequences, seq_len=seq_len, min_shared_len=min_shared_len, placement=placement, trainable=trainable, groups=groups,
            keys=keys, num_ranks=num_ranks, on_overflow=on_overflow, conv_width=conv_width,
            share_trainable=share_trainable, tags=tags, record=record,
        )  # fmt: skip

    def whatif(
        self,
        compositions: Sequence[CompositionLike],
        *,
        seq_len: int,
        trials: int = 32,
        seed: int = 0,
        min_shared_len: int = 64,
        placement: str = "auto",
        num_ranks: int = 1,
        conv_width: int = 4,
        on_overflow: str = "error",
        share_trainable: bool = False,
        max_rows: int | None = None,
        history_batches: int | None = None,
        shapes: Sequence[BatchShape] | None = None,
    ) -> list[WhatIfResult]:
        """Row distributions of candidate compositions, from the history or ``shapes``.

        Args:
            compositions: each a :class:`Composition`, a group count, or a dict such as
                ``{"by_tag": {"math": 20, "code": 12}}``.
            seq_len: the row capacity to plan for.
            trials: trials per composition; ``seed`` makes them reproducible.
            max_rows: also report the probability of needing more rows than this.
            history_batches: sample only the most recent N recorded batches.
            shapes: sample these batches instead of the history.
            min_shared_len, placement, num_ranks, conv_width, on_overflow, share_trainable:
                as for ``pack`` (shapes record no trainable tokens: the generalized mode
                shares none in a trial).

        Returns:
            One :class:`WhatIfResult` per composition.
        """
        comps = [as_composition(c, i) for i, c in enumerate(compositions)]
        return self._b.whatif(
            comps, seq_len=seq_len, trials=trials, seed=seed, min_shared_len=min_shared_len, placement=placement,
            num_ranks=num_ranks, conv_width=conv_width, on_overflow=on_overflow, share_trainable=share_trainable,
            max_rows=max_rows, history_batches=history_batches, shapes=shapes,
        )  # fmt: skip

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

    async def pack(self, sequences: Sequence[Any], *, seq_len: int, **kwargs: Any) -> Plan:
        """See :meth:`Packer.pack` (same keyword arguments and defaults)."""
        _check_kwargs(kwargs, _PACK_KW)
        return await self._call("pack", sequences, seq_len=seq_len, **{**_PACK_KW, **kwargs})

    async def whatif(self, compositions: Sequence[CompositionLike], *, seq_len: int, **kwargs: Any) -> list[WhatIfResult]:
        """See :meth:`Packer.whatif` (same keyword arguments and defaults)."""
        _check_kwargs(kwargs, _WHATIF_KW)
        comps = [as_composition(c, i) for i, c in enumerate(compositions)]
        return await self._call("whatif", comps, seq_len=seq_len, **{**_WHATIF_KW, **kwargs})

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


_PACK_KW: dict[str, Any] = dict(
    min_shared_len=64, placement="auto", trainable=None, groups=None, keys=None, num_ranks=1, on_overflow="error", conv_width=4,
    share_trainable=False, tags=None, record=True,
)
_WHATIF_KW: dict[str, Any] = dict(
    trials=32, seed=0, min_shared_len=64, placement="auto", num_ranks=1, conv_width=4, on_overflow="error", share_trainable=False,
    max_rows=None, history_batches=None, shapes=None,
)


def _check_kwargs(given: Mapping[str, Any], allowed: Mapping[str, Any]) -> None:
    unknown = set(given) - set(allowed)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; expected some of {sorted(allowed)}")

"""Ranks: one rank plans, every rank gets the plan and materializes only its rows (SPEC 7).

Flow (every rank calls the same functions, collectives inside)::

    rp = plan_and_broadcast(seqs if rank == 0 else None, trainable=..., groups=...,
                            seq_len=C, planner=packer)   # rank 0 asks the planner
    batch = rp.materialize(sequences, payloads=..., device=dev)  # this rank's rows

- The planner is ``treepack.client.Packer`` (anything with ``.pack(sequences, **kw)``:
  embedded, or the HTTP sidecar with ``Packer(url=...)``), any callable with
  ``plan_batch``'s signature, or, by default, :func:`~treepack.service.planner.plan_batch`.
- The plan travels as one uint8 tensor: a JSON header (scalars, stats, array names,
  dtypes, shapes) and the raw little-endian bytes of every array. Nothing is pickled.
  The request's trainable flags and group codes travel with it, since every rank needs
  them for the loss normalizations (which count all sequences' tokens).
- A planner error on the planning rank is broadcast too and raised on every rank (the
  other ranks would otherwise wait in the collective forever).
- ``rank_rows[rank]`` holds ``-1`` for empty padding rows: the rank materializes them as
  padding (no loss), so every rank runs the same number of rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np
import torch

from treepack.proto.errors import InputTypeError, RequestError, TreepackError, error_from_payload
from treepack.service.planner.inputs import OverflowEvent
from treepack.service.planner.layout import Segments
from treepack.service.planner.metadata import AttentionMeta, GdnLevel, GdnMeta
from treepack.service.planner.plan import Plan, PlanStats
from treepack.service.planner.ranks import Ranks
from treepack.trainer.batch import PackedBatch
from treepack.trainer.materialize import materialize, normalize_trainable

__all__ = ["RankPlan", "obtain_plan", "encode_plan", "decode_plan", "broadcast_plan", "plan_and_broadcast"]

FORMAT = "treepack-plan/1"


def obtain_plan(sequences: Sequence[Any], *, planner: Any = None, **plan_kwargs: Any) -> Plan:
    """Ask ``planner`` for a plan: ``.pack(...)`` if it has one, a callable, or ``plan_batch``."""
    if planner is None:
        from treepack.service.planner import plan_batch

        return plan_batch(sequences, **plan_kwargs)
    if hasattr(planner, "pack"):
        return planner.pack(sequences, **plan_kwargs)
    if callable(planner):
        return planner(sequences, **plan_kwargs)
    raise InputTypeError(f"planner must have .pack(...) or be callable, got {type(planner).__name__}", path="$.planner", rule="type")


def _put(arrays: list, spec: list, name: str, arr: np.ndarray) -> None:
    a = np.ascontiguousarray(arr)
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    spec.append([name, a.dtype.str, list(a.shape)])
    arrays.append(a.tobytes())


def encode_plan(plan: Plan, extra: dict[str, np.ndarray] | None = None) -> bytes:
    """The plan (and optional named arrays) as bytes: u64 header length, JSON header, arrays.

    The planner-side ``tree`` is not encoded (the trainer never needs it).
    """
    arrays: list[bytes] = []
    spec: list = []
    for sub in ("segments", "attention"):
        obj = getattr(plan, sub)
        for f in fields(obj):
            _put(arrays, spec, f"{sub}.{f.name}", getattr(obj, f.name))
    for name in ("seq_lens", "orig_lens", "row_of"):
        _put(arrays, spec, name, getattr(plan, name))
    for name in ("rank_rows", "row_cost", "rank_cost"):
        _put(arrays, spec, f"ranks.{name}", getattr(plan.ranks, name))
    for d, lv in enumerate(plan.gdn.levels):
        for name in ("segs", "cu_seqlens", "parent", "parent_slot", "conv_context"):
            _put(arrays, spec, f"gdn.{d}.{name}", getattr(lv, name))
    for name, arr in (extra or {}).items():
        _put(arrays, spec, f"extra.{name}", np.asarray(arr))
    st = plan.stats
    header = {
        "format": FORMAT,
        "scalars": {k: getattr(plan, k) for k in ("seq_len", "num_rows", "placement", "strategy", "min_shared_len")},
        "num_ranks": plan.ranks.num_ranks,
        "conv_width": plan.gdn.conv_width,
        "gdn_levels": len(plan.gdn.levels),
        "stats": {f.name: getattr(st, f.name) for f in fields(st)},
        "overflow": [[e.index, e.length, e.action] for e in plan.overflow],
        "arrays": spec,
    }
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(arrays)


def _header(buf: bytes) -> tuple[dict, int]:
    n = int.from_bytes(buf[:8], "little")
    return json.loads(buf[8 : 8 + n].decode()), 8 + n


def decode_plan(buf: bytes) -> tuple[Plan, dict[str, np.ndarray]]:
    """Inverse of :func:`encode_plan`: (plan, extra arrays)."""
    header, off = _header(buf)
    if header.get("format") != FORMAT:
        raise RequestError(f"unknown plan encoding {header.get('format')!r}, expected {FORMAT!r}", path="$.plan", rule="format")
    arr: dict[str, np.ndarray] = {}
    for name, dtype, shape in header["arrays"]:
        dt = np.dtype(dtype)
        size = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        arr[name] = np.frombuffer(buf, dtype=dt, count=size // dt.itemsize if dt.itemsize else 0, offset=off).reshape(shape).astype(dt.newbyteorder("="))
        off += size
    sub = lambda cls, prefix: cls(**{f.name: arr[f"{prefix}.{f.name}"] for f in fields(cls)})  # noqa: E731
    levels = tuple(
        GdnLevel(depth=d, **{k: arr[f"gdn.{d}.{k}"] for k in ("segs", "cu_seqlens", "parent", "parent_slot", "conv_context")})
        for d in range(header["gdn_levels"])
    )
    plan = Plan(
        **header["scalars"],
        seq_lens=arr["seq_lens"],
        orig_lens=arr["orig_lens"],
        row_of=arr["row_of"],
        segments=sub(Segments, "segments"),
        attention=sub(AttentionMeta, "attention"),
        gdn=GdnMeta(conv_width=header["conv_width"], levels=levels),
        ranks=Ranks(num_ranks=header["num_ranks"], rank_rows=arr["ranks.rank_rows"], row_cost=arr["ranks.row_cost"], rank_cost=arr["ranks.rank_cost"]),
        stats=PlanStats(**header["stats"]),
        overflow=tuple(OverflowEvent(index=i, length=n, action=a) for i, n, a in header["overflow"]),
    )
    extra = {k[len("extra.") :]: v for k, v in arr.items() if k.startswith("extra.")}
    return plan, extra


def _comm_device(group: Any) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_bytes(data: bytes | None, src: int, group: Any) -> bytes:
    import torch.distributed as dist

    dev = _comm_device(group)
    mine = dist.get_rank() == src
    n = torch.tensor([len(data) if mine else 0], dtype=torch.int64, device=dev)
    dist.broadcast(n, src, group=group)
    if mine:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    else:
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src, group=group)
    return data if mine else buf.cpu().numpy().tobytes()


def broadcast_plan(plan: Plan | None, *, src: int = 0, group: Any = None, extra: dict[str, np.ndarray] | None = None) -> tuple[Plan, dict[str, np.ndarray]]:
    """Send ``plan`` (given on rank ``src``, None elsewhere) to every rank of ``group``.

    Returns:
        (plan, extra arrays) on every rank.
    """
    import torch.distributed as dist

    data = encode_plan(plan, extra) if dist.get_rank() == src else None
    return decode_plan(_broadcast_bytes(data, src, group))


def _error_bytes(err: BaseException) -> bytes:
    if isinstance(err, TreepackError):
        payload = err.to_payload()
    else:
        payload = {"error": "server_error", "message": f"{type(err).__name__}: {err}", "path": "$", "rule": "planner_failed"}
    head = json.dumps({"format": "treepack-error/1", "error": payload}).encode()
    return len(head).to_bytes(8, "little") + head


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlan:
    """A plan as every rank sees it after :func:`plan_and_broadcast`.

    Attributes:
        plan: the plan (``plan.ranks.rank_rows[rank]`` are this rank's rows).
        rank: this process's rank in the group.
        trainable: per sequence [seq_lens[s]] bool flags, as the planner got them.
        groups: [S] int64 group codes (equal codes, equal groups), or None.
    """

    plan: Plan
    rank: int
    trainable: list[np.ndarray]
    groups: np.ndarray | None

    @property
    def rows(self) -> np.ndarray:
        """[K] this rank's global rows, -1 for empty padding rows."""
        return self.plan.ranks.rank_rows[self.rank]

    def materialize(self, sequences: Sequence[Any], payloads: dict[str, Any] | None = None, device: Any = None, **kwargs: Any) -> PackedBatch:
        """:func:`~treepack.trainer.materialize` of this rank's rows with the broadcast flags
        and groups. ``sequences`` and payloads are read only at the sequences of these rows."""
        groups = None if self.groups is None else self.groups.tolist()
        return materialize(self.plan, sequences, payloads, device, trainable=self.trainable, groups=groups, rows=self.rows, **kwargs)


def plan_and_broadcast(
    sequences: Sequence[Any] | None,
    *,
    trainable: Sequence[Any] | None = None,
    groups: Sequence[Any] | None = None,
    planner: Any = None,
    src: int = 0,
    group: Any = None,
    **plan_kwargs: Any,
) -> RankPlan:
    """Plan on rank ``src`` and hand the plan to every rank (a collective: all ranks call it).

    Args:
        sequences, trainable, groups: the request, needed on rank ``src`` only.
        planner: a ``Packer``, a callable, or None for the embedded ``plan_batch``.
        src: the planning rank.
        group: the process group (default: the world).
        **plan_kwargs: the planner's options (``seq_len``, ``min_shared_len``, ...);
            ``num_ranks`` defaults to the group size.

    Returns:
        The :class:`RankPlan` of this rank.

    Raises:
        The planner's error, on every rank (rebuilt from its message on the others).
    """
    import torch.distributed as dist

    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    world = dist.get_world_size(group)
    data = None
    failure: BaseException | None = None
    if dist.get_rank() == src:
        try:
            kw = dict(plan_kwargs)
            kw.setdefault("num_ranks", world)
            plan = obtain_plan(sequences, planner=planner, trainable=trainable, groups=groups, **kw)
            flags = normalize_trainable(trainable, plan)
            extra = {
                "trainable": np.concatenate([flags(s) for s in range(plan.num_sequences)]).astype(np.uint8),
                "groups": _group_codes(groups, plan.num_sequences),
            }
            data = encode_plan(plan, extra)
        except Exception as e:  # every rank must leave the collective below
            failure = e
            data = _error_bytes(e)
    buf = _broadcast_bytes(data, src, group)
    if failure is not None:
        raise failure
    header, _ = _header(buf)
    if header.get("format") == "treepack-error/1":
        raise error_from_payload(header["error"], 500 if header["error"].get("error") == "server_error" else 422)
    plan, extra = decode_plan(buf)
    ptr = np.concatenate([[0], np.cumsum(plan.seq_lens)])
    tr = extra["trainable"].astype(bool)
    flags_list = [tr[ptr[s] : ptr[s + 1]] for s in range(plan.num_sequences)]
    codes = extra["groups"]
    return RankPlan(plan=plan, rank=rank, trainable=flags_list, groups=None if codes.shape[0] == 0 else codes)


def _group_codes(groups: Sequence[Any] | None, S: int) -> np.ndarray:
    if groups is None:
        return np.zeros(0, dtype=np.int64)
    index: dict[Any, int] = {}
    out = np.empty(S, dtype=np.int64)
    for s, g in enumerate(groups):
        key = ("__own__", s) if g is None else (int(g) if isinstance(g, np.integer) else g)
        out[s] = index.setdefault(key, len(index))
    return out

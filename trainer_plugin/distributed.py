"""Ranks: one rank plans, every rank gets the plan and materializes only its rows (SPEC 7).

Flow (every rank calls the same functions, collectives inside)::

    rp = plan_and_broadcast(seqs if rank == 0 else None, trainable=..., groups=...,
                            seq_len=C, planner=packer)   # rank 0 asks the planner
    batch = rp.materialize(sequences, payloads=..., device=dev)  # this rank's rows

- The planner is a :class:`treepack.client.Packer` (anything with ``.pack(sequences,
  **kw)``: embedded, or the HTTP sidecar with ``Packer(url=...)``), a sidecar URL, any
  callable with ``Packer.pack``'s signature, or, by default, an embedded ``Packer()``.
- The plan travels as one uint8 tensor holding the project's own encoding: a msgpack map
  ``{"version": WIRE_VERSION, "plan": PlanMessage, "extra": {name: array object}}`` with the plan
  exactly as ``POST /v1/pack`` sends it (:mod:`treepack.proto.plan_wire`, schema in
  ``proto/``) and extra arrays as the same typed array objects. Nothing is pickled. The
  request's trainable flags and group codes travel as extras, since every rank needs them
  for the loss normalizations (which count all sequences' tokens).
- A planner error on the planning rank is broadcast too, as ``{"version": WIRE_VERSION, "error":
  ErrorBody}`` (the service's error body), and raised on every rank (the other ranks
  would otherwise wait in the collective forever).
- ``rank_rows[rank]`` holds ``-1`` for empty padding rows: the rank materializes them as
  padding (no loss), so every rank runs the same number of rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto import WIRE_VERSION
from treepack.proto.buffers import DTYPES, array_from_wire, array_to_wire
from treepack.proto.codec import decode_body, encode_body
from treepack.proto.errors import InputTypeError, RequestError, TreepackError, error_from_payload
from treepack.proto.plan import Plan
from treepack.proto.plan_wire import plan_from_wire, plan_to_wire
from treepack.trainer.data.materialize import materialize
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.data.sequences import group_codes, normalize_trainable
from treepack.trainer.planning.mesh import mesh_plan_options, mesh_ranks
from treepack.trainer.planning.planner import PlannerArg, obtain_plan

__all__ = ["RankPlan", "obtain_plan", "encode_plan", "decode_plan", "plan_and_broadcast"]


def encode_plan(plan: Plan, extra: dict[str, np.ndarray] | None = None) -> bytes:
    """The plan (and optional named arrays) in the project's wire encoding (module docstring).

    Args:
        plan: the plan; its planner-side ``tree`` is not encoded (the trainer never needs it).
        extra: named arrays of a wire dtype (``|u1``, ``<i4``, ``<i8``, ``<u4``, ``<u8``,
            ``<f8``; :data:`treepack.proto.buffers.DTYPES`), any shape.

    Returns:
        The msgpack bytes.

    Raises:
        InputTypeError: an extra array of another dtype.
    """
    arrays = {}
    for name, arr in (extra or {}).items():
        a = np.asarray(arr)
        dt = a.dtype.newbyteorder("<").str
        if dt not in DTYPES:
            raise InputTypeError(
                f"extra array {name!r} has dtype {a.dtype}; use one of {DTYPES}", path=f"$.extra.{name}", rule="dtype"
            )
        arrays[name] = array_to_wire(a, dt, "msgpack")
    return encode_body({"version": WIRE_VERSION, "plan": plan_to_wire(plan, "msgpack"), "extra": arrays}, "msgpack")


def _message(buf: bytes) -> dict[str, Any]:
    obj = decode_body(buf, "msgpack")
    if not isinstance(obj, dict) or obj.get("version") != WIRE_VERSION or not ("plan" in obj or "error" in obj):
        raise RequestError(f"not a broadcast plan of wire version {WIRE_VERSION}", path="$", rule="format")
    return obj


def _decode(obj: dict[str, Any]) -> tuple[Plan, dict[str, np.ndarray]]:
    extra = obj.get("extra") or {}
    if not isinstance(extra, dict):
        raise InputTypeError(f"extra must be a map, got {type(extra).__name__}", path="$.extra", rule="type")
    arrays = {}
    for name, a in extra.items():
        dt, shape = (a.get("dtype"), a.get("shape")) if isinstance(a, dict) else (None, None)
        if dt not in DTYPES or not isinstance(shape, list):
            raise RequestError(
                f"extra array {name!r} is not a typed array object", path=f"$.extra.{name}", rule="array"
            )
        arrays[name] = array_from_wire(a, dtype=dt, ndim=len(shape), path=f"$.extra.{name}")
    return plan_from_wire(obj["plan"]), arrays


def decode_plan(buf: bytes) -> tuple[Plan, dict[str, np.ndarray]]:
    """Inverse of :func:`encode_plan`: (plan with ``tree=None``, extra arrays).

    Raises:
        RequestError: bytes that are not an encoded plan (the path names the fault).
    """
    obj = _message(buf)
    if "plan" not in obj:
        raise RequestError("the message holds an error, not a plan", path="$.plan", rule="required")
    return _decode(obj)


def comm_device(group: Any = None) -> torch.device:
    """Where a tensor handed to a collective of ``group`` (None: the default group) must live:
    the current CUDA device under nccl, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_bytes(data: bytes | None, src: int, group: Any) -> bytes:
    import torch.distributed as dist

    dev = comm_device(group)
    mine = dist.get_rank() == src
    assert data is not None or not mine, "the source rank sends the payload"
    sent = data if mine and data is not None else b""
    n = torch.tensor([len(sent)], dtype=torch.int64, device=dev)
    dist.broadcast(n, src, group=group)
    if mine:
        buf = torch.frombuffer(bytearray(sent), dtype=torch.uint8).to(dev)
    else:
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src, group=group)
    return sent if mine else buf.cpu().numpy().tobytes()


def _error_bytes(err: BaseException) -> bytes:
    if isinstance(err, TreepackError):
        payload = err.to_payload()
    else:
        payload = {
            "version": WIRE_VERSION,
            "error": "server_error",
            "message": f"{type(err).__name__}: {err}",
            "path": "$",
            "rule": "planner_failed",
        }
    return encode_body({"version": WIRE_VERSION, "error": payload}, "msgpack")


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlan:
    """A plan as every rank sees it after :func:`plan_and_broadcast`.

    Attributes:
        plan: the plan (``plan.ranks.rank_rows[rank]`` are this rank's rows).
        rank: this process's rank in the group (with a mesh: its data-parallel rank).
        cp: with a mesh whose CP dimension is > 1, this process's
            :class:`~treepack.trainer.kernels.cp.ContextParallel` group (materialize then
            gives its shard of every row), else None.
        trainable: per sequence [seq_lens[s]] bool flags, as the planner got them.
        groups: [S] int64 group codes (equal codes, equal groups), or None.
    """

    plan: Plan
    rank: int
    trainable: list[np.ndarray]
    groups: np.ndarray | None
    cp: Any = None

    @property
    def rows(self) -> np.ndarray:
        """[K] this rank's global rows, -1 for empty padding rows."""
        return self.plan.ranks.rank_rows[self.rank]

    def materialize(
        self, sequences: Sequence[Any], payloads: dict[str, Any] | None = None, device: Any = None, **kwargs: Any
    ) -> PackedBatch:
        """:func:`~treepack.trainer.data.materialize` of this rank's rows with the broadcast flags
        and groups. ``sequences`` and payloads are read only at the sequences of these rows."""
        groups = None if self.groups is None else self.groups.tolist()
        kwargs.setdefault("cp", self.cp)
        return materialize(
            self.plan, sequences, payloads, device, trainable=self.trainable, groups=groups, rows=self.rows, **kwargs
        )


def plan_and_broadcast(
    sequences: Sequence[Any] | None,
    *,
    trainable: Sequence[Any] | None = None,
    groups: Sequence[Any] | None = None,
    planner: PlannerArg = None,
    src: int = 0,
    group: Any = None,
    mesh: Any = None,
    **plan_kwargs: Any,
) -> RankPlan:
    """Plan on rank ``src`` and hand the plan to every rank (a collective: all ranks call it).

    Args:
        sequences, trainable, groups: the request, needed on rank ``src`` only.
        planner: as :func:`obtain_plan` (None: an embedded ``Packer()``).
        src: the planning rank.
        group: the process group (default: the world).
        mesh: a data-parallel x context-parallel ``DeviceMesh`` (dims ``"dp"``, ``"cp"``;
            :mod:`~treepack.trainer.planning.mesh`) instead of ``group``: the plan goes to
            every rank of the mesh, with ``num_ranks`` its DP size and ``cp_size`` its CP
            size; rows are dealt to DP ranks and each row split over its CP group
            (``RankPlan.rank`` is the DP rank, ``RankPlan.cp`` the CP group). The mesh
            spans the default group, which the plan is broadcast over.
        **plan_kwargs: the planner's options (``seq_len``, ``min_shared_len``, ...);
            ``num_ranks`` defaults to the group size.

    Returns:
        The :class:`RankPlan` of this rank.

    Raises:
        The planner's error, on every rank (rebuilt from its message on the others).
    """
    import torch.distributed as dist

    cp = None
    if mesh is not None:
        if group is not None:
            raise InputTypeError("pass a process group or a mesh, not both", path="$.mesh", rule="exclusive")
        m = mesh_ranks(mesh)
        plan_kwargs, cp = mesh_plan_options(m, plan_kwargs), m.cp
    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    world = dist.get_world_size(group)
    data = None
    failure: BaseException | None = None
    if dist.get_rank() == src:
        try:
            if sequences is None:  # the packer's own refusal, raised before it is called
                raise InputTypeError("sequences must be a list of token arrays", path="$.sequences", rule="type")
            kw = dict(plan_kwargs)
            kw.setdefault("num_ranks", world)
            plan = obtain_plan(sequences, planner=planner, trainable=trainable, groups=groups, **kw)
            flags = normalize_trainable(trainable, plan)
            extra = {
                "trainable": np.concatenate([flags(s) for s in range(plan.num_sequences)]).astype(np.uint8),
                "groups": np.zeros(0, np.int64) if groups is None else group_codes(groups, plan.num_sequences),
            }
            data = encode_plan(plan, extra)
        except Exception as e:  # every rank must leave the collective below
            failure = e
            data = _error_bytes(e)
    buf = _broadcast_bytes(data, src, group)
    if failure is not None:
        raise failure
    obj = _message(buf)
    if "error" in obj:
        raise error_from_payload(obj["error"], 500 if obj["error"].get("error") == "server_error" else 422)
    plan, extra = _decode(obj)
    ptr = np.concatenate([[0], np.cumsum(plan.seq_lens)])
    tr = extra["trainable"].astype(bool)
    flags_list = [tr[ptr[s] : ptr[s + 1]] for s in range(plan.num_sequences)]
    codes = extra["groups"]
    if mesh is not None:
        rank = m.dp_rank
    return RankPlan(plan=plan, rank=rank, trainable=flags_list, groups=None if codes.shape[0] == 0 else codes, cp=cp)

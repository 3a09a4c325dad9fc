"""A data-parallel x context-parallel device mesh, as the planning entry points read it.

Following torchtitan's convention, the mesh is a ``torch.distributed.device_mesh.DeviceMesh``
whose dimensions are named ``"dp"`` (data parallel: rows are dealt to these ranks) and
``"cp"`` (context parallel: each row is split over these ranks), either may be absent
(size 1); e.g. ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))``. The CP
dimension is the inner one: the ranks of one CP group share their data-parallel rank's
rows, each holding its shard of every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treepack.proto.errors import InputTypeError, RequestError
from treepack.trainer.kernels.cp import ContextParallel

__all__ = ["MeshRanks", "mesh_ranks", "mesh_plan_options"]

MESH_DIMS = ("dp", "cp")


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshRanks:
    """This process's place in a DP x CP mesh.

    Attributes:
        dp_size: data-parallel ranks (``num_ranks`` of the plan). dp_rank: this one's.
        cp_size: ranks of each CP group (``cp_size`` of the plan).
        cp: this process's :class:`~treepack.trainer.kernels.cp.ContextParallel` group
            (None when ``cp_size`` is 1).
        dp_group: the process group of the data-parallel dimension (None when absent):
            what DDP or FSDP synchronises gradients over.
    """

    dp_size: int
    dp_rank: int
    cp_size: int
    cp: ContextParallel | None
    dp_group: Any


def mesh_ranks(mesh: Any, *, strategy: str = "auto") -> MeshRanks:
    """Read a DP x CP ``DeviceMesh`` (module docstring).

    Args:
        mesh: a ``DeviceMesh`` with ``mesh_dim_names`` from ``("dp", "cp")``.
        strategy: the :class:`ContextParallel` strategy of the CP group.

    Raises:
        InputTypeError: not a named mesh, or a dimension name other than ``dp``/``cp``.
    """
    names = getattr(mesh, "mesh_dim_names", None)
    if not names or not hasattr(mesh, "get_group"):
        raise InputTypeError(
            f"mesh must be a torch DeviceMesh with mesh_dim_names from {MESH_DIMS}, got {type(mesh).__name__}",
            path="$.mesh",
            rule="type",
        )
    bad = [n for n in names if n not in MESH_DIMS]
    if bad or len(set(names)) != len(names):
        raise InputTypeError(
            f"mesh dimensions must be named from {MESH_DIMS}, got {tuple(names)}",
            path="$.mesh.mesh_dim_names",
            rule="mesh_dims",
        )

    def dim(name: str) -> tuple[int, int, Any]:
        if name not in names:
            return 1, 0, None
        return int(mesh.size(names.index(name))), int(mesh.get_local_rank(name)), mesh.get_group(name)

    dp_size, dp_rank, dp_group = dim("dp")
    cp_size, _, cp_group = dim("cp")
    cp = ContextParallel(cp_group, strategy=strategy) if cp_size > 1 else None
    return MeshRanks(dp_size=dp_size, dp_rank=dp_rank, cp_size=cp_size, cp=cp, dp_group=dp_group)


def mesh_plan_options(ranks: MeshRanks, plan_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``plan_kwargs`` with ``num_ranks`` and ``cp_size`` from the mesh.

    Raises:
        RequestError: ``num_ranks`` or ``cp_size`` given and not the mesh's.
    """
    kw = dict(plan_kwargs)
    for key, size, dim in (("num_ranks", ranks.dp_size, "dp"), ("cp_size", ranks.cp_size, "cp")):
        if kw.get(key, size) != size:
            raise RequestError(
                f"{key}={kw[key]} disagrees with the mesh's {dim!r} dimension of size {size}; leave it out with a mesh",
                path=f"$.{key}",
                rule="mesh",
            )
        kw[key] = size
    return kw

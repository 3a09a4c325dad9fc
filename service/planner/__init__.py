"""The pure planning core (numpy only, no I/O): tree, placement, layout, metadata.

Entry point: :func:`plan_batch`. Invariants: :func:`validate_plan`.
"""

from treepack.proto.options import PLACEMENTS
from treepack.service.planner.api import PlanResult, plan_batch, plan_normalized, plan_with_tree
from treepack.service.planner.baselines import naive_place
from treepack.service.planner.bounds import lower_bound_rows
from treepack.service.planner.invariant import PlanInvariantError
from treepack.service.planner.layout import layout_rows
from treepack.service.planner.naive_tree import naive_build_tree
from treepack.service.planner.options import check_options
from treepack.service.planner.placement import place_leaves
from treepack.service.planner.tree import Tree, build_tree
from treepack.service.planner.validate import validate_plan
from treepack.service.planner.validate_rows import naive_tree_mask

__all__ = [
    "plan_batch",
    "plan_normalized",
    "plan_with_tree",
    "PlanResult",
    "check_options",
    "validate_plan",
    "PlanInvariantError",
    "naive_tree_mask",
    "lower_bound_rows",
    "layout_rows",
    "PLACEMENTS",
    "place_leaves",
    "naive_place",
    "Tree",
    "build_tree",
    "naive_build_tree",
]

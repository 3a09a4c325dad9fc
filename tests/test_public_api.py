"""Each package's public surface (``__all__``) is pinned: a name added or dropped is a decision, seen here."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = [
    pytest.param(
        "treepack.proto",
        {
            "WIRE_VERSION",
            "Plan",
            "PlanStats",
            "PlanOptions",
            "PackInput",
            "SequenceBatch",
            "BatchShape",
            "Composition",
            "WhatIfQuery",
            "WhatIfResult",
            "TreepackError",
            "RequestError",
            "InputTypeError",
            "CapacityError",
            "DecodeError",
            "PayloadTooLargeError",
            "BodyTimeoutError",
            "ConflictError",
            "UnsupportedMediaTypeError",
            "UnsupportedVersionError",
            "UnsupportedModelError",
            "AuthError",
            "OverloadedError",
            "ServerError",
            "DeadlineError",
            "UnavailableError",
            "TransportError",
            "CostModel",
            "load_cost_model",
            "CostModelError",
            "TreepackWarning",
            "Strategy",
        },
        id="proto",
    ),
    pytest.param("treepack.service", {"create_app", "Settings", "__version__"}, id="service"),
    pytest.param(
        "treepack.service.planner",
        {
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
        },
        id="planner",
    ),
    pytest.param("treepack.service.cli", {"main", "build_parser"}, id="cli"),
    pytest.param(
        "treepack.client",
        {"Packer", "AsyncPacker", "Composition", "Distribution", "WhatIfResult", "Strategy", "as_composition"},
        id="client",
    ),
    pytest.param(
        "treepack.trainer",
        {
            "BACKENDS",
            "ContextParallel",
            "PackedBatch",
            "PackedContext",
            "current_packed",
            "materialize",
            "image_keys",
            "naive_varlen_attention",
            "resolve_packed",
            "tree_attention",
            "use_packed",
            "packed_forward",
            "packed",
            "output_head",
            "parity_report",
            "ParityReport",
            "TreepackWarning",
            "check_model",
            "calibrate",
            "time_step",
        },
        id="trainer",
    ),
]


@pytest.mark.parametrize("module,expected", PUBLIC)
def test_public_names(module, expected):
    if module == "treepack.trainer":
        pytest.importorskip("torch")
    mod = importlib.import_module(module)
    names = list(mod.__all__)
    assert len(names) == len(set(names)), f"{module}.__all__ repeats a name"
    assert set(names) == expected, f"added: {sorted(set(names) - expected)}, dropped: {sorted(expected - set(names))}"
    missing = [n for n in names if not hasattr(mod, n)]
    assert missing == [], f"{module}.__all__ names what it does not have"

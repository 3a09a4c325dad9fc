"""The trainer's public surface: what each package exports, and every path the user docs name resolves."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The user docs: the README and every guide.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SURFACE = {
    "treepack.trainer": [
        "materialize",
        "image_keys",
        "ContextParallel",
        "PackedBatch",
        "tree_attention",
        "naive_varlen_attention",
        "BACKENDS",
        "packed_forward",
        "PackedContext",
        "use_packed",
        "current_packed",
        "resolve_packed",
        "packed",
        "output_head",
        "parity_report",
        "ParityReport",
        "TreepackWarning",
        "check_model",
        "calibrate",
        "time_step",
    ],
    "treepack.trainer.hf": [
        "ATTN_IMPLEMENTATION",
        "register_tree_attention",
        "treepack_attention",
        "enable_tree_attention",
        "packed_forward",
        "packed",
        "output_head",
        "OutputHead",
        "unwrap_model",
        "check_model",
        "SupportReport",
        "vision_savings",
        "VisionSavings",
    ],
    "treepack.trainer.data": ["materialize", "PackedBatch"],
    "treepack.trainer.planning": [
        "PaddedSequences",
        "from_padded",
        "from_labeled",
        "routing_keys",
        "image_keys",
        "MicroBatches",
        "plan_microbatches",
        "MeshRanks",
        "mesh_ranks",
        "Planner",
        "PlanFunction",
        "obtain_plan",
    ],
    "treepack.trainer.hf.layers": [
        "TreeLayer",
        "LayerSpec",
        "registered",
        "register",
        "unregister",
        "kind_named",
        "layer_by_class",
        "layer_of",
        "mixer_kind",
        "stock_layer",
        "unhandled_reason",
        "is_handled",
        "handled_layer",
        "patch_layers",
        "unpatch_layers",
        "reference_rules",
    ],
    "treepack.trainer.distributed": ["RankPlan", "obtain_plan", "encode_plan", "decode_plan", "plan_and_broadcast"],
}


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_public_surface(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(SURFACE[module])
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name} is listed in __all__ but missing"


# Extras that live in a test environment of their own (make test-verl): a docs path into a
# module that imports one resolves when the module exists and defines the named attributes.
OWN_VENV_EXTRAS = {"verl"}


def _resolve(path: str) -> object:
    parts = path.split(".")
    for cut in range(len(parts), 1, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in OWN_VENV_EXTRAS:
                try:
                    spec = importlib.util.find_spec(module)
                except ModuleNotFoundError:
                    continue  # ``module`` is a name inside a module that imports the extra: try that module
                assert spec is not None and spec.origin, f"{module} names no module"
                source = Path(spec.origin).read_text()
                for name in parts[cut:]:
                    assert re.search(rf"^(class|def) {name}\b|^{name} =", source, re.M), f"{module} defines no {name}"
                return spec
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


def test_every_trainer_path_in_the_docs_resolves():
    text = "".join(doc.read_text() for doc in DOCS)
    paths = sorted(set(re.findall(r"treepack\.trainer(?:\.[A-Za-z_]\w*)*", text)))
    assert len(paths) >= 8, paths  # the docs name the trainer's layers; the scan found them
    for p in paths:
        _resolve(p)

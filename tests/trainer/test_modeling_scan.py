"""A static scan of the installed transformers' modeling code for the patterns behind past holes.

The scan reads the modeling modules of every family of the model-support table and of the
models that showed each hole (reading all of transformers' modeling code takes minutes).
Three patterns make a model's packed run depend on more than its layer classes; each hit is
listed, each pattern must have hits (the scan is not vacuous: the models that showed the
hole are among them), and each hit must fall under the mechanism that handles it:

1. a decoder layer calling its attention without ``**kwargs`` (StableLM, Nemotron): the
   packed context cannot travel with the arguments on a checkpoint replay. Handled for
   every such layer by the replay itself (``treepack.trainer.hf.dispatch``: the function
   HF's checkpointing replays runs inside the packed context);
2. an attention class that passes no ``sliding_window=`` to its attention function while it
   keeps a window or its model builds sliding-window masks (Qwen2-MoE, PhiMoE: HF applies
   the window only through its mask builders). Handled where ``mask_builder_window`` reads
   the window: from ``config.sliding_window`` (per layer by ``layer_types`` where the config
   has them) when the modeling module builds sliding-window masks; any other hit fails this
   test until it is handled or refused;
3. an attention forward handing its attention function a mask other than the one it was
   given (Doge's dynamic mask): refused at run time by tree attention, which accepts only
   the mask ``packed_forward`` built.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from helpers.families import model_support

transformers = pytest.importorskip("transformers")
KNOWN_CASES = ("stablelm", "nemotron", "qwen2_moe", "phimoe", "doge")

_ATTN_ATTRS = {"self_attn", "attn", "attention", "self_attention"}


@functools.lru_cache(maxsize=None)
def scan() -> dict[str, list[tuple[str, str]]]:
    """{pattern: [(modeling module, class)]} over the scanned ``modeling_*.py`` of transformers."""
    hits: dict[str, list[tuple[str, str]]] = {"kwargs_dropped": [], "window_by_mask_builder": [], "model_built_mask": []}
    root = Path(transformers.__file__).parent / "models"
    types = sorted({r.model_type for r in model_support().FAMILIES} | set(KNOWN_CASES))
    for path in sorted(p for t in types for p in root.glob(f"{t}/modeling_{t}.py")):
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
        name = f"{path.parent.name}/{path.name}"
        builds_windows = "create_sliding_window_causal_mask" in src
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            fns = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
            fwd = fns.get("forward")
            if fwd is None:
                continue
            calls = [c for c in ast.walk(fwd) if isinstance(c, ast.Call)]
            if any(_is_attr_call(c, _ATTN_ATTRS) and not any(k.arg is None for k in c.keywords) for c in calls):
                hits["kwargs_dropped"].append((name, cls.name))
            interface = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "attention_interface"]
            if not interface:
                continue
            keeps_window = builds_windows or "__init__" in fns and any(
                isinstance(t, ast.Attribute) and t.attr == "sliding_window" for a in ast.walk(fns["__init__"]) if isinstance(a, ast.Assign) for t in a.targets
            )
            if keeps_window and not any(k.arg == "sliding_window" or k.arg is None and _names_window(k.value) for c in interface for k in c.keywords):
                hits["window_by_mask_builder"].append((name, cls.name))
            params = {a.arg for a in fwd.args.args + fwd.args.kwonlyargs}
            for c in interface:
                mask = next((k.value for k in c.keywords if k.arg == "attention_mask"), c.args[4] if len(c.args) > 4 else None)
                if mask is not None and not (isinstance(mask, ast.Name) and mask.id in params) and not _is_none(mask):
                    hits["model_built_mask"].append((name, cls.name))
                    break
    return hits


def _is_attr_call(c: ast.Call, attrs: set[str]) -> bool:
    f = c.func
    return isinstance(f, ast.Attribute) and f.attr in attrs and isinstance(f.value, ast.Name) and f.value.id == "self"


def _names_window(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == "sliding_window" for n in ast.walk(node))


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def test_scan_finds_the_known_cases():
    hits = scan()
    models = {k: {m.split("/")[0] for m, _ in v} for k, v in hits.items()}
    assert {"stablelm", "nemotron"} <= models["kwargs_dropped"], sorted(models["kwargs_dropped"])
    assert {"qwen2_moe", "phimoe"} <= models["window_by_mask_builder"], sorted(models["window_by_mask_builder"])
    assert "doge" in models["model_built_mask"], sorted(models["model_built_mask"])


def test_every_mask_builder_window_is_read_by_tree_attention():
    root = Path(transformers.__file__).parent / "models"
    unhandled = []
    for m, c in scan()["window_by_mask_builder"]:
        cfg = next((root / m).parent.glob("configuration_*.py"), None)
        reads = "create_sliding_window_causal_mask" in (root / m).read_text(encoding="utf-8") and cfg is not None and "sliding_window" in cfg.read_text(encoding="utf-8")
        if not reads:
            unhandled.append((m, c))
    assert not unhandled, f"sliding windows applied only by mask builders that treepack cannot read: {unhandled}"


def test_model_built_masks_are_refused_at_run_time():
    from treepack.trainer.hf import attention

    # The run-time rule that refuses every pattern-3 hit: only the mask packed_forward built passes.
    assert attention.TREE_MASK_OPTION == "tree_mask"
    assert "attention_mask is not opts[TREE_MASK_OPTION]" in Path(attention.__file__).read_text(encoding="utf-8")

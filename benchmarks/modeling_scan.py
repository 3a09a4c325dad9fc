"""A static scan of the installed transformers' modeling code for the patterns behind past holes.

Three patterns make a model's packed run depend on more than its layer classes
(``python benchmarks/modeling_scan.py`` prints every hit; ``benchmarks/model_support.py
--write-docs`` writes the per-pattern summary into docs/models.md):

- ``kwargs_dropped``: a class whose ``forward`` calls its attention (``self.self_attn(...)``,
  ``self.attn``, ``self.attention``, ``self.self_attention``) without ``**kwargs``, so a
  per-call argument never reaches attention (StableLM, Nemotron);
- ``window_by_mask_builder``: an attention class that calls its attention function without
  ``sliding_window=`` while its modeling module builds sliding-window masks or the class
  keeps a window, so the window lives only in HF's mask builders (Qwen2-MoE, PhiMoE);
- ``model_built_mask``: an attention class that hands its attention function a mask it
  built (not the ``attention_mask`` it was given: Doge's learned dynamic mask), modifies
  the given mask in place, or passes a bias or layout tensor under another keyword
  (``position_bias=``, ``sinks=``, ``cu_seq_lens_q=``, ...).

Each hit gets how treepack handles it (:func:`handling`), or None: unhandled. Only modules
that define a causal-LM class count (treepack runs nothing else); the tests fail on an
unhandled hit there that check_model does not refuse, so a transformers upgrade that brings
a new one surfaces it. The source is read, never imported; only classes whose text holds
an attention call are parsed (all ~540 modules in ~3 s of CPU).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from treepack.trainer.hf.attention import REFUSED_KEYWORDS

PATTERNS = {
    "kwargs_dropped": "a decoder layer calls its attention without **kwargs",
    "window_by_mask_builder": "a sliding window applied only through HF's mask builders",
    "model_built_mask": "a mask or bias built inside attention",
}

# Attention classes of vision towers: not scanned. A module's causal-LM class is its text
# model only (the tests check it on Qwen3.5, whose vision attention passes its own cu_seqlens).
_VISION = re.compile(r"Vision|Visual")

ATTN_ATTRS = frozenset({"self_attn", "attn", "attention", "self_attention"})

# Keywords of an attention-function call that tree attention reads or that carry no
# token-mixing information of their own; any other keyword is a pattern-3 hit.
KNOWN_KEYWORDS = frozenset(
    {
        "attention_mask",  # checked by identity at run time (only the mask treepack built passes)
        "scaling",
        "softcap",
        "sliding_window",
        "s_aux",  # applied by tree attention
        "dropout",  # refused unless 0 (check_model while training; tree attention at run time)
        "indices",  # DSA top-k: refused by tree attention unless the layer is patched
        "position_ids",
        "output_attentions",
        "deterministic",
        "query",
        "key",
        "value",
        "is_causal",  # non-causal attention is refused by check_model
    }
)

# How each handled hit is handled (docs/models.md wording).
HANDLED = {
    "kwargs_dropped": (
        "the packed context reaches attention through a context variable, and HF's checkpoint replay runs inside it"
    ),
    "window_by_mask_builder": (
        "tree attention reads the window from config.sliding_window (per layer through layer_types), "
        "as the mask builders do"
    ),
    "model_built_mask": "checked at run time: tree attention refuses any mask but the one packed_forward built",
}


@dataclass(frozen=True, slots=True)
class Hit:
    """One pattern hit: ``module`` is the modeling package (``stablelm``), ``cls`` the class."""

    pattern: str
    module: str
    cls: str
    detail: str = ""
    handled: str | None = None


def _models_root() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


_CLASS_START = re.compile(r"^(?:@[^\n]*\n)*class \w+", re.M)
_CLASS_NAME = re.compile(r"^class (\w+)\(", re.M)
_TOP_LEVEL = re.compile(r"^(?:class |def |@|[A-Za-z_])", re.M)


def _class_chunks(src: str) -> list[str]:
    """Each top-level class of ``src`` whose text may hold an attention call, as its own source."""
    out = []
    for m in _CLASS_START.finditer(src):
        header_end = src.find(":\n", m.end())
        nxt = _TOP_LEVEL.search(src, header_end + 2) if header_end >= 0 else None
        chunk = src[m.start() : nxt.start() if nxt else len(src)]
        if "attention_interface(" in chunk or any(f"self.{a}(" in chunk for a in ATTN_ATTRS):
            out.append(chunk)
    return out


def _parse_classes(src: str) -> list[ast.ClassDef]:
    classes = []
    for chunk in _class_chunks(src):
        try:
            tree = ast.parse(chunk)
        except SyntaxError:  # an odd layout: parse the whole module instead
            return [n for n in ast.parse(src).body if isinstance(n, ast.ClassDef)]
        classes.extend(n for n in tree.body if isinstance(n, ast.ClassDef))
    return classes


def _self_call(c: ast.Call, attrs: frozenset[str]) -> bool:
    f = c.func
    return isinstance(f, ast.Attribute) and f.attr in attrs and isinstance(f.value, ast.Name) and f.value.id == "self"


def _own_checkpoint(src: str) -> bool:
    """The module calls torch's checkpoint itself (not through HF's ``_gradient_checkpointing_func``)."""
    return "checkpoint(" in src and bool(
        re.search(r"(?<![\w.])checkpoint\(|torch\.utils\.checkpoint\.checkpoint\(", src)
    )


def scan_source(src: str, module: str, config_src: str = "") -> list[Hit]:
    """Every pattern hit in one modeling module's source, each with its handling.

    Args:
        src: the ``modeling_*.py`` source.
        module: its package name (``stablelm``), used in the hits.
        config_src: the package's ``configuration_*.py`` source (where the window field lives).
    """
    hits: list[Hit] = []
    builds_windows = "create_sliding_window_causal_mask" in src
    config_window = "sliding_window" in config_src
    own_checkpoint = _own_checkpoint(src)
    for cls in _parse_classes(src):
        if _VISION.search(cls.name):
            continue  # a vision tower: no causal-LM class builds one (they are text only)
        fns = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
        fwd = fns.get("forward")
        if fwd is None:
            continue
        nodes = list(ast.walk(fwd))
        calls = [c for c in nodes if isinstance(c, ast.Call)]
        dropped = [c for c in calls if _self_call(c, ATTN_ATTRS) and not any(k.arg is None for k in c.keywords)]
        if dropped:
            how = None if own_checkpoint else HANDLED["kwargs_dropped"]
            hits.append(Hit("kwargs_dropped", module, cls.name, f"self.{dropped[0].func.attr}(...)", how))
        interface = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "attention_interface"]
        if not interface:
            continue
        hits.extend(_window_hits(cls.name, fns, interface, module, builds_windows, config_window))
        hits.extend(_mask_hits(cls.name, fwd, nodes, interface, module))
    return hits


def _window_hits(
    name: str, fns: dict, interface: list[ast.Call], module: str, builds_windows: bool, config_window: bool
) -> list[Hit]:
    keeps_window = "__init__" in fns and any(
        isinstance(t, ast.Attribute) and t.attr == "sliding_window"
        for a in ast.walk(fns["__init__"])
        if isinstance(a, ast.Assign)
        for t in a.targets
    )
    if not (builds_windows or keeps_window):
        return []
    passes = any(
        k.arg == "sliding_window" or k.arg is None and _names_window(k.value) for c in interface for k in c.keywords
    )
    if passes:
        return []
    # mask_builder_window reads config.sliding_window where the module builds sliding masks.
    how = HANDLED["window_by_mask_builder"] if builds_windows and config_window else None
    why = "builds sliding-window masks" if builds_windows else "keeps self.sliding_window"
    return [Hit("window_by_mask_builder", module, name, why, how)]


def _mask_hits(
    name: str, fwd: ast.FunctionDef, nodes: list[ast.AST], interface: list[ast.Call], module: str
) -> list[Hit]:
    params = {a.arg for a in fwd.args.args + fwd.args.kwonlyargs}
    reassigned = {
        t.id
        for n in nodes
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for t in _targets(n)
        if isinstance(t, ast.Name)
    }
    in_place = {
        n.func.value.id
        for n in nodes
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr.endswith("_")
        and not n.func.attr.startswith("_")
        and isinstance(n.func.value, ast.Name)
    } | {n.target.id for n in nodes if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)}
    hits = []
    for c in interface:
        mask = next((k.value for k in c.keywords if k.arg == "attention_mask"), c.args[4] if len(c.args) > 4 else None)
        if isinstance(mask, ast.Name) and mask.id in params and mask.id in in_place:
            hits.append(Hit("model_built_mask", module, name, f"modifies {mask.id} in place", None))
        elif (
            mask is not None
            and not _is_none(mask)
            and not (isinstance(mask, ast.Name) and mask.id in params and mask.id not in reassigned)
        ):
            hits.append(
                Hit(
                    "model_built_mask", module, name, f"attention_mask={ast.unparse(mask)}", HANDLED["model_built_mask"]
                )
            )
        for k in c.keywords:
            if k.arg is not None and k.arg not in KNOWN_KEYWORDS and not _is_none(k.value):
                how = f"refused at run time: tree attention refuses {k.arg}=" if k.arg in REFUSED_KEYWORDS else None
                hits.append(Hit("model_built_mask", module, name, f"{k.arg}=", how))
    return list(dict.fromkeys(hits))


def _targets(n: ast.AST) -> list[ast.AST]:
    return n.targets if isinstance(n, ast.Assign) else [n.target]


def _names_window(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == "sliding_window" for n in ast.walk(node))


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


@functools.cache
def causal_lm_modules() -> frozenset[str]:
    """The modeling packages that define a class of transformers' causal-LM mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    out = set()
    for path in _models_root().glob("*/modeling_*.py"):
        if names & set(_CLASS_NAME.findall(path.read_text(encoding="utf-8"))):
            out.add(path.parent.name)
    return frozenset(out)


@functools.cache
def scan_transformers() -> tuple[Hit, ...]:
    """Every hit in the installed transformers' ``models/*/modeling_*.py``."""
    hits: list[Hit] = []
    for path in sorted(_models_root().glob("*/modeling_*.py")):
        cfg = next(path.parent.glob("configuration_*.py"), None)
        hits.extend(
            scan_source(
                path.read_text(encoding="utf-8"), path.parent.name, cfg.read_text(encoding="utf-8") if cfg else ""
            )
        )
    return tuple(hits)


def unhandled(hits: tuple[Hit, ...] | list[Hit], modules: frozenset[str] | None = None) -> list[Hit]:
    """The hits with no handling in causal-LM modules (``modules``; default: :func:`causal_lm_modules`)."""
    modules = causal_lm_modules() if modules is None else modules
    return [h for h in hits if h.module in modules and h.handled is None]


def render_summary(hits: tuple[Hit, ...]) -> list[str]:
    """docs/models.md lines: per pattern and handling, the hits in causal-LM modules and the modules."""
    lm = causal_lm_modules()
    files = len(list(_models_root().glob("*/modeling_*.py")))
    mine = [h for h in hits if h.module in lm]
    lines = [
        f"Static scan (`python benchmarks/modeling_scan.py`): {files} modeling modules of this transformers read, "
        f"{len(lm)} of them define a causal-LM class; {len(mine)} hits there "
        "(vision-tower classes are not scanned: no causal-LM class builds one). "
        "Patterns: "
        + "; ".join(f"**{k}**: {v}" for k, v in PATTERNS.items())
        + ". A hit with no handling fails the tests.",
        "",
        "| pattern | hits | how treepack handles them | modules |",
        "|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[Hit]] = {}
    for h in mine:
        groups.setdefault((h.pattern, h.handled or "UNHANDLED"), []).append(h)
    for (pattern, how), hs in sorted(groups.items()):
        mods = ", ".join(f"`{m}`" for m in sorted({h.module for h in hs}))
        lines.append(f"| {pattern} | {len(hs)} | {how} | {mods} |")
    return lines


def main() -> int:
    lm = causal_lm_modules()
    for h in scan_transformers():
        where = "causal LM" if h.module in lm else "not a causal LM"
        print(h.pattern, h.module, h.cls, h.detail, where, h.handled or "UNHANDLED", sep="\t")
    return 0


if __name__ == "__main__":
    sys.exit(main())

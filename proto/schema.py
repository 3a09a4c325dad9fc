"""The JSON Schema files of the wire messages, kept next to this module.

``python -m treepack.proto.schema --write`` regenerates them from the pydantic models;
``--check`` exits 1 when a file is stale (a test does the same). Other languages' clients
can validate against these files; the models stay the source of truth.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel

from treepack.proto import messages as m

__all__ = ["SCHEMAS", "schema_text", "write_schemas", "stale_schemas", "main"]

HERE = Path(__file__).resolve().parent

SCHEMAS: dict[str, type[BaseModel]] = {
    "pack_request": m.PackRequest,
    "pack_response": m.PackResponse,
    "plan": m.PlanMessage,
    "batch_shape": m.BatchShapeMessage,
    "whatif_request": m.WhatIfRequest,
    "whatif_response": m.WhatIfResponse,
    "history_summary": m.HistorySummary,
    "error": m.ErrorBody,
}


def schema_text(name: str) -> str:
    """The file content for ``name`` (stable: sorted keys, 2-space indent, final newline)."""
    doc = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://treepack.dev/proto/{name}.schema.json",
        **SCHEMAS[name].model_json_schema(),
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def path_of(name: str, folder: Path = HERE) -> Path:
    return folder / f"{name}.schema.json"


def write_schemas(folder: Path = HERE) -> list[Path]:
    """Write every schema file; returns their paths."""
    out = []
    for name in SCHEMAS:
        p = path_of(name, folder)
        p.write_text(schema_text(name), encoding="utf-8")
        out.append(p)
    return out


def stale_schemas(folder: Path = HERE) -> list[str]:
    """Names whose file is missing or differs from the models."""
    return [
        n
        for n in SCHEMAS
        if not path_of(n, folder).exists() or path_of(n, folder).read_text(encoding="utf-8") != schema_text(n)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m treepack.proto.schema", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="regenerate the files")
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = ap.parse_args(argv)
    if args.write:
        for p in write_schemas():
            print(p)
        return 0
    stale = stale_schemas()
    if stale:
        print(
            "stale JSON Schema files: " + ", ".join(stale) + " (run python -m treepack.proto.schema --write)",
            file=sys.stderr,
        )
        return 1
    print("JSON Schema files are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())

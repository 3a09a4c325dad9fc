"""The ``treepack`` command line (``treepack.service.cli:main``; ``python -m treepack.service.cli``).

- ``treepack demo [--groups N] [--png PATH]`` — the golden example and a realistic
  multi-task batch on the embedded planner: rows, tokens, savings, bound and timings per
  placement (:mod:`.demo`).
- ``treepack plan FILE --seq-len N [--placement P] [--min-shared-len K] [--json] ...`` (a flag
  per planner option) — plan a JSONL batch (one sequence per line: ``{"tokens": [...], "trainable": [0/1, ...]}`` or
  ``{"tokens": [...], "prompt_len": n}``, optional ``"group"``; ``-`` reads stdin)
  (:mod:`.plan`).
- ``treepack bench [--full] [--repeats K] [--json PATH]`` — the planning benchmark
  (:mod:`.bench`).
- ``treepack check --model NAME_OR_PATH [--batch FILE] [--autocast bf16] [--mode train] ...``
  — the parity report of a model on a batch: packed vs each sequence alone against the
  model's own noise floor (needs the ``trainer`` extra; :mod:`.check`).
- ``treepack serve ...`` — the HTTP sidecar (needs the ``service`` extra;
  :mod:`treepack.service.serve`).

Tables and the drawing of the rows: :mod:`.report`. Synthetic batches for the demo, the
benchmarks and the tests: :mod:`.workloads`. The parser: :mod:`.command`.

Exit codes: 0 ok, 2 bad input or usage (the message names the line and the rule).
"""

from treepack.service.cli.command import build_parser, main

__all__ = ["main", "build_parser"]

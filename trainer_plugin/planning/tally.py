"""What packing did over a training run, told to the person running it: :class:`PackingTally`.

The drop-ins (TRL's trainers, verl's engine) keep one tally each. It says, once, that the
first packed step verifies packing on the model (the probe runs packed and unpacked passes:
seconds to minutes on a large model, with nothing else printed), and how long that took;
it adds up every plan (rows, tokens, planning time) and gives the end-of-training summary.
Lines go to ``print`` on the main process (the caller decides which process that is).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["PackingTally"]


@dataclass(slots=True, kw_only=True)
class PackingTally:
    """Running totals of a run's plans (one per trainer; mutable).

    Attributes:
        plans: plans made (a TRL GRPO step plans its batch once per log-probability pass).
        rows: rows over all plans.
        unpacked_tokens: tokens the plans' sequences hold, each counted in full.
        packed_tokens: tokens laid out in their rows (what the forward computes).
        plan_ms: planning time over all plans, ms.
        verify_s: seconds the first packed step spent verifying packing (None before it).
        say: where lines go (``print`` by default; None keeps quiet).
    """

    plans: int = 0
    rows: int = 0
    unpacked_tokens: int = 0
    packed_tokens: int = 0
    plan_ms: float = 0.0
    verify_s: float | None = None
    say: Callable[[str], Any] | None = print

    def add(self, stats: Any, plan_ms: float) -> None:
        """Count one plan.

        Args:
            stats: its :class:`~treepack.proto.plan.PlanStats` (``rows``, ``unpacked_tokens``,
                ``packed_tokens``).
            plan_ms: the time it took to plan, ms.
        """
        self.plans += 1
        self.rows += int(stats.rows)
        self.unpacked_tokens += int(stats.unpacked_tokens)
        self.packed_tokens += int(stats.packed_tokens)
        self.plan_ms += float(plan_ms)

    @contextmanager
    def first_step(self, model: Any, backend: str, *, verify: bool = True) -> Iterator[None]:
        """Around the model's admission: the first time, say that packing is being verified
        on it and, once done, how long that took; later calls say nothing.

        Args:
            model: the unwrapped model (its class is named).
            backend: the tree attention backend.
            verify: whether the admission runs the probe (else it only checks the model).
        """
        if self.verify_s is not None:
            yield
            return
        what = "verifying" if verify else "checking"
        self._say(f"treepack: {what} packing on this model ({type(model).__name__}, {backend})...")
        t0 = time.perf_counter()
        yield
        self.verify_s = time.perf_counter() - t0
        self._say(f"treepack: {what} packing on this model... done in {self.verify_s:.1f} s")

    def summary(self) -> str:
        """One line: batches, rows, tokens computed of the unpacked total (saved %), planning time."""
        if self.plans == 0:
            return "treepack: nothing was packed"
        saved = 1.0 - self.packed_tokens / self.unpacked_tokens if self.unpacked_tokens else 0.0
        return (
            f"treepack: {self.plans} packed batches in {self.rows} rows computed {self.packed_tokens:,} of "
            f"{self.unpacked_tokens:,} tokens ({saved:.1%} saved, {self.unpacked_tokens - self.packed_tokens:,} "
            f"tokens not computed); planning took {self.plan_ms / 1e3:.2f} s ({self.plan_ms / self.plans:.1f} ms "
            "per batch)"
        )

    def report(self) -> None:
        """Say :meth:`summary`."""
        self._say(self.summary())

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(line)

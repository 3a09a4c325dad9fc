"""Losses on packed rows: SFT NLL, GRPO/PPO-clip, CISPO (SPEC 7).

Every loss is a weighted sum over **scored entries** (sequence s, token p trainable, p >= 1)
and equals the same loss computed on the unpacked sequences, term by term: each entry
reads the log-probability of the row position that predicts its token
(``lp[score_flat[e]]``, a gather, so autograd sums the gradients of a shared position's
sharers) and combines it with **its own sequence's** inputs. A position shared by several
sequences (generalized sharing mode, SPEC 2) therefore contributes once per sharer, with
each sharer's own weight, advantage, behaviour and reference log-probability: nothing is
merged, so PPO-clip (not linear in the advantage, and whose ratio depends on each sharer's
own ``old_logprobs``) is exact as well as the linear losses. (A behaviour log-probability
of a shared position may well differ among its sharers: they were sampled by different
inference runs, engines or policy versions.)

Normalizations (the weight ``w`` of an entry of sequence s, counts over **all**
sequences of the plan, every rank included, so per-rank losses add up to the global loss):

- ``token``: 1 / (scored entries of the batch) — token mean (DAPO);
- ``sequence``: 1 / (n_s * sequences with entries) — mean of per-sequence token means (GRPO);
- ``group``: 1 / (n_g * groups with entries), n_g the entries of s's group — mean of
  per-group token means;
- ``sum``: 1; a number c: 1 / c (a constant denominator, Dr. GRPO).

Per-entry inputs (``advantages``, ``weights``, ``old_logprobs``, ``ref_logprobs``) are: a
payload name (target-aligned, see :func:`~treepack.trainer.data.materialize`: read per
scored entry, i.e. per (position, sharer)), a [S] tensor (one value per sequence, e.g.
GRPO advantages), a [K, L] packed tensor (one value per position: the same for every
sharer, e.g. log-probabilities computed on these packed rows), or a number.

``naive_*`` references compute the same losses from unpacked per-sequence log-probabilities
with plain loops.

Rooms: :mod:`~treepack.trainer.losses.entries` (the normalization weights and per-entry
inputs every loss reads), :mod:`~treepack.trainer.losses.packed` (the losses on packed
rows), :mod:`~treepack.trainer.losses.naive` (the loop-based references).
"""

from treepack.trainer.losses.entries import NORMALIZATIONS, entry_logprobs, entry_values, entry_weights, position_sum
from treepack.trainer.losses.naive import naive_cispo_loss, naive_entry_weights, naive_ppo_clip_loss, naive_sft_loss
from treepack.trainer.losses.packed import cispo_loss, ppo_clip_loss, sft_loss

__all__ = [
    "NORMALIZATIONS",
    "entry_weights",
    "entry_values",
    "position_sum",
    "entry_logprobs",
    "sft_loss",
    "ppo_clip_loss",
    "cispo_loss",
    "naive_entry_weights",
    "naive_sft_loss",
    "naive_ppo_clip_loss",
    "naive_cispo_loss",
]

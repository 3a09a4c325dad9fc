"""Deep random prefix trees for the GDN and sparse-attention oracle tests.

:func:`tree_sequences` grows random trees (distinct first tokens among siblings, so every
node is a real branch point) whose runs mix very short lengths (1-3, shorter than a conv
window), medium ones and runs over 64 tokens (crossing chunk boundaries); every
root-to-leaf path is a sequence. :func:`tree_plan` plans them with a small
``min_shared_len`` and checks that the plan has the shapes the oracle must cover, so a test
cannot pass vacuously on a flat plan. :func:`scored_loss_pair` and :func:`param_grads` give
the two sides of the gradient oracle; tolerances live in :mod:`helpers.tolerance`.
"""

from __future__ import annotations

import numpy as np

from treepack.proto.batch import PackInput
from treepack.proto.options import PlanOptions
from treepack.service.planner import plan_batch, validate_plan
from treepack.service.planner.api import PlanResult, plan_request


def plan_result(sequences, *, trainable=None, groups=None, keys=None, **options) -> PlanResult:
    """``plan_batch`` with the batch and tree beside the plan (what the history records from)."""
    return plan_request(
        PackInput(sequences=sequences, trainable=trainable, groups=groups, keys=keys, options=PlanOptions(**options))
    )


RUN_LENGTHS = np.array([1, 2, 3, 5, 8, 13, 21, 40, 70, 90])
RUN_WEIGHTS = np.array([3, 3, 3, 3, 2, 2, 2, 2, 1, 1], dtype=float)


def tree_sequences(
    seed: int, *, trees: int = 3, depth: int = 4, max_len: int = 200, vocab: int = 97
) -> list[np.ndarray]:
    """Sequences that are the root-to-leaf paths of ``trees`` random trees (module docstring)."""
    rng = np.random.default_rng(seed)
    seqs: list[np.ndarray] = []

    def grow(prefix: list[int], d: int, first: int) -> None:
        room = max_len - len(prefix)
        n = int(min(rng.choice(RUN_LENGTHS, p=RUN_WEIGHTS / RUN_WEIGHTS.sum()), room))
        path = prefix + [first] + rng.integers(0, vocab, size=max(n - 1, 0)).tolist()
        if d == depth or len(path) >= max_len - 1:
            kids = 0
        else:
            kids = int(rng.choice([2, 3] if d == 0 else [0, 1, 2, 2, 3]))
        if kids == 0:
            seqs.append(np.array(path, dtype=np.uint32))
            return
        for tok in rng.permutation(vocab)[:kids].tolist():
            grow(path, d + 1, tok)

    for tok in rng.permutation(vocab)[:trees].tolist():
        grow([], 0, tok)
    return seqs


def tree_plan(seed: int, *, seq_len: int = 256, min_shared_len: int = 2, conv_width: int = 4, tail: int = 0, **kw):
    """(sequences, trainable, plan) with the oracle's required shapes; the plan is validated.

    Requires: depth >= 3, a row holding several trees, a segment crossing a 64-token chunk
    boundary of its sequence, and a segment shorter than W-1 that has children (so some
    conv context spans several ancestors).

    Args:
        tail: when > 0, the last ``tail`` tokens of every sequence are trainable
            (``trainable`` is then a prompt length per sequence, else None).
    """
    for s in range(seed, seed + 50):
        seqs = tree_sequences(s, **kw)
        if max(len(x) for x in seqs) > seq_len:
            continue
        trainable = [max(1, len(x) - tail) for x in seqs] if tail else None
        plan = plan_batch(
            seqs, seq_len=seq_len, min_shared_len=min_shared_len, conv_width=conv_width, trainable=trainable
        )
        validate_plan(plan, seqs, trainable=trainable)
        if tree_features(plan, conv_width)["ok"]:
            return seqs, trainable, plan
    raise AssertionError(f"no seed in [{seed}, {seed + 50}) gave a plan with every required feature")


def tree_features(plan, conv_width: int) -> dict:
    """Which oracle-relevant shapes the plan has (and ``ok`` when it has them all)."""
    seg = plan.segments
    roots_per_row = np.bincount(seg.row[seg.parent < 0], minlength=plan.num_rows)
    has_child = np.zeros(seg.num_segments, dtype=bool)
    has_child[seg.parent[seg.parent >= 0]] = True
    first, last = seg.seq_start // 64, (seg.seq_start + seg.length - 1) // 64
    f = {
        "depth": int(seg.depth.max(initial=0)),
        "several_trees_in_a_row": bool((roots_per_row >= 2).any()),
        "crosses_chunk": bool((first != last).any()),
        "short_inner": bool((has_child & (seg.length < conv_width - 1)).any()),
    }
    f["ok"] = f["depth"] >= 3 and f["several_trees_in_a_row"] and f["crosses_chunk"] and f["short_inner"]
    return f


def scored_loss_pair(seqs, trainable, unpacked, batch, packed_lp, seed: int = 0):
    """(packed loss, unpacked loss): one set of random weights on every scored position.

    Args:
        seqs, trainable: the planned sequences and their prompt lengths.
        unpacked: per sequence [len, vocab] logprobs of the sequence run alone.
        batch: the PackedBatch; packed_lp: its [rows, L, vocab] logprobs.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights = [torch.rand(len(s), generator=gen) for s in seqs]
    loss_ref = 0.0
    for s, (x, lp) in enumerate(zip(seqs, unpacked)):
        tgt = torch.as_tensor(x, dtype=torch.int64)
        pos = torch.arange(max(trainable[s] - 1, 0), len(x) - 1)  # scored: the next token is trainable
        loss_ref = loss_ref + (lp[pos, tgt[pos + 1]] * weights[s][pos]).sum()
    entry = packed_lp.reshape(-1, packed_lp.shape[-1])[batch.score_flat].gather(1, batch.score_target[:, None])[:, 0]
    w = torch.stack([weights[int(s)][int(p) - 1] for s, p in zip(batch.score_seq, batch.score_pos)])
    return (entry * w).sum(), loss_ref


def param_grads(model, loss, loss_ref) -> tuple[dict, dict]:
    """(gradients of ``loss``, gradients of ``loss_ref``) by parameter name.

    A parameter the reference loss does not reach must get no gradient from ``loss``
    either (checked here, exactly); it is left out of both dicts.
    """
    import torch

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    g_ref = torch.autograd.grad(loss_ref, params, allow_unused=True)
    g = torch.autograd.grad(loss, params, allow_unused=True)
    got, want = {}, {}
    for (name, p), a, b in zip(named, g, g_ref):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0, f"{name}: a gradient where the reference has none"
            continue
        got[name], want[name] = (torch.zeros_like(p) if a is None else a), b
    return got, want


def per_sequence_logprobs(batch, lp) -> list:
    """Each sequence's [len, vocab] rows of packed [rows, L, vocab] logprobs, in order."""
    return [lp[batch.locate(s)] for s in range(batch.plan.num_sequences)]

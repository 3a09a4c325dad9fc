"""All-gather CP attention's masks, in one process: every rank's view built from the plan.

The collectives are not needed to check the masks: the gathered keys of a CP group are the
padded row's keys at ``kpos`` (every rank's shard positions in rank order), so each rank's
all-gather attention can be computed here from whole-row tensors. Checked against the whole
padded row's dense mask (the reference) and, for flash varlen (the pure-torch kernel) and
flex (forward), against SDPA over that mask; the multi-process oracle is
``tests/e2e/test_trainer_cp.py``.
"""

from __future__ import annotations

import pytest
import torch

from treepack.trainer import materialize
from treepack.trainer.kernels.attention import _flash, _flex, _sdpa, naive_varlen_attention
from treepack.trainer.kernels.cp_attention import cp_block_mask, cp_dense_mask, cp_varlen_meta, padded_rows
from treepack.trainer.kernels.masks import dense_mask

from helpers.trainer_cases import mixed_batch, plan_of

VARIANTS = [dict(), dict(sliding_window=5), dict(chunk_size=8), dict(sliding_window=7, chunk_size=16)]


def _views(cp: int, cp_attention: str):
    c = mixed_batch()
    plan = plan_of(c, cp_size=cp, cp_attention=cp_attention)
    full = materialize(plan_of(c), c["sequences"], advise=False)
    rows = full.rows
    pos = torch.from_numpy(plan.ranks.shard_positions(rows))  # [P, K, Ls]
    se, pid = padded_rows(full.subtree_end, full.position_ids, plan.ranks.padded_len)
    kpos = pos.permute(1, 0, 2).reshape(len(rows), -1)
    return full, plan, pos, kpos, se, pid


@pytest.mark.parametrize("cp,cp_attention", [(4, "allgather"), (3, "auto")])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "plain")
def test_shard_mask_is_the_row_mask_at_its_positions(cp, cp_attention, variant):
    full, plan, pos, kpos, se, pid = _views(cp, cp_attention)
    ref = dense_mask(se, pid, **variant)[:, 0]  # [K, Lp, Lp]
    for r in range(cp):
        got = cp_dense_mask(se, pid, pos[r], kpos, **variant)[:, 0]
        want = torch.stack([ref[k][pos[r, k]][:, kpos[k]] for k in range(ref.shape[0])])
        assert torch.equal(got, want)
        assert got.any(-1).all(), "a query sees no key (padding must see itself)"
    # Every rank's queries together see exactly the row's visible pairs (nothing lost or doubled).
    assert sum(int(cp_dense_mask(se, pid, pos[r], kpos, **variant).sum()) for r in range(cp)) == int(ref.sum())


def _attend(backend, q, kg, vg, k, v, masks, **kw):
    sinks = kw.pop("sinks", None)
    scale = q.shape[-1] ** -0.5
    if backend == "sdpa":
        return _sdpa(q, kg, vg, masks["dense"], scale, None, sinks)
    if backend == "flex":
        return _flex(q, kg, vg, masks["block"], scale, None, False, sinks)
    return _flash(
        q,
        kg,
        vg,
        masks["varlen"],
        scale,
        kw.get("sliding_window"),
        None,
        naive_varlen_attention,
        sinks,
        k_self=k,
        v_self=v,
    )


@pytest.mark.parametrize("cp,cp_attention", [(2, "allgather"), (4, "allgather")])
@pytest.mark.parametrize(
    "variant",
    [dict(), dict(sliding_window=7, chunk_size=16), dict(sinks=True)],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "plain",
)
def test_varlen_and_flex_match_sdpa_on_every_shard(cp, cp_attention, variant):
    full, plan, pos, kpos, se, pid = _views(cp, cp_attention)
    K, Lp = se.shape
    H, Hkv, D = 4, 2, 8
    g = torch.Generator().manual_seed(cp)
    qw, kw_, vw = (torch.randn(K, h, Lp, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    sinks = torch.randn(H, generator=g, dtype=torch.float64) if variant.get("sinks") else None
    mask_kw = {k: v for k, v in variant.items() if k != "sinks"}
    take = lambda x, p: x.gather(2, p[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))  # noqa: E731
    kg, vg = take(kw_, kpos), take(vw, kpos)
    whole = full.varlen_meta(chunk_size=mask_kw.get("chunk_size"))
    for r in range(cp):
        q, k, v = take(qw, pos[r]), take(kw_, pos[r]), take(vw, pos[r])
        masks = {
            "dense": cp_dense_mask(se, pid, pos[r], kpos, **mask_kw),
            "block": cp_block_mask(se, pid, pos[r], kpos, **mask_kw),
            "varlen": cp_varlen_meta(whole, plan.seq_len, pos[r].numpy(), kpos.numpy()),
        }
        ref = _attend("sdpa", q, kg, vg, k, v, masks, sinks=sinks, **mask_kw)
        assert torch.isfinite(ref).all()
        flash = _attend("flash", q, kg, vg, k, v, masks, sinks=sinks, **mask_kw)
        torch.testing.assert_close(flash, ref, atol=1e-6, rtol=1e-6)  # the varlen reference softmaxes in float32
        flex = _attend(
            "flex",
            q.float(),
            kg.float(),
            vg.float(),
            k.float(),
            v.float(),
            masks,
            sinks=None if sinks is None else sinks.float(),
            **mask_kw,
        )
        torch.testing.assert_close(flex.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_shard_without_remote_keys_differs():
    """Negative control for the test above: dropping the other ranks' keys from the varlen
    metadata's key set changes the output, so the comparison can fail."""
    full, plan, pos, kpos, se, pid = _views(2, "allgather")
    own = pos[1]
    m_all = cp_dense_mask(se, pid, own, kpos)
    m_own = cp_dense_mask(se, pid, own, own)
    assert int(m_all.sum()) > int(m_own.sum()), "rank 1 sees no key of rank 0: the control shows nothing"

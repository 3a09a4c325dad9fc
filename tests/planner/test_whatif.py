"""What-if: shapes rebuild the recorded tree, and sampled compositions predict /v1/pack's rows."""

from __future__ import annotations

import dataclasses

import httpx
import msgpack
import numpy as np
import pytest

from treepack.proto.batch import PackInput, normalize_batch
from treepack.proto.batch_wire import encode_pack_request
from treepack.proto.codec import encode_body
from treepack.proto.errors import CapacityError, RequestError
from treepack.proto.shape_wire import shape_to_wire
from treepack.proto.whatif import Composition
from treepack.service import Settings, create_app
from treepack.service.cli.workloads import agentic, curriculum, distillation, golden_example
from treepack.service.planner import build_tree, plan_batch, validate_plan
from treepack.service.planner.fingerprint import shape_of
from treepack.service.planner.whatif import build_pool, sample_groups, synthesize, whatif

from helpers.trees import plan_result

TREE_FIELDS = ("parent", "start", "length", "sharers", "source", "depth", "leaf_of", "path_ptr", "path_nodes")


def _keyed():
    rng = np.random.default_rng(1)
    base = rng.integers(0, 100, 200)
    seqs = [np.concatenate([base, rng.integers(0, 100, 50)]) for _ in range(6)]
    keys = [
        np.where(np.arange(250) < 120, 5, 5 + (i % 2)).astype(np.uint64) for i in range(6)
    ]  # keys split the prefix at 120
    return dict(sequences=seqs, keys=keys, trainable=[230] * 6, groups=[0, 0, 0, 1, 1, 1], seq_len=1024)


def _cases():
    for w in (golden_example(), curriculum(16), agentic(6), distillation(6)):
        yield w.name, dict(**w.plan_kwargs()), w.tags, 64
    yield "keys", _keyed(), None, 16
    yield "curriculum-msl-300", dict(**curriculum(16).plan_kwargs()), None, 300


def _shape(kw, tags, msl):
    batch = normalize_batch(
        kw["sequences"],
        seq_len=kw["seq_len"],
        trainable=kw.get("trainable"),
        groups=kw.get("groups"),
        keys=kw.get("keys"),
    )
    result = plan_result(**kw, min_shared_len=msl)
    return shape_of(batch, result.tree, seq_len=kw["seq_len"], tags=tags), result.plan, batch


@pytest.mark.parametrize("name,kw,tags,msl", list(_cases()), ids=[c[0] for c in _cases()])
def test_shapes_rebuild_the_recorded_tree_and_plan(name, kw, tags, msl):
    shape, plan, batch = _shape(kw, tags, msl)
    assert np.array_equal(shape.lens, batch.lens)
    pool = build_pool([shape])
    made = synthesize(pool, np.arange(pool.num_groups))
    again = normalize_batch(
        made["sequences"], seq_len=kw["seq_len"], trainable=made["trainable"], groups=made["groups"]
    )
    t1, t2 = build_tree(batch, msl), build_tree(again, msl)
    for f in TREE_FIELDS:
        assert np.array_equal(getattr(t1, f), getattr(t2, f)), f
    replan = plan_batch(**made, seq_len=kw["seq_len"], min_shared_len=msl)
    validate_plan(replan, made["sequences"], trainable=made["trainable"])
    assert np.array_equal(replan.row_of, plan.row_of) and replan.stats.packed_tokens == plan.stats.packed_tokens


def test_a_shape_without_node_boundaries_would_not_match():
    # Negative control for the test above: the tree comes from the hashed runs, so a shape
    # whose shared runs lost their common hash rebuilds a tree with no sharing at all.
    kw = dict(**curriculum(6).plan_kwargs())
    shape, plan, _ = _shape(kw, None, 64)
    salted = dataclasses.replace(
        shape,
        run_hash=np.where(
            shape.run_hash > 0, shape.run_hash ^ np.arange(shape.run_hash.shape[0], dtype=np.uint64), 0
        ).astype(np.uint64),
    )
    pool = build_pool([salted])
    made = synthesize(pool, np.arange(pool.num_groups))
    replan = plan_batch(**made, seq_len=kw["seq_len"])
    assert replan.stats.tree_tokens == replan.stats.unpacked_tokens > plan.stats.tree_tokens


def _split(w, per_batch):
    """The workload cut into batches of ``per_batch`` consecutive groups (one run's steps)."""
    grp = np.asarray(w.groups)
    out = []
    for k in range(int(grp.max()) // per_batch + 1):
        idx = np.flatnonzero((grp >= k * per_batch) & (grp < (k + 1) * per_batch)).tolist()
        if idx:
            out.append(
                dict(
                    sequences=[w.sequences[i] for i in idx],
                    trainable=[w.trainable[i] for i in idx],
                    groups=[w.groups[i] for i in idx],
                    tags=[w.tags[i] for i in idx],
                    seq_len=w.seq_len,
                )
            )
    return out


async def _record(c, batches):
    rows = []
    for b in batches:
        r = await c.post(
            "/v1/pack",
            content=encode_body(encode_pack_request(PackInput.of(**b)), "msgpack"),
            headers={"accept": "application/json"},
        )
        assert r.status_code == 200 and r.json()["recorded"]
        rows.append(r.json()["plan"]["num_rows"])
    return rows


async def _whatif(c, **body):
    r = await c.post(
        "/v1/whatif", content=encode_body({"version": 1, **body}, "msgpack"), headers={"accept": "application/msgpack"}
    )
    assert r.status_code == 200, r.text
    return msgpack.unpackb(r.content)


@pytest.fixture
def app():
    app = create_app(Settings(history_max_batches=100))
    yield app
    app.state.service.close()


async def test_whatif_mean_rows_within_5_percent_of_pack(app):
    # 12 steps of an agent RL run (8 tasks each, one system prompt + tool schema for all),
    # packed through /v1/pack, which records them; then: how many rows for 8 tasks?
    w = agentic(96, seq_len=32768, seed=1)
    batches = _split(w, 8)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        rows = await _record(c, batches)
        real = float(np.mean(rows))
        out = await _whatif(c, seq_len=32768, compositions=[{"groups": 8}], trials=40, seed=0, max_rows=int(max(rows)))
        res = out["results"][0]
        assert out["source"] == "history" and out["pool"]["batches"] == 12 and out["pool"]["groups"] == 96
        assert abs(res["rows"]["mean"] - real) <= 0.05 * real, (res["rows"], rows)
        assert res["rows"]["min"] <= res["rows"]["p50"] <= res["rows"]["p90"] <= res["rows"]["max"]
        assert res["p_rows_over"] == np.mean(np.asarray(res["row_counts"]) > max(rows))

        # Negative controls: the 5% band is tight next to what sharing is worth...
        flat = (await _whatif(c, seq_len=32768, compositions=[{"groups": 8}], trials=10, seed=0, placement="no_share"))[
            "results"
        ][0]
        assert flat["rows"]["mean"] > 1.5 * real
        # ...and the system prompt must keep matching across recorded batches by hash.
        shapes = app.state.service.store.shapes()
        salted = [
            shape_to_wire(
                dataclasses.replace(
                    s, run_hash=np.where(s.run_hash > 0, s.run_hash ^ np.uint64(i + 1), 0).astype(np.uint64)
                ),
                "msgpack",
            )
            for i, s in enumerate(shapes)
        ]
        # Without auto's repair pass: it is bounded by CPU time, so two runs agree trial for
        # trial only when neither spends its whole budget.
        same = dict(seq_len=32768, compositions=[{"groups": 8}], trials=40, seed=0, repair_ms=0)
        history = (await _whatif(c, **same))["results"][0]
        plain = (await _whatif(c, **same, shapes=[shape_to_wire(s, "msgpack") for s in shapes]))["results"][0]
        unmatched = (await _whatif(c, **same, shapes=salted))["results"][0]
    assert plain["row_counts"] == history["row_counts"]  # inline shapes == the history they came from
    assert unmatched["rows"]["mean"] > plain["rows"]["mean"]
    assert unmatched["packed_tokens"]["mean"] > plain["packed_tokens"]["mean"]


async def test_whatif_by_tag_for_each_real_batch_within_5_percent(app):
    # Multi-task GRPO: for every recorded batch, its own mix of tasks as a composition.
    w = curriculum(192, seq_len=16384, seed=1)
    batches = _split(w, 16)
    comps = []
    for b in batches:
        per_tag: dict[str, int] = {}
        for g in sorted(set(b["groups"])):
            t = b["tags"][b["groups"].index(g)]
            per_tag[t] = per_tag.get(t, 0) + 1
        comps.append({"by_tag": per_tag})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        rows = await _record(c, batches)
        out = await _whatif(c, seq_len=16384, compositions=comps, trials=8, seed=0)
    predicted = float(np.mean([r["rows"]["mean"] for r in out["results"]]))
    real = float(np.mean(rows))
    assert abs(predicted - real) <= 0.05 * real, (predicted, rows)
    assert [r["groups"] for r in out["results"]] == [16] * len(batches)


def _pool(n_groups=24):
    w = curriculum(n_groups)
    shape, _, _ = _shape(dict(**w.plan_kwargs()), w.tags, 64)
    return shape


def test_by_tag_draws_only_those_tags_and_in_recorded_order():
    shape = _pool()
    pool = build_pool([shape])
    rng = np.random.default_rng(0)
    for _ in range(5):
        units = sample_groups(pool, Composition(by_tag={"task0": 3, "task1": 1}), rng)
        assert sorted(pool.unit_tag[u] for u in units) == ["task0", "task0", "task0", "task1"]
        assert np.all(np.diff(units) > 0)
        made = synthesize(pool, units)
        assert made["groups"] == sorted(made["groups"])
        assert sum(len(s) for s in made["sequences"]) == int(
            sum(pool.lens[pool.unit_seqs[pool.unit_ptr[u] : pool.unit_ptr[u + 1]]].sum() for u in units)
        )


def test_seed_reproducibility_and_threshold():
    shape = _pool()
    a = whatif([shape], [Composition(groups=6)], seq_len=131072, trials=6, seed=7, max_rows=0)
    b = whatif([shape], [Composition(groups=6)], seq_len=131072, trials=6, seed=7, max_rows=0)
    c = whatif([shape], [Composition(groups=6)], seq_len=131072, trials=6, seed=8)
    assert np.array_equal(a[0].row_counts, b[0].row_counts) and a[0].packed_tokens == b[0].packed_tokens
    assert a[0].packed_tokens != c[0].packed_tokens
    assert a[0].p_rows_over == 1.0 and c[0].p_rows_over is None


def test_whatif_errors_name_the_field():
    shape = _pool(6)
    with pytest.raises(RequestError, match="asks for 7 groups, the pool holds 6") as e:
        whatif([shape], [Composition(groups=2), Composition(groups=7)], seq_len=131072)
    assert e.value.path == "$.compositions[1].groups"
    with pytest.raises(RequestError, match="tagged 'nope'") as e:
        whatif([shape], [Composition(by_tag={"nope": 1})], seq_len=131072)
    assert e.value.path == '$.compositions[0].by_tag["nope"]'
    with pytest.raises(CapacityError, match="longer than seq_len 100") as e:
        whatif([shape], [Composition(groups=1)], seq_len=100)
    assert e.value.path == "$.seq_len"
    with pytest.raises(RequestError, match="no recorded batches") as e:
        whatif([], [Composition(groups=1)], seq_len=100)
    res = whatif([shape], [Composition(groups=2)], seq_len=1000, on_overflow="truncate", trials=2)
    assert res[0].rows.max >= 1


async def test_history_batches_limits_the_pool(app):
    batches = _split(curriculum(12), 4)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        await _record(c, batches)
        out = await _whatif(c, seq_len=131072, compositions=[{"groups": 4}], trials=2, history_batches=1)
        assert out["pool"]["batches"] == 1 and out["pool"]["groups"] == 4
        r = await c.post(
            "/v1/whatif",
            content=encode_body(
                {"version": 1, "seq_len": 131072, "compositions": [{"groups": 5}], "history_batches": 1}, "msgpack"
            ),
        )
    assert r.status_code == 422 and r.json()["path"] == "$.compositions[0].groups"


def test_generalized_mode_plans_record_default_mode_shapes_with_unique_tails():
    # Four identical sequences: the generalized mode shares their trainable tokens too.
    rng = np.random.default_rng(2)
    seq = rng.integers(0, 1000, 300)
    kw = dict(sequences=[seq] * 4, trainable=[200] * 4, groups=[0, 0, 1, 1], seq_len=2048, min_shared_len=16)
    default_r, general_r = plan_result(**kw), plan_result(**kw, share_trainable=True)
    default, general = default_r.plan, general_r.plan
    assert general.stats.packed_tokens < default.stats.packed_tokens
    batch = normalize_batch(kw["sequences"], seq_len=2048, trainable=kw["trainable"], groups=kw["groups"])
    s_gen = shape_of(batch, general_r.tree, seq_len=2048)
    s_def = shape_of(batch, default_r.tree, seq_len=2048)
    for f in ("seq_ptr", "run_hash", "run_len", "first_trainable"):
        assert np.array_equal(getattr(s_gen, f), getattr(s_def, f)), f
    assert (s_def.run_hash == 0).sum() == 4  # one unshareable tail per sequence
    # Default mode: the trial is the batch itself. Generalized: the tails stay unshared.
    (d,) = whatif([s_def], [Composition(groups=2)], seq_len=2048, min_shared_len=16, trials=1)
    (g,) = whatif([s_def], [Composition(groups=2)], seq_len=2048, min_shared_len=16, trials=1, share_trainable=True)
    assert d.packed_tokens.mean == default.stats.packed_tokens
    assert general.stats.packed_tokens < g.packed_tokens.mean <= default.stats.packed_tokens

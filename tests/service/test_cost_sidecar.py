"""A cost model in the planner's what-if and in the sidecar (``cost_model_path``): predicted
step times next to rows, from fixed coefficients (no timing)."""

from __future__ import annotations

import httpx
import msgpack
import pytest

from treepack.proto.batch import PackInput
from treepack.proto.batch_wire import encode_pack_request
from treepack.proto.codec import encode_body
from treepack.proto.cost import CostModel, CostModelError, cost_terms
from treepack.proto.whatif import Composition
from treepack.service import Settings, create_app
from treepack.service.cli.workloads import agentic
from treepack.service.planner import plan_batch
from treepack.service.planner.fingerprint import shape_of
from treepack.service.planner.whatif import whatif

from helpers.service import pack_body, small_batch
from helpers.shapes import grpo_groups
from helpers.trees import plan_result

COST = CostModel(
    backend="flash",
    coefficients={t: 0.0 for t in cost_terms("flash")}
    | {"step": 2.0, "positions": 1e-3, "segments": 0.1, "attention_pairs": 1e-7},
)


def _shapes(n: int = 4):
    w = agentic(4 * n, seq_len=8192, seed=1, rollouts=2)
    per = len(w.sequences) // n
    out = []
    for i in range(n):
        sl = slice(i * per, (i + 1) * per)
        res = plan_result(w.sequences[sl], trainable=w.trainable[sl], groups=w.groups[sl], seq_len=8192)
        out.append(shape_of(res.batch, res.tree, seq_len=8192))
    return out


def test_whatif_predicts_step_time_next_to_rows():
    shapes = _shapes()
    comps = [Composition(name="small", groups=4), Composition(name="large", groups=12)]
    with_cost = whatif(shapes, comps, seq_len=8192, trials=4, seed=0, cost_model=COST)
    plain = whatif(shapes, comps, seq_len=8192, trials=4, seed=0)
    assert [r.step_ms for r in plain] == [None, None]
    small, large = with_cost
    for r in with_cost:
        assert 0 < r.step_ms.min <= r.step_ms.p50 <= r.step_ms.p90 <= r.step_ms.max
        assert r.step_ms.min >= COST.coefficients["step"]
    # More groups, more time; and the time follows the rows (positions dominate here).
    assert large.step_ms.mean > small.step_ms.mean
    assert large.rows.mean > small.rows.mean


def test_whatif_step_time_is_the_pack_prediction():
    # One composition that takes a whole recorded batch: the trial is that batch's plan.
    w = agentic(8, seq_len=8192, seed=3, rollouts=2)
    res = plan_result(w.sequences, trainable=w.trainable, groups=w.groups, seq_len=8192)
    got = whatif(
        [shape_of(res.batch, res.tree, seq_len=8192)],
        [Composition(groups=len(set(w.groups)))],
        seq_len=8192,
        trials=1,
        cost_model=COST,
    )[0]
    packed = plan_batch(w.sequences, trainable=w.trainable, groups=w.groups, seq_len=8192, cost_model=COST)
    assert got.rows.mean == packed.num_rows
    assert got.step_ms.mean == pytest.approx(packed.stats.predicted_ms, rel=1e-9)


@pytest.fixture
def cost_file(tmp_path):
    path = tmp_path / "cost.json"
    COST.save(path)
    return str(path)


async def test_sidecar_with_a_cost_file(cost_file):
    app = create_app(Settings(cost_model_path=cost_file, history_max_batches=100))
    w = agentic(8, seq_len=8192, seed=1, rollouts=2)
    body = encode_pack_request(PackInput.of(w.sequences, trainable=w.trainable, groups=w.groups, seq_len=8192))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.post(
                "/v1/pack",
                content=encode_body(body, "msgpack"),
                headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
            )
            assert r.status_code == 200, r.text
            stats = msgpack.unpackb(r.content)["plan"]["stats"]
            local = plan_batch(w.sequences, trainable=w.trainable, groups=w.groups, seq_len=8192, cost_model=COST)
            assert stats["predicted_ms"] == pytest.approx(local.stats.predicted_ms)
            q = {"version": 1, "seq_len": 8192, "compositions": [{"groups": 4}], "trials": 3}
            r = await c.post(
                "/v1/whatif",
                content=encode_body(q, "msgpack"),
                headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
            )
            assert r.status_code == 200, r.text
            step = msgpack.unpackb(r.content)["results"][0]["step_ms"]
            assert 0 < step["mean"] <= step["max"] and step["p90"] >= step["p50"]
    finally:
        app.state.service.close()
    # Negative control: without a cost file there is no prediction.
    app = create_app(Settings(history_enabled=False))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.post(
                "/v1/pack",
                content=encode_body(body, "msgpack"),
                headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
            )
            assert msgpack.unpackb(r.content)["plan"]["stats"]["predicted_ms"] is None
    finally:
        app.state.service.close()


def test_sidecar_refuses_a_bad_cost_file_at_startup(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "treepack-cost-model", "version": 7}')
    with pytest.raises(CostModelError, match="bad.json.*version 7"):
        create_app(Settings(cost_model_path=str(bad)))


def test_embedded_packer_with_a_cost_model():
    from treepack.client import Packer
    from treepack.proto.errors import InputTypeError

    w = agentic(4, seq_len=8192, seed=2, rollouts=2)
    with Packer(cost_model=COST) as p:
        plan = p.pack(w.sequences, trainable=w.trainable, groups=w.groups, seq_len=8192, record=False)
    assert plan.stats.predicted_ms == pytest.approx(COST.predict_ms(plan)) and "by time" in plan.strategy
    with pytest.raises(InputTypeError, match="sidecar uses its own cost file"):
        Packer("http://127.0.0.1:1", cost_model=COST)


def test_whatif_keeps_the_asked_repair_budget(monkeypatch):
    # A what-if plans many trials: the cost model's larger per-row repair budget (what
    # /v1/pack spends) would multiply by the trials, so each trial keeps the asked repair_ms.
    from treepack.proto.options import PlanOptions
    from treepack.service.planner import api
    from treepack.service.planner import whatif as whatif_module
    from treepack.service.planner.by_time import repair_budget_ms

    heavy = CostModel(backend="flash", coefficients=COST.coefficients | {"positions": 0.05, "rows": 1.0})
    assert (
        repair_budget_ms(heavy, PlanOptions(seq_len=8192)) > PlanOptions(seq_len=8192).repair_ms
    )  # the pack budget is larger
    budgets = []

    def spy(*args, **kwargs):
        res = api.plan_with_tree(*args, **kwargs)
        budgets.append(res.plan.stats.timings_ms.get("repair_budget"))
        return res

    monkeypatch.setattr(whatif_module, "plan_with_tree", spy)
    whatif(_shapes(2), [Composition(groups=3)], seq_len=8192, trials=3, seed=0, cost_model=heavy)
    assert budgets == [PlanOptions(seq_len=8192).repair_ms] * 3


# Every step costs 1e308 ms per position: the prediction overflows to inf, which JSON cannot
# carry, so a JSON pack answers 500 after the plan was made (msgpack carries inf: 200).
OVERFLOW = CostModel(
    backend="flash", coefficients={t: 0.0 for t in cost_terms("flash")} | {"step": 1e308, "positions": 1e308}
)
MSGPACK_IN = {"content-type": "application/msgpack"}


async def _history_batches(c: httpx.AsyncClient) -> int:
    r = await c.get("/v1/history", headers={"accept": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()["batches"]


def test_a_cost_file_whose_predictions_overflow_is_refused_at_startup(tmp_path):
    """Finite coefficients whose predictions overflow (1e308 x positions) once gave JSON
    answers 500 and msgpack answers an infinity; now the file is refused before serving,
    naming the coefficient, and a realistic file is not (negative control)."""
    path = tmp_path / "overflow.json"
    OVERFLOW.save(path)
    with pytest.raises(CostModelError) as err:
        create_app(Settings(cost_model_path=str(path), history_enabled=False))
    assert err.value.path == "$.coefficients.positions" and str(path) in str(err.value) and "\n" not in str(err.value)
    fine = tmp_path / "fine.json"
    COST.save(fine)
    create_app(Settings(cost_model_path=str(fine), history_enabled=False)).state.service.close()


async def test_a_pack_that_answers_500_is_not_recorded_nor_its_retry(monkeypatch):
    # Every answer fails to encode (a 500 after the plan was made): none is recorded, nor
    # its retries; the same batch answered is (not vacuous).
    from treepack.service import planning

    real = planning.encode_body
    broken = [True]

    def encode(obj, fmt):
        if broken[0]:
            raise ValueError("this answer cannot be encoded")
        return real(obj, fmt)

    monkeypatch.setattr(planning, "encode_body", encode)
    app = create_app(Settings())
    body = pack_body(small_batch())
    try:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            json_out = {**MSGPACK_IN, "accept": "application/json"}
            for headers in (
                json_out,
                json_out,
                {**json_out, "idempotency-key": "step-1"},
                {**json_out, "idempotency-key": "step-1"},
            ):
                r = await c.post("/v1/pack", content=body, headers=headers)
                assert r.status_code == 500 and r.json()["rule"] == "bug", r.text
            assert await _history_batches(c) == 0  # was 4: each 500 recorded the batch
            broken[0] = False
            r = await c.post("/v1/pack", content=body, headers={**MSGPACK_IN, "accept": "application/msgpack"})
            assert r.status_code == 200 and msgpack.unpackb(r.content)["recorded"] is True
            assert await _history_batches(c) == 1
    finally:
        app.state.service.close()


async def test_a_retry_after_a_failed_answer_records_once(monkeypatch):
    # The first answer fails to encode (a 500 after the plan was made); its retry with the
    # same Idempotency-Key plans afresh and answers 200; a third gets the kept answer.
    from treepack.service import planning

    calls = []
    real = planning.encode_body

    def flaky(obj, fmt):
        calls.append(fmt)
        if len(calls) == 1:
            raise ValueError("the first answer cannot be encoded")
        return real(obj, fmt)

    monkeypatch.setattr(planning, "encode_body", flaky)
    app = create_app(Settings())
    body = pack_body(small_batch())
    headers = {**MSGPACK_IN, "accept": "application/msgpack", "idempotency-key": "step-2"}
    try:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            statuses = [(await c.post("/v1/pack", content=body, headers=headers)) for _ in range(3)]
            assert [r.status_code for r in statuses] == [500, 200, 200]
            assert statuses[2].headers["idempotent-replay"] == "true" and statuses[1].content == statuses[2].content
            assert msgpack.unpackb(statuses[1].content)["recorded"] is True
            assert await _history_batches(c) == 1  # was 2: the failed first answer was recorded too
    finally:
        app.state.service.close()


async def test_short_grpo_groups_through_the_sidecar():
    # Issue 37's crash through the app: 256 GRPO groups of 4 x 80 tokens in 8192 rows (a 500
    # before: RecursionError in the exact search), and a what-if drawing 512 such groups.
    kw = grpo_groups(256)
    app = create_app(Settings())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            mp = {**MSGPACK_IN, "accept": "application/msgpack"}
            body = encode_body(encode_pack_request(PackInput.of(**kw)), "msgpack")
            for _ in range(2):  # two batches of 256 groups: 512 to draw from
                r = await c.post("/v1/pack", content=body, headers=mp)
                assert r.status_code == 200, r.text
                plan = msgpack.unpackb(r.content)["plan"]
                assert plan["num_rows"] == 11 and msgpack.unpackb(r.content)["recorded"] is True
            q = {"version": 1, "seq_len": 8192, "compositions": [{"groups": 512}], "trials": 2, "repair_ms": 1000.0}
            r = await c.post("/v1/whatif", content=encode_body(q, "msgpack"), headers=mp)
            assert r.status_code == 200, r.text
            assert msgpack.unpackb(r.content)["results"][0]["rows"]["max"] == 21
    finally:
        app.state.service.close()

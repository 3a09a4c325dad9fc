"""A damaged or oversized history: honest readiness, packs still served, recovery, skipped rows, the WAL folded in."""

from __future__ import annotations

import os
import shutil
import sqlite3

import httpx
import msgpack
import pytest

from treepack.proto.history import HistoryStore
from treepack.proto.history_schema import HistoryDamaged, HistoryPathError, history_path_problem
from treepack.service import Settings, create_app

from helpers.service import pack_body, small_batch

MP = {"content-type": "application/msgpack", "accept": "application/json"}
WHATIF = msgpack.packb({"version": 1, "seq_len": 512, "trials": 2, "compositions": [{"groups": 1}]})


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")


async def test_a_non_database_file_leaves_packs_served_and_readyz_not_ready(tmp_path):
    path = tmp_path / "history.sqlite3"
    path.write_bytes(b"this is not a database, it is a note" * 100)
    app = create_app(Settings(history_path=str(path)))
    try:
        async with _client(app) as c:
            ready = await c.get("/readyz")
            pack = await c.post("/v1/pack", content=pack_body(small_batch()), headers=MP)
            hist = await c.get("/v1/history")
            whatif = await c.post("/v1/whatif", content=WHATIF, headers=MP)
            metrics = (await c.get("/metrics")).text
    finally:
        app.state.service.close()
    assert ready.status_code == 503 and ready.json()["status"] == "not_ready"
    reason = ready.json()["checks"]["history"]
    # Unauthenticated readers get the cause, short and without the path.
    assert (
        reason.startswith("damaged:") and str(path) not in reason and "not a database" in reason and "\n" not in reason
    )
    assert len(ready.text) < 400
    assert "TREEPACK_HISTORY_RECOVER" in reason
    assert pack.status_code == 200 and pack.json()["recorded"] is False
    for r in (hist, whatif):
        assert r.status_code == 503 and r.json()["error"] == "unavailable" and r.json()["rule"] == "history_damaged", (
            r.text
        )
    assert "treepack_history_damaged 1.0" in metrics


def test_startup_errors_name_the_file_in_one_line(tmp_path):
    path = tmp_path / "h.sqlite3"
    path.write_bytes(b"\x00" * 4096 * 3)
    try:
        HistoryStore(path)
    except HistoryDamaged as exc:
        msg = str(exc)
    else:
        raise AssertionError("a zero-filled file opened as a history")
    assert str(path) in msg and "\n" not in msg


async def test_undecodable_and_inconsistent_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "history.sqlite3"
    app = create_app(Settings(history_path=str(path)))
    svc = app.state.service
    try:
        async with _client(app) as c:
            for seed in range(3):
                assert (await c.post("/v1/pack", content=pack_body(small_batch(seed)), headers=MP)).status_code == 200
            svc.flush()
            raw = sqlite3.connect(path)
            ids = [r[0] for r in raw.execute("SELECT id FROM batches ORDER BY id")]
            good = raw.execute("SELECT shape FROM batches WHERE id = ?", (ids[2],)).fetchone()[0]
            bad_shape = msgpack.unpackb(good, raw=False)
            bad_shape["first_trainable"] = bad_shape["first_trainable"][:8]  # one entry for six sequences
            raw.execute("UPDATE batches SET shape = ? WHERE id = ?", (b"\xc1 not msgpack", ids[0]))
            raw.execute("UPDATE batches SET shape = ? WHERE id = ?", (msgpack.packb(bad_shape), ids[1]))
            raw.commit()
            raw.close()
            r = await c.post("/v1/whatif", content=WHATIF, headers=MP)
            metrics = (await c.get("/metrics")).text
            ready = await c.get("/readyz")
    finally:
        svc.close()
    assert r.status_code == 200, r.text  # neither a 500 nor a 422 that blames the request
    assert r.json()["pool"]["batches"] == 1
    assert "treepack_history_undecodable_total 2.0" in metrics
    assert ready.status_code == 200


async def test_history_retention_is_bounded_by_bytes(tmp_path):
    app = create_app(Settings(history_path=str(tmp_path / "h.sqlite3"), history_max_bytes=3000))
    svc = app.state.service
    try:
        async with _client(app) as c:
            for seed in range(8):
                await c.post("/v1/pack", content=pack_body(small_batch(seed)), headers=MP)
        svc.flush()
        one = svc.store.stored_bytes() / svc.store.count()
        assert svc.store.stored_bytes() <= 3000 and svc.store.count() >= 1
        assert svc.store.count() == min(8, int(3000 // one)), (svc.store.count(), one)
    finally:
        svc.close()


async def test_after_a_clean_stop_the_database_file_alone_is_complete(tmp_path):
    path = tmp_path / "history.sqlite3"
    app = create_app(Settings(history_path=str(path)))
    try:
        async with app.router.lifespan_context(app):
            async with _client(app) as c:
                for seed in range(3):
                    await c.post("/v1/pack", content=pack_body(small_batch(seed)), headers=MP)
        # lifespan shutdown ran: the WAL is folded into the file, even with the app still open
        copy = tmp_path / "copy.sqlite3"
        shutil.copyfile(path, copy)  # the database file only, no -wal
        raw = sqlite3.connect(copy)
        assert raw.execute("SELECT COUNT(*) FROM batches").fetchone()[0] == 3
        raw.close()
    finally:
        app.state.service.close()


async def test_a_shape_changed_in_place_fails_its_checksum_and_is_skipped_never_blamed_on_the_request(tmp_path):
    path = tmp_path / "history.sqlite3"
    app = create_app(Settings(history_path=str(path)))
    try:
        async with _client(app) as c:
            for seed in range(3):
                assert (await c.post("/v1/pack", content=pack_body(small_batch(seed)), headers=MP)).status_code == 200
    finally:
        app.state.service.close()
    raw = sqlite3.connect(path)
    first = raw.execute("SELECT id, shape FROM batches ORDER BY id LIMIT 1").fetchone()
    shape = msgpack.unpackb(first[1], raw=False)
    shape["seq_len"] = 100_000  # still a valid shape: only the checksum tells
    raw.execute("UPDATE batches SET shape = ? WHERE id = ?", (msgpack.packb(shape), first[0]))
    raw.commit()
    raw.close()
    app = create_app(Settings(history_path=str(path)))
    try:
        async with _client(app) as c:
            ready = await c.get("/readyz")
            r = await c.post("/v1/whatif", content=WHATIF, headers=MP)
            metrics = (await c.get("/metrics")).text
            history = (await c.get("/v1/history", headers={"accept": "application/json"})).json()
    finally:
        app.state.service.close()
    assert ready.status_code == 200 and "1 stored shape skipped" in ready.json()["checks"]["history"], ready.text
    assert r.status_code == 200 and r.json()["pool"]["batches"] == 2, r.text
    # /v1/history counts what a what-if can use, the skipped row beside it (it said 3 batches).
    assert (history["batches"], history["skipped"]) == (2, 1), history
    assert history["sequences"] == r.json()["pool"]["sequences"]
    assert "treepack_history_undecodable_total 1.0" in metrics


def _foreign(path) -> None:
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
    raw.execute("INSERT INTO invoices (total) VALUES (12.5)")
    raw.commit()
    raw.close()


def _newer(path) -> None:
    HistoryStore(path).close()
    raw = sqlite3.connect(path)
    raw.execute("PRAGMA user_version=99")
    raw.commit()
    raw.close()


@pytest.mark.parametrize(
    "make, cause",
    [
        (lambda p: p.write_bytes(b""), "empty (zero-length)"),
        (_foreign, "another application's database"),
        (lambda p: p.write_bytes(b"garbage" * 1000), "not a database"),
        (_newer, "schema version 99"),
    ],
    ids=["zero-length", "foreign", "garbage", "newer schema"],
)
async def test_every_damaged_file_is_reported_and_the_recover_flag_fixes_it(tmp_path, make, cause):
    path = tmp_path / "history.sqlite3"
    make(path)
    before = path.read_bytes()
    app = create_app(Settings(history_path=str(path)))
    try:
        async with _client(app) as c:
            ready = await c.get("/readyz")
    finally:
        app.state.service.close()
    assert ready.status_code == 503 and cause in ready.json()["checks"]["history"], ready.text
    assert "TREEPACK_HISTORY_RECOVER" in ready.json()["checks"]["history"]
    assert path.read_bytes() == before  # reported, not started afresh over it
    app = create_app(Settings(history_path=str(path), history_recover=True))
    try:
        async with _client(app) as c:
            assert (await c.get("/readyz")).status_code == 200
            assert (await c.post("/v1/pack", content=pack_body(small_batch()), headers=MP)).json()["recorded"] is True
    finally:
        app.state.service.close()
    aside = [p for p in tmp_path.iterdir() if ".damaged-" in p.name and not p.name.endswith(("-wal", "-shm"))]
    assert len(aside) == 1 and aside[0].read_bytes() == before


async def test_readyz_with_the_token_names_the_file(tmp_path):
    path = tmp_path / "history.sqlite3"
    path.write_bytes(b"garbage" * 1000)
    app = create_app(Settings(history_path=str(path), token="s3cret"))
    try:
        async with _client(app) as c:
            anonymous = await c.get("/readyz")
            wrong = await c.get("/readyz", headers={"authorization": "Bearer nope"})
            owner = await c.get("/readyz", headers={"authorization": "Bearer s3cret"})
    finally:
        app.state.service.close()
    assert str(path) not in anonymous.text and str(path) not in wrong.text and str(path) in owner.text
    assert anonymous.status_code == wrong.status_code == owner.status_code == 503


def test_an_uncreatable_history_path_is_a_one_line_error_saying_what_to_do(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        path = locked / "sub" / "history.sqlite3"
        with pytest.raises(HistoryPathError) as info:
            create_app(Settings(history_path=str(path), history_recover=True))
        msg = str(info.value)
        assert "\n" not in msg and str(path) in msg and "--no-history" in msg and "TREEPACK_HISTORY_PATH" in msg
        assert "RECOVER" not in msg
        assert history_path_problem(path) == msg
    finally:
        locked.chmod(0o700)


def test_a_history_path_under_a_file_is_a_one_line_error_for_any_user(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    path = blocker / "history.sqlite3"
    with pytest.raises(HistoryPathError) as info:
        create_app(Settings(history_path=str(path), history_recover=True))
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and "--no-history" in msg and "RECOVER" not in msg


def test_a_history_path_that_is_a_folder_is_a_one_line_error(tmp_path):
    with pytest.raises(HistoryPathError, match="is a folder"):
        create_app(Settings(history_path=str(tmp_path)))


def test_a_schema_one_file_gets_its_checksums(tmp_path):
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path)
    store.close()
    raw = sqlite3.connect(path)
    raw.execute("ALTER TABLE batches DROP COLUMN checksum")
    raw.execute("PRAGMA user_version=1")
    raw.execute("PRAGMA application_id=0")
    raw.commit()
    raw.close()
    store = HistoryStore(path)
    try:
        assert store.check() == "ok"
        cols = {r[1] for r in store._conn.execute("PRAGMA table_info(batches)")}
        assert "checksum" in cols
    finally:
        store.close()

"""A damaged or oversized history: honest readiness, packs still served, recovery, skipped rows, the WAL folded in."""

from __future__ import annotations

import shutil
import sqlite3

import httpx
import msgpack
from helpers.service import pack_body, small_batch

from treepack.service import Settings, create_app
from treepack.proto.history import HistoryDamaged, HistoryStore

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
    assert reason.startswith("damaged:") and str(path) in reason and "not a database" in reason and "\n" not in reason
    assert "TREEPACK_HISTORY_RECOVER" in reason
    assert pack.status_code == 200 and pack.json()["recorded"] is False
    for r in (hist, whatif):
        assert r.status_code == 503 and r.json()["error"] == "unavailable" and r.json()["rule"] == "history_damaged", r.text
    assert "treepack_history_damaged 1.0" in metrics


async def test_the_recovery_flag_moves_the_damaged_file_aside(tmp_path):
    path = tmp_path / "history.sqlite3"
    path.write_bytes(b"garbage" * 1000)
    app = create_app(Settings(history_path=str(path), history_recover=True))
    try:
        async with _client(app) as c:
            assert (await c.get("/readyz")).status_code == 200
            assert (await c.post("/v1/pack", content=pack_body(small_batch()), headers=MP)).json()["recorded"] is True
    finally:
        app.state.service.close()
    aside = [p for p in tmp_path.iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == b"garbage" * 1000


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

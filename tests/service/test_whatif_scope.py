"""What a what-if samples from the history: the batches of its own seq_len by default (the
docs' curl example at seq_len 16 stays out of a what-if at 512), another seq_len or all of
them when asked, the groups of given tags; the sidecar and the embedded client alike."""

from __future__ import annotations

import json

import httpx
import pytest

from treepack.client import Packer
from treepack.proto.errors import RequestError
from treepack.service import Settings, create_app

from helpers.service import pack_body, small_batch

MP = {"content-type": "application/msgpack"}
JS = {"content-type": "application/json", "accept": "application/json"}
CURL = (
    b'{"version": 1, "seq_len": 16, "tokens": [1,2,3,4,5,6, 1,2,3,4,7,8], "offsets": [0,6,12],'
    b' "prompt_lens": [4,4], "min_shared_len": 2}'
)  # docs/service.md's curl example


def _whatif(seq_len: int, **fields) -> bytes:
    return json.dumps(
        {"version": 1, "seq_len": seq_len, "trials": 2, "compositions": [{"groups": 1}]} | fields
    ).encode()


async def test_a_whatif_samples_its_own_seq_len_unless_told():
    app = create_app(Settings())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            assert (await c.post("/v1/pack", content=CURL, headers=JS)).status_code == 200
            for seed in range(2):
                assert (await c.post("/v1/pack", content=pack_body(small_batch(seed)), headers=MP)).status_code == 200

            async def pool(seq_len, **fields):
                r = await c.post("/v1/whatif", content=_whatif(seq_len, **fields), headers=JS)
                return r.status_code, r.json()

            status, own = await pool(512)
            assert status == 200 and own["pool"]["batches"] == 2 and own["pool"]["sequences"] == 12, own
            status, anyone = await pool(512, history_seq_len="any")
            assert status == 200 and anyone["pool"]["batches"] == 3, anyone  # the control: the curl batch is there
            status, curl = await pool(512, history_seq_len=16)
            assert status == 200 and (curl["pool"]["batches"], curl["pool"]["sequences"]) == (1, 2), curl
            status, math = await pool(512, history_tags=["math"])
            assert status == 200 and set(math["pool"]["tags"]) == {"math"} and math["pool"]["groups"] == 2, math
            status, none = await pool(1024)
            assert status == 422 and none["rule"] == "no_history" and none["path"] == "$.history_seq_len", none
            assert "seq_len 16, 512" in none["message"]
            status, bad = await pool(512, history_seq_len="all")
            assert status == 422 and bad["path"].startswith("$.history_seq_len"), bad
    finally:
        app.state.service.close()


def test_the_embedded_client_scopes_its_history_the_same_way(tmp_path):
    with Packer(history_path=str(tmp_path / "h.sqlite3")) as p:
        p.pack([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]], seq_len=16, trainable=[4, 4], min_shared_len=2)
        for seed in range(2):
            p.pack(**small_batch(seed))
        own = p.whatif([1], seq_len=512, trials=4, seed=3)
        anyone = p.whatif([1], seq_len=512, trials=4, seed=3, history_seq_len="any")
        curl = p.whatif([1], seq_len=512, trials=4, seed=3, history_seq_len=16)
        with pytest.raises(RequestError) as e:
            p.whatif([1], seq_len=1024, trials=1)
        tagged = p.whatif([{"groups": 2}], seq_len=512, trials=2, history_tags=["code"])
    assert e.value.rule == "no_history" and "seq_len 16, 512" in e.value.message
    # The curl batch (two ungrouped 6-token sequences) is sampled only when asked.
    assert curl[0].unpacked_tokens.max == 6.0
    assert own[0].unpacked_tokens.min > 6 and anyone[0].trials == 4
    assert tagged[0].groups == 2

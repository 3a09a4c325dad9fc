"""The client: one interface over three backends, errors mapped back, retries, a real uvicorn.

The same batch must give identical plans (array for array) from the embedded backend,
the app in-process (``httpx.ASGITransport``) and a real ``python -m treepack.service``
process on 127.0.0.1 started here.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from helpers.service import assert_same_plan, free_port, running_server

from treepack.client import AsyncPacker, Composition, Packer
from treepack.proto.errors import CapacityError, InputTypeError, RequestError, TransportError, UnsupportedVersionError
from treepack.service import Settings, create_app
from treepack.service.planner import validate_plan
from treepack.service.cli.workloads import agentic, curriculum, golden_example


def _batches():
    g = golden_example()
    c = curriculum(8)
    a = agentic(3)
    rng = np.random.default_rng(5)
    keyed = [np.concatenate([np.full(70, 3), rng.integers(0, 9, 30)]).astype(np.int32) for _ in range(5)]
    keys = [np.where(np.arange(100) < 60, 11, s).astype(np.uint64) for s in range(5)]
    return [
        ("golden", dict(**g.plan_kwargs()), g.tags),
        ("curriculum-4-ranks", dict(**c.plan_kwargs(), num_ranks=4, placement="bfd"), c.tags),
        ("agentic-flags", dict(**a.plan_kwargs(), conv_width=3), None),
        ("keys-lists", dict(sequences=[s.tolist() for s in keyed], keys=keys, seq_len=256, min_shared_len=16), None),
        ("truncate", dict(sequences=[np.arange(90), np.arange(40)], seq_len=64, on_overflow="truncate", min_shared_len=8), None),
        ("generalized", _same_start_completions(), None),
    ]


def _same_start_completions():
    """Completions that agree on their first 40 trainable tokens: shared in the generalized mode."""
    rng = np.random.default_rng(9)
    prompt, start = rng.integers(0, 1000, 120), rng.integers(0, 1000, 40)
    seqs = [np.concatenate([prompt, start, rng.integers(0, 1000, 30)]) for _ in range(6)]
    return dict(sequences=seqs, trainable=[120] * 6, groups=[0] * 6, seq_len=512, min_shared_len=16, share_trainable=True)


BATCHES = _batches()


@pytest.fixture(scope="module")
def server():
    with running_server() as (url, proc):
        yield url


@pytest.fixture(scope="module")
def app():
    app = create_app(Settings())
    yield app
    app.state.service.close()


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_three_backends_give_identical_plans(server, app, fmt):
    embedded = Packer()
    with Packer(server, fmt=fmt) as remote:
        async with AsyncPacker("http://asgi", transport=httpx.ASGITransport(app), fmt=fmt) as asgi:
            for name, kwargs, tags in BATCHES:
                p_emb = embedded.pack(**kwargs, tags=tags)
                p_asgi = await asgi.pack(**kwargs, tags=tags)
                p_http = remote.pack(**kwargs, tags=tags)
                assert p_asgi.tree is None and p_http.tree is None, name
                assert_same_plan(p_emb, p_asgi)
                assert_same_plan(p_emb, p_http)
                validate_plan(p_http, kwargs["sequences"], trainable=kwargs.get("trainable"), keys=kwargs.get("keys"))


def test_large_bodies_go_out_in_chunks_with_the_same_plan(server, monkeypatch):
    import treepack.client.http as http

    g = curriculum(32)  # 1.8 MB on the wire: two chunks of at most 1 MiB
    monkeypatch.setattr(http, "CHUNKED_MIN_BYTES", 0)
    sent = []
    real = http.HttpBackend.request

    def spy(self, method, path, body=None, **kw):
        sent.append(body)
        return real(self, method, path, body, **kw)

    monkeypatch.setattr(http.HttpBackend, "request", spy)
    with Packer(server) as p:
        got = p.pack(**g.plan_kwargs())
    assert isinstance(sent[0], http.BodyChunks) and len(list(sent[0])) == 2
    assert_same_plan(Packer().pack(**g.plan_kwargs()), got)


async def test_async_embedded_and_sync_http_agree(server):
    name, kwargs, tags = BATCHES[1]
    async with AsyncPacker() as p:
        a = await p.pack(**kwargs)
        assert (await p.health())["backend"] == "embedded"
    with Packer(server) as p:
        assert_same_plan(a, p.pack(**kwargs))
        assert p.health() == {"version": 1, "status": "ok", "backend": "http"}


# (kwargs, exception, path, message fragment); the sidecar's errors come back as the
# embedded planner's, with the server's message and field path.
ERRORS = [
    (dict(sequences=[np.arange(100), np.arange(300)], seq_len=256), CapacityError, "$.sequences[1]", "sequence 1 has 300 tokens, longer than seq_len 256"),
    (dict(sequences=[np.arange(10)], seq_len=64, placement="best"), RequestError, "$.placement", "best"),
    (dict(sequences=[np.arange(10)], seq_len=64, num_ranks=0), RequestError, "$.num_ranks", "0"),
    (dict(sequences=[np.arange(10)], seq_len=64, min_shared_len=0), RequestError, "$.min_shared_len", "0"),
    (dict(sequences=[np.arange(10), np.arange(12)], seq_len=64, trainable=[3, 13]), RequestError, "$.sequences[1].trainable", "prompt length must be in [0, 12], got 13"),
    (dict(sequences=[np.array([1, -5])], seq_len=64), RequestError, "$.sequences[0][1]", "token id must be >= 0, got -5"),
    (dict(sequences=[np.array([1.5])], seq_len=64), InputTypeError, "$.sequences[0]", "expected integer token ids"),
    (dict(sequences=[], seq_len=64), RequestError, "$.sequences", "the batch is empty"),
    # Wire-form input the client sends unchecked: the server's planner raises the same error.
    (dict(sequences=[np.arange(9, dtype=np.uint32), np.zeros(0, np.uint32)], seq_len=64), RequestError, "$.sequences[1]", "sequence has no tokens"),
    (dict(sequences=[np.arange(300, dtype=np.uint32)], seq_len=256), CapacityError, "$.sequences[0]", "sequence 0 has 300 tokens"),
    # Wire-form tokens with flags or keys that do not fit: the planner's error, raised before sending.
    (dict(sequences=[np.arange(9, dtype=np.uint32)], seq_len=64, trainable=[np.ones(8, bool)]), RequestError, "$.sequences[0].trainable", "8 flags for 9 tokens"),
    (dict(sequences=[np.arange(9, dtype=np.uint32)], seq_len=64, trainable=[True]), InputTypeError, "$.sequences[0].trainable", "expected a bool array"),
    (dict(sequences=[np.arange(9, dtype=np.uint32)], seq_len=64, keys=[np.zeros(3, np.uint64)]), RequestError, "$.sequences[0].keys", "one uint64 per token"),
    (dict(sequences=[np.arange(9, dtype=np.uint32)], seq_len=64, groups=[1.5]), InputTypeError, "$.groups[0]", "group must be an int or a string"),
    (dict(sequences=[np.arange(9, dtype=np.uint32)], seq_len=64, trainable=[1, 2]), RequestError, "$.trainable", "2 entries for 1 sequences"),
    # The wire's limits on group ids hold for the embedded planner too.
    (dict(sequences=[np.arange(9, dtype=np.uint32)], seq_len=64, groups=["g" * 300]), RequestError, "$.groups[0]", "256"),
    (dict(sequences=[np.arange(9, dtype=np.uint32)], seq_len=64, groups=[2**70]), RequestError, "$.groups[0]", ""),
]


def test_numpy_scalar_options_travel(server):
    seqs = [np.arange(40, dtype=np.uint32)] * 3
    kwargs = dict(seq_len=np.int64(128), min_shared_len=np.int32(8), num_ranks=np.int64(2), share_trainable=np.bool_(False))
    with Packer(server) as p:
        assert_same_plan(Packer().pack(seqs, **kwargs), p.pack(seqs, **kwargs))


@pytest.mark.parametrize("kwargs,exc,path,text", ERRORS)
def test_errors_are_the_same_exceptions(server, kwargs, exc, path, text):
    caught = []
    for packer in (Packer(), Packer(server, retries=0)):
        with pytest.raises(exc) as e:
            packer.pack(**kwargs)
        assert e.value.path == path and text in e.value.message, (packer.url, e.value)
        caught.append(e.value)
        packer.close()
    assert type(caught[0]) is type(caught[1])


def test_server_side_errors_keep_kind_message_and_path(server):
    # A request the client does not check itself: the server's error arrives intact.
    from treepack.proto.codec import encode_body
    from treepack.service.batch_wire import encode_pack_request

    msg = encode_pack_request([np.arange(5)], seq_len=64)
    msg["version"] = 7
    r = httpx.post(server + "/v1/pack", content=encode_body(msg, "msgpack"), headers={"content-type": "application/msgpack"})
    from treepack.client.http import raise_for_response

    with pytest.raises(UnsupportedVersionError) as e:
        raise_for_response(r)
    assert e.value.path == "$.version" and e.value.rule == "version" and "wire version 7" in e.value.message


class CountingTransport(httpx.HTTPTransport):
    """The real transport, counting attempts."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        return super().handle_request(request)


def test_connection_errors_are_retried_then_raised():
    t = CountingTransport()
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with Packer(url, retries=2, backoff=0.01, transport=t) as p:
        with pytest.raises(TransportError, match="ConnectError") as e:
            p.pack([np.arange(10)], seq_len=64)
    assert t.calls == 3 and url in e.value.message


def test_timeouts_become_transport_errors(server):
    with Packer(server, timeout=1e-6, retries=0) as p:
        with pytest.raises(TransportError, match="timed out"):
            p.pack(**dict(golden_example().plan_kwargs()))


def test_whatif_over_http_matches_embedded_on_inline_shapes(server):
    from treepack.service.planner import normalize_batch, plan_batch
    from treepack.service.planner.shapes import shape_of

    w = curriculum(12)
    kw = w.plan_kwargs()
    plan = plan_batch(**kw)
    shape = shape_of(normalize_batch(kw["sequences"], seq_len=w.seq_len, trainable=w.trainable, groups=w.groups), plan.tree, seq_len=w.seq_len, tags=w.tags)
    comps = [Composition(name="six", groups=6), {"by_tag": {"task0": 2, "task1": 1}}, 12]
    args = dict(seq_len=w.seq_len, trials=4, seed=3, max_rows=1, shapes=[shape])
    emb = Packer().whatif(comps, **args)
    with Packer(server) as p:
        rem = p.whatif(comps, **args)
    assert [r.name for r in rem] == ["six", "", ""]
    for a, b in zip(emb, rem):
        assert a.rows == b.rows and a.packed_tokens == b.packed_tokens and a.p_rows_over == b.p_rows_over
        assert np.array_equal(a.row_counts, b.row_counts)
    assert rem[2].row_counts.tolist() == [plan.num_rows] * 4  # every group: the recorded batch itself

"""The client: one interface over three backends, errors mapped back, retries, a real uvicorn.

The same batch must give identical plans (array for array) from the embedded backend,
the app in-process (``httpx.ASGITransport``) and a real ``python -m treepack.service``
process on 127.0.0.1 started here.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from treepack.client import AsyncPacker, Composition, Packer
from treepack.proto.errors import CapacityError, InputTypeError, RequestError, TransportError, UnsupportedVersionError
from treepack.proto.version import WIRE_VERSION
from treepack.service import Settings, create_app
from treepack.service.cli.workloads import agentic, curriculum, golden_example
from treepack.service.planner import validate_plan

from helpers.service import assert_same_plan, free_port, running_server
from helpers.trees import plan_result


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
        (
            "truncate",
            dict(sequences=[np.arange(90), np.arange(40)], seq_len=64, on_overflow="truncate", min_shared_len=8),
            None,
        ),
        ("generalized", _same_start_completions(), None),
    ]


def _same_start_completions():
    """Completions that agree on their first 40 trainable tokens: shared in the generalized mode."""
    rng = np.random.default_rng(9)
    prompt, start = rng.integers(0, 1000, 120), rng.integers(0, 1000, 40)
    seqs = [np.concatenate([prompt, start, rng.integers(0, 1000, 30)]) for _ in range(6)]
    return dict(
        sequences=seqs, trainable=[120] * 6, groups=[0] * 6, seq_len=512, min_shared_len=16, share_trainable=True
    )


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
            for _name, kwargs, tags in BATCHES:
                p_emb = embedded.pack(**kwargs, tags=tags)
                p_asgi = await asgi.pack(**kwargs, tags=tags)
                p_http = remote.pack(**kwargs, tags=tags)
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
        assert p.health() == {"version": WIRE_VERSION, "status": "ok", "backend": "http"}


async def test_a_pack_input_goes_to_every_entry_point_as_it_is(server):
    # One request object: plan_batch, both packers and both backends take it in place
    # of the keywords, and give the plan the keywords give.
    from treepack.proto.batch import PackInput
    from treepack.service.planner import plan_batch

    name, kwargs, tags = BATCHES[1]
    request = PackInput.of(**kwargs, tags=tags)
    want = plan_batch(**kwargs)
    validate_plan(want, kwargs["sequences"], trainable=kwargs.get("trainable"))
    assert_same_plan(want, plan_batch(request))
    assert_same_plan(want, Packer().pack(request))
    async with AsyncPacker(server) as p:
        assert_same_plan(want, await p.pack(request))
    with pytest.raises(InputTypeError, match="PackInput alone") as e:
        Packer().pack(request, groups=None, seq_len=64)
    assert (e.value.path, e.value.rule) == ("$", "exclusive")
    with pytest.raises(InputTypeError, match="PackInput alone"):
        Packer().pack(request, record=False)


# (kwargs, exception, path, rule, message): the embedded planner's full message; the
# sidecar's errors come back as the same exception with the server's message and path.
_OVER = " (set on_overflow='truncate' or 'drop' to allow)"
_U32 = np.uint32
ERRORS = [
    (
        dict(sequences=[np.arange(100), np.arange(300)], seq_len=256),
        CapacityError,
        "$.sequences[1]",
        "max_len",
        "sequence 1 has 300 tokens, longer than seq_len 256" + _OVER,
    ),
    (
        dict(sequences=[np.arange(10)], seq_len=64, placement="best"),
        RequestError,
        "$.placement",
        "enum",
        "unknown placement 'best'; expected one of ('auto', 'bfd', 'in_order', 'no_share')",
    ),
    (
        dict(sequences=[np.arange(10)], seq_len=64, num_ranks=0),
        RequestError,
        "$.num_ranks",
        "minimum",
        "num_ranks must be >= 1, got 0",
    ),
    (
        dict(sequences=[np.arange(10)], seq_len=64, min_shared_len=0),
        RequestError,
        "$.min_shared_len",
        "minimum",
        "min_shared_len must be >= 1, got 0",
    ),
    (
        dict(sequences=[np.arange(10), np.arange(12)], seq_len=64, trainable=[3, 13]),
        RequestError,
        "$.sequences[1].trainable",
        "prompt_len_range",
        "prompt length must be in [0, 12], got 13",
    ),
    (
        dict(sequences=[np.array([1, -5])], seq_len=64),
        RequestError,
        "$.sequences[0][1]",
        "token_range",
        "token id must be >= 0, got -5",
    ),
    (
        dict(sequences=[np.array([1.5])], seq_len=64),
        InputTypeError,
        "$.sequences[0]",
        "dtype",
        "expected integer token ids, got dtype float64",
    ),
    (
        dict(sequences=[], seq_len=64),
        RequestError,
        "$.sequences",
        "non_empty",
        "the batch is empty: at least one sequence is needed",
    ),
    # Wire-form input the client sends unchecked: the server's planner raises the same error.
    (
        dict(sequences=[np.arange(9, dtype=_U32), np.zeros(0, _U32)], seq_len=64),
        RequestError,
        "$.sequences[1]",
        "non_empty",
        "sequence has no tokens",
    ),
    (
        dict(sequences=[np.arange(300, dtype=_U32)], seq_len=256),
        CapacityError,
        "$.sequences[0]",
        "max_len",
        "sequence 0 has 300 tokens, longer than seq_len 256" + _OVER,
    ),
    # Wire-form tokens with flags or keys that do not fit: the planner's error, raised before sending.
    (
        dict(sequences=[np.arange(9, dtype=_U32)], seq_len=64, trainable=[np.ones(8, bool)]),
        RequestError,
        "$.sequences[0].trainable",
        "length_mismatch",
        "trainable has 8 flags for 9 tokens",
    ),
    (
        dict(sequences=[np.arange(9, dtype=_U32)], seq_len=64, trainable=[True]),
        InputTypeError,
        "$.sequences[0].trainable",
        "type",
        "expected a bool array or a prompt length, got True",
    ),
    (
        dict(sequences=[np.arange(9, dtype=_U32)], seq_len=64, keys=[np.zeros(3, np.uint64)]),
        RequestError,
        "$.sequences[0].keys",
        "length_mismatch",
        "keys must be one uint64 per token (9), got shape (3,)",
    ),
    (
        dict(sequences=[np.arange(9, dtype=_U32)], seq_len=64, groups=[1.5]),
        InputTypeError,
        "$.groups[0]",
        "type",
        "group must be an int or a string, got float",
    ),
    (
        dict(sequences=[np.arange(9, dtype=_U32)], seq_len=64, trainable=[1, 2]),
        RequestError,
        "$.trainable",
        "length_mismatch",
        "trainable has 2 entries for 1 sequences",
    ),
    # The wire's limits on group ids hold for the embedded planner too.
    (
        dict(sequences=[np.arange(9, dtype=_U32)], seq_len=64, groups=["g" * 300]),
        RequestError,
        "$.groups[0]",
        "max_length",
        "group label has 300 characters, at most 256",
    ),
    (
        dict(sequences=[np.arange(9, dtype=_U32)], seq_len=64, groups=[2**70]),
        RequestError,
        "$.groups[0]",
        "int64",
        f"group id {2**70} does not fit int64",
    ),
]


def test_numpy_scalar_options_travel(server):
    seqs = [np.arange(40, dtype=np.uint32)] * 3
    kwargs = dict(
        seq_len=np.int64(128), min_shared_len=np.int32(8), num_ranks=np.int64(2), share_trainable=np.bool_(False)
    )
    with Packer(server) as p:
        assert_same_plan(Packer().pack(seqs, **kwargs), p.pack(seqs, **kwargs))


@pytest.mark.parametrize("kwargs,exc,path,rule,message", ERRORS, ids=[f"{r[3]}@{r[2]}" for r in ERRORS])
def test_errors_are_the_same_exceptions(server, kwargs, exc, path, rule, message):
    for packer in (Packer(), Packer(server, retries=0)):
        with pytest.raises(exc) as e:
            packer.pack(**kwargs)
        assert (type(e.value), e.value.path, e.value.rule, e.value.message) == (exc, path, rule, message), packer.url
        packer.close()


def test_server_side_errors_keep_kind_message_and_path(server):
    # A request the client does not check itself: the server's error arrives intact.
    from treepack.proto.batch import PackInput
    from treepack.proto.batch_wire import encode_pack_request
    from treepack.proto.codec import encode_body

    msg = encode_pack_request(PackInput.of([np.arange(5)], seq_len=64))
    msg["version"] = 7
    r = httpx.post(
        server + "/v1/pack", content=encode_body(msg, "msgpack"), headers={"content-type": "application/msgpack"}
    )
    from treepack.client.http_errors import raise_for_response

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
    from treepack.service.planner.fingerprint import shape_of

    w = curriculum(12)
    kw = w.plan_kwargs()
    result = plan_result(**kw)
    shape = shape_of(result.batch, result.tree, seq_len=w.seq_len, tags=w.tags)
    comps = [Composition(name="six", groups=6), {"by_tag": {"task0": 2, "task1": 1}}, 12]
    args = dict(seq_len=w.seq_len, trials=4, seed=3, max_rows=1, shapes=[shape])
    emb = Packer().whatif(comps, **args)
    with Packer(server) as p:
        rem = p.whatif(comps, **args)
    assert [r.name for r in rem] == [r.name for r in emb] == ["six", "task0 2 + task1 1", "12 groups"]
    for a, b in zip(emb, rem):
        assert a.rows == b.rows and a.packed_tokens == b.packed_tokens and a.p_rows_over == b.p_rows_over
        assert np.array_equal(a.row_counts, b.row_counts)
        assert a.strategies == b.strategies and len(a.strategies) == 4 and a.suggested_trials == b.suggested_trials
    assert rem[2].row_counts.tolist() == [result.plan.num_rows] * 4  # every group: the recorded batch itself


def test_every_backend_has_the_protocol_methods_with_their_parameters():
    # Protocols are not checked at runtime: hold each backend to its protocol here.
    import inspect

    from treepack.client.embedded import EmbeddedBackend
    from treepack.client.http import AsyncHttpBackend, HttpBackend
    from treepack.client.protocols import AsyncBackend, Backend, InThread

    def methods(cls):
        return {n: f for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")}

    for proto, impls in ((Backend, (EmbeddedBackend, HttpBackend)), (AsyncBackend, (InThread, AsyncHttpBackend))):
        want = methods(proto)
        assert set(want) == {"pack", "whatif", "history", "health", "close"}
        for impl in impls:
            for name, spec in want.items():
                got = getattr(impl, name, None)
                assert got is not None, f"{impl.__name__} has no {name}"
                assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(spec), (impl.__name__, name)
                assert list(inspect.signature(got).parameters) == list(inspect.signature(spec).parameters), (
                    impl.__name__,
                    name,
                )

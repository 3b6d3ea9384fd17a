"""The bootstrap server over real HTTP on 127.0.0.1 (a thread, no processes)."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import asdict, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg_worker.disagg.bootstrap import BootstrapServer, RankRegistration
from disagg_worker.disagg.bootstrap_client import BootstrapError, Topology, fetch_topology, register_rank

TOKEN = "t0ken"
REG = RankRegistration(
    tp_rank=0,
    tp_size=2,
    pp_rank=0,
    pp_size=1,
    rank_ip="10.0.0.1",
    rank_port=5555,
    page_size=16,
    kv_dtype="bfloat16",
    session_id="10.0.0.1:15001",
    start_layer=0,
    num_layers=4,
    kv_head_start=0,
    num_kv_heads=1,
    head_nbytes=256,
)


def request(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, resp.getheader("Content-Type", ""), raw
    finally:
        conn.close()


def topology(url: str) -> Topology:
    """The complete instance's topology (fails the test while it is incomplete)."""
    topo = fetch_topology(url, TOKEN)
    assert topo is not None, "the instance is incomplete"
    return topo


def auth(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def server():
    srv = BootstrapServer(0, tp_size=2, pp_size=1, token=TOKEN, host="127.0.0.1").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server():
    srv = BootstrapServer(0, tp_size=1, pp_size=1, host="127.0.0.1").start()
    yield srv
    srv.stop()


def test_route_is_503_until_every_rank_registered(server):
    url = server.url
    assert request(server.port, "GET", "/health")[0] == 503
    register_rank(url, REG, TOKEN)
    assert fetch_topology(url, TOKEN) is None, "half an instance must not be served"
    status, _, raw = request(server.port, "GET", "/route?tp_rank=0&pp_rank=0", headers=auth())
    assert status == 503 and "1 of 2" in json.loads(raw)["error"]
    register_rank(url, replace(REG, tp_rank=1, rank_port=5556), TOKEN)
    topo = topology(url)
    assert (topo.tp_size, topo.page_size, topo.kv_dtype) == (2, 16, "bfloat16")
    assert [r.rank_port for r in topo.ranks] == [5555, 5556]
    status, _, raw = request(server.port, "GET", "/route?tp_rank=1&pp_rank=0", headers=auth())
    assert status == 200 and json.loads(raw) == {"rank_ip": "10.0.0.1", "rank_port": 5556}
    status, _, raw = request(server.port, "GET", "/health")
    assert status == 200 and json.loads(raw)["instance_id"] == topo.instance_id
    status, _, raw = request(server.port, "GET", "/route?tp_rank=5&pp_rank=0", headers=auth())
    assert status == 404 and "tp=5" in json.loads(raw)["error"]


def test_auth_fails_closed(server):
    body = json.dumps(asdict(REG)).encode()
    for headers in ({}, auth("wrong"), {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}):
        assert request(server.port, "PUT", "/route", body, headers)[0] == 401
        assert request(server.port, "GET", "/route?tp_rank=-1&pp_rank=-1", headers=headers)[0] == 401
    with pytest.raises(BootstrapError, match="401"):
        register_rank(server.url, REG, "wrong")


def test_conflicting_registrations_are_refused(open_server):
    with pytest.raises(BootstrapError, match="409"):
        register_rank(open_server.url, replace(REG, tp_size=1, tp_rank=3))
    with pytest.raises(BootstrapError, match="instance is tp=1"):
        register_rank(open_server.url, REG)


def _instance_id(srv) -> str:
    return json.loads(request(srv.port, "GET", "/health")[2])["instance_id"]


def test_a_rank_slot_changes_hands_only_when_its_holder_is_gone():
    """Re-registering (tp, pp) under another identity: refused while the holder's control endpoint
    listens; accepted once nothing listens there, or for the same endpoint (the holder restarted)."""
    import socket

    srv = BootstrapServer(0, tp_size=1, pp_size=1, token=TOKEN, host="127.0.0.1").start()
    live = socket.create_server(("127.0.0.1", 0))
    try:
        held = replace(REG, tp_size=1, rank_ip="127.0.0.1", rank_port=live.getsockname()[1])
        register_rank(srv.url, held, TOKEN)
        register_rank(srv.url, held, TOKEN)  # the same registration again (a retry) is fine
        first = _instance_id(srv)
        thief = replace(held, rank_port=held.rank_port + 1, session_id="10.9.9.9:15000")
        with pytest.raises(BootstrapError, match="409.*held by a live rank"):
            register_rank(srv.url, thief, TOKEN)
        assert topology(srv.url).ranks == [held] and _instance_id(srv) == first
        restarted = replace(held, session_id="127.0.0.1:15002")  # same endpoint, new transfer session
        register_rank(srv.url, restarted, TOKEN)
        second = _instance_id(srv)
        assert topology(srv.url).ranks == [restarted] and second != first
        live.close()  # the holder is gone: its endpoint refuses connections
        register_rank(srv.url, thief, TOKEN)
        assert topology(srv.url).ranks == [thief] and _instance_id(srv) not in (first, second)
    finally:
        live.close()
        srv.stop()


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)
# Registration-shaped objects with some fields missing or of the wrong type.
near_regs = st.fixed_dictionaries({}, optional={k: json_values | st.just(v) for k, v in asdict(REG).items()})
bodies = st.one_of(
    st.binary(max_size=80),
    json_values.map(lambda v: json.dumps(v).encode()),
    near_regs.map(lambda v: json.dumps(v).encode()),
)
queries = st.lists(st.tuples(st.text(max_size=10), st.text(max_size=10)), max_size=4).map(
    lambda kv: urllib.parse.urlencode(kv)
)
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
headers = st.dictionaries(
    st.sampled_from(["Authorization", "Content-Type", "Content-Length-X", "X-Junk"]), header_text, max_size=3
)
paths = st.sampled_from(["/route", "/health", "/nope", "/route/x"])
methods = st.sampled_from(["GET", "PUT", "POST", "DELETE"])


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=methods, path=paths, query=queries, body=bodies, hdrs=headers, authorized=st.booleans())
def test_malformed_requests_get_4xx_json_never_5xx(server, method, path, query, body, hdrs, authorized):
    if authorized:
        hdrs = {**hdrs, **auth()}
    status, ctype, raw = request(server.port, method, f"{path}?{query}", body, hdrs)
    assert status < 500 or status == 503, (status, raw[:200])
    if status >= 400:
        assert ctype.startswith("application/json") and "error" in json.loads(raw)


def test_a_registration_without_kv_kind_is_a_per_head_pool_and_a_bad_kind_is_refused():
    old = {k: v for k, v in asdict(REG).items() if k != "kv_kind"}  # a rank of the release before MLA
    assert RankRegistration.from_json(old).kv_kind == "mha"
    with pytest.raises(ValueError, match="kv_kind must be one of mha, mla"):
        RankRegistration.from_json({**old, "kv_kind": "latent"})


def test_an_instance_with_dp_attention_answers_each_attention_group_apart():
    """Two groups of two ranks: decode reads one group's topology under /dp/{k}; the plain route names the groups
    instead of answering one of them, and a group that does not exist is a 404."""
    srv = BootstrapServer(0, tp_size=2, token=TOKEN, host="127.0.0.1", dp_size=2).start()
    try:
        slots = [(dp, tp) for dp in (0, 1) for tp in (0, 1)]
        for dp, tp in slots:
            assert fetch_topology(f"{srv.url}/dp/0", TOKEN) is None  # 503 until every group's ranks registered
            register_rank(
                srv.url, replace(REG, tp_rank=tp, rank_port=6000 + 10 * dp + tp, dp_rank=dp, dp_size=2), TOKEN
            )
        for dp in (0, 1):
            topo = topology(f"{srv.url}/dp/{dp}")
            assert topo.tp_size == 2
            assert [(r.dp_rank, r.tp_rank, r.rank_port) for r in topo.ranks] == [
                (dp, 0, 6000 + 10 * dp),
                (dp, 1, 6001 + 10 * dp),
            ]
        with pytest.raises(BootstrapError, match="runs 2 attention groups"):
            fetch_topology(srv.url, TOKEN)
        with pytest.raises(BootstrapError, match="no attention group 2"):
            fetch_topology(f"{srv.url}/dp/2", TOKEN)
        status, _, body = request(srv.port, "GET", "/dp/1/health")
        assert status == 200 and json.loads(body)["expected"] == 4
        status, _, body = request(srv.port, "GET", "/dp/x/health")
        assert status == 400
        # A rank that says another group count is refused, naming both.
        with pytest.raises(BootstrapError, match="instance is tp=2 pp=1 dp=2, rank says tp=2 pp=1 dp=1"):
            register_rank(srv.url, replace(REG, rank_port=7000), TOKEN)
    finally:
        srv.stop()


def test_a_local_instance_listens_and_registers_on_the_loopback_address_it_advertises():
    """Two instances on one machine advertising 127.0.0.1 and 127.0.0.2 share one bootstrap port, as pods do; an
    instance advertising another address listens on every interface, and its own ranks reach it over loopback."""
    from disagg_worker.config import DisaggConfig
    from disagg_worker.disagg.bootstrap import leader_url, listen_host

    assert [listen_host(h) for h in ("127.0.0.2", "::1", "10.0.0.5", "pod.example")] == [
        "127.0.0.2",
        "::1",
        "0.0.0.0",
        "0.0.0.0",
    ]
    urls = [leader_url(DisaggConfig(advertise_host=h, bootstrap_port=9000)) for h in ("127.0.0.2", "::1", "10.0.0.5")]
    assert urls == ["http://127.0.0.2:9000", "http://[::1]:9000", "http://127.0.0.1:9000"]
    pod1 = DisaggConfig(
        advertise_host="10.0.0.6", tp_size=2, nnodes=2, node_rank=1, dist_init_addr="10.0.0.5:5000", bootstrap_port=9000
    )
    assert leader_url(pod1) == "http://10.0.0.5:9000"

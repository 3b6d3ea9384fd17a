"""The prefill a gateway names (`x-prefiller-host-port`) and the decode's allow-list (`--prefill-allow`)."""

import asyncio

import pytest

from disagg_worker.config import ConfigError
from disagg_worker.request.errors import APIError
from disagg_worker.router.prefiller import AllowList, NameResolver, Prefiller, checked, parse_header


@pytest.mark.parametrize(
    "value,host,port,url",
    [
        ("10.1.2.3:8000", "10.1.2.3", 8000, "http://10.1.2.3:8000"),
        (" Prefill-0.tiny-prefill.ns.svc:8000 ", "prefill-0.tiny-prefill.ns.svc", 8000, None),
        ("[fd00::1]:8000", "fd00::1", 8000, "http://[fd00::1]:8000"),
        ("localhost:1", "localhost", 1, "http://localhost:1"),
    ],
)
def test_a_header_names_a_host_and_a_port(value, host, port, url):
    p = parse_header(value)
    assert (p.host, p.port) == (host, port)
    if url:
        assert p.url == url


@pytest.mark.parametrize(
    "value",
    [
        "10.1.2.3",
        "10.1.2.3:",
        ":8000",
        "10.1.2.3:0",
        "10.1.2.3:65536",
        "10.1.2.3:80x",
        "fd00::1:8000",
        "[x]:80",
        "a b:80",
        "http://10.1.2.3:8000",
        "a/b:80",
        "-bad:80",
        "10.1.2.3:8000,10.1.2.4:8000",
        "",
    ],
)
def test_anything_else_is_a_400_naming_the_header(value):
    with pytest.raises(APIError) as e:
        parse_header(value)
    assert e.value.status == 400 and e.value.param == "x-prefiller-host-port"
    assert "x-prefiller-host-port" in e.value.message


def test_by_default_only_loopback_is_admitted():
    allow = AllowList.parse("")
    assert allow.admits(parse_header("127.0.0.1:8000")) and allow.admits(parse_header("[::1]:8000"))
    assert allow.admits(parse_header("localhost:8000"))
    for other in ("10.0.0.5:8000", "169.254.169.254:80", "example.com:80", "[fd00::1]:80"):
        assert not allow.admits(parse_header(other)), other


def test_networks_names_and_the_wildcard():
    allow = AllowList.parse("10.0.0.0/8, fd00::/8, 192.168.1.7, tiny-prefill.ns.svc.cluster.local.")
    assert allow.admits(parse_header("10.9.8.7:8000")) and allow.admits(parse_header("[fd00::5]:8000"))
    assert allow.admits(parse_header("192.168.1.7:8000")) and not allow.admits(parse_header("192.168.1.8:8000"))
    assert allow.admits(parse_header("tiny-prefill.ns.svc.cluster.local:8000"))
    assert not allow.admits(parse_header("127.0.0.1:8000")), "a list replaces the loopback default"
    assert not allow.admits(parse_header("evil.example:8000"))
    assert AllowList.parse("*").admits(parse_header("anything.example:1"))


def test_an_address_a_listed_name_resolves_to_is_admitted_and_only_then():
    allow = AllowList.parse("tiny-prefill")
    pod = parse_header("10.4.0.9:8000")
    assert not allow.admits(pod)
    assert allow.admits(pod, {"tiny-prefill": frozenset({"10.4.0.9", "10.4.0.10"})})
    assert not allow.admits(parse_header("10.4.0.11:8000"), {"tiny-prefill": frozenset({"10.4.0.9"})})


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "not a name", "1.2.3", "a_b"])
def test_a_bad_entry_stops_the_start_naming_the_flag(entry):
    with pytest.raises(ConfigError, match="--prefill-allow"):
        AllowList.parse(entry)


def test_names_are_resolved_again_only_after_their_ttl():
    now = [0.0]
    resolver = NameResolver(ttl_s=5.0, clock=lambda: now[0])

    async def run() -> list[frozenset[str]]:
        first = (await resolver.addresses(["localhost"]))["localhost"]
        resolver.known["localhost"] = (now[0], frozenset({"10.0.0.1"}))  # what a later answer of DNS would say
        now[0] = 4.0
        cached = (await resolver.addresses(["localhost"]))["localhost"]
        now[0] = 9.5
        again = (await resolver.addresses(["localhost"]))["localhost"]
        return [first, cached, again]

    first, cached, again = asyncio.run(run())
    assert "127.0.0.1" in first and cached == {"10.0.0.1"} and "127.0.0.1" in again


def test_checked_resolves_the_listed_names_for_an_address():
    async def run(value: str, spec: str) -> Prefiller:
        return await checked(value, AllowList.parse(spec), NameResolver())

    assert asyncio.run(run("127.0.0.1:8000", "localhost")).port == 8000
    with pytest.raises(APIError, match="--prefill-allow does not admit"):
        asyncio.run(run("10.200.0.1:8000", "localhost"))

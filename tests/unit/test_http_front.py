"""The HTTP front end's gate, over real sockets in one process: body limits (413 before the body is
read), bodies read before a slot is taken (408 for a stalled upload, a budget of body bytes: 429), the
in-flight bound (429), draining (503 with Retry-After), the drain's cut, 500 bodies."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from disagg_worker.config import DisaggConfig, EngineConfig, Role, SchedulerConfig, ServerArgs
from disagg_worker.http.admission import LEG_HEADER, Admission, admission_middleware, body_of
from disagg_worker.http.drain import drain
from disagg_worker.http.errors import error_middleware
from disagg_worker.request.errors import APIError
from disagg_worker.request.limits import BODY_OVERHEAD_BYTES, body_limit_bytes

LIMIT = 1000


def app_with(admission: Admission, release: asyncio.Event | None = None) -> web.Application:
    """/generate echoes the length of the body it read; with `release`, it holds the request until set."""

    async def generate(request: web.Request) -> web.Response:
        body = body_of(request)
        if release is not None:
            await release.wait()
        return web.json_response({"read": len(body)})

    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("secret internals: /etc/passwd")

    app = web.Application(middlewares=[error_middleware, admission_middleware(admission)])
    app.router.add_post("/generate", generate)
    app.router.add_get("/boom", boom)
    return app


async def raw_exchange(port: int, head: bytes, body_parts: list[bytes] = ()) -> tuple[int, dict, bytes]:
    """Send `head` then `body_parts` (stopping if the server answers first); return status, headers, body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    for part in body_parts:
        writer.write(part)
        try:
            await writer.drain()
        except ConnectionError:
            break
    raw = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    header_block, _, payload = rest.partition(b"\r\n\r\n")
    headers = dict(line.decode().split(": ", 1) for line in header_block.split(b"\r\n") if b": " in line)
    return int(status_line.split()[1]), headers, payload


def run(coro):
    return asyncio.run(coro)


def test_an_announced_oversize_body_is_refused_before_it_is_sent():
    async def go():
        async with TestServer(app_with(Admission(4, lambda: LIMIT))) as srv:
            head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n"
            status, _, body = await raw_exchange(srv.port, head)  # not one byte of the body is sent
            return status, json.loads(body)

    status, body = run(go())
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and str(LIMIT) in body["error"]["message"]


def test_a_chunked_body_is_cut_off_at_the_limit():
    async def go():
        async with TestServer(app_with(Admission(4, lambda: LIMIT))) as srv:
            head = b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            chunk = b"200\r\n" + b"x" * 0x200 + b"\r\n"
            over = await raw_exchange(srv.port, head, [chunk] * 3)  # 1536 bytes, and the stream stays open
            under = await raw_exchange(srv.port, head, [chunk, b"0\r\n\r\n"])
            return over, under

    over, under = run(go())
    assert over[0] == 413
    assert under[0] == 200 and b'"read": 512' in under[2]


def test_a_stalled_upload_holds_no_slot_and_ends_with_408():
    async def go():
        admission = Admission(1, lambda: LIMIT, body_timeout_s=0.5)
        async with TestServer(app_with(admission)) as srv:
            stalled_head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{}"
            stalled = asyncio.create_task(raw_exchange(srv.port, stalled_head))  # 8 bytes never come
            while admission.body_bytes < 2:  # the 2 bytes it sent are counted; the 8 it owes never come
                await asyncio.sleep(0.01)
            full = await raw_exchange(srv.port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            return full, await stalled, admission.body_bytes, admission.inflight

    full, stalled, held, inflight = run(go())
    assert full[0] == 200  # the only slot was free: the stalled upload was not admitted
    assert stalled[0] == 408 and json.loads(stalled[2])["error"]["code"] == "request_timeout"
    assert (held, inflight) == (0, 0)


def test_body_bytes_beyond_the_budget_get_429_until_they_are_released():
    async def go():
        release = asyncio.Event()
        admission = Admission(8, lambda: LIMIT, body_budget=1500)
        async with TestServer(app_with(admission, release)) as srv:
            head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n" + b"x" * 900
            held = asyncio.create_task(raw_exchange(srv.port, head))
            while admission.inflight < 1:
                await asyncio.sleep(0.01)
            refused = await raw_exchange(srv.port, head)
            chunked = b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            part = b"100\r\n" + b"x" * 0x100 + b"\r\n"
            refused_chunked = await raw_exchange(srv.port, chunked, [part, part, part, b"0\r\n\r\n"])
            release.set()
            return refused, refused_chunked, (await held)[0], await raw_exchange(srv.port, head)

    refused, refused_chunked, first, again = run(go())
    assert refused[0] == 429 and "request bodies" in json.loads(refused[2])["error"]["message"]
    assert refused_chunked[0] == 429  # 512 bytes fit beside the 900 held, the next 256 do not
    assert first == 200 and again[0] == 200


def test_requests_beyond_the_inflight_bound_get_429_then_are_admitted_again():
    async def go():
        release = asyncio.Event()
        admission = Admission(2, lambda: LIMIT)
        async with TestServer(app_with(admission, release)) as srv:
            head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
            held = [asyncio.create_task(raw_exchange(srv.port, head)) for _ in range(2)]
            while admission.inflight < 2:
                await asyncio.sleep(0.01)
            refused = await raw_exchange(srv.port, head)
            release.set()
            done = await asyncio.gather(*held)
            again = await raw_exchange(srv.port, head)
            return refused, done, again

    refused, done, again = run(go())
    assert refused[0] == 429 and refused[1]["Retry-After"] == "1"
    assert json.loads(refused[2])["error"]["code"] == "rate_limit_exceeded"
    assert [d[0] for d in done] == [200, 200] and again[0] == 200


def test_a_hand_offs_own_leg_is_let_through_uncounted_and_a_forged_one_is_not():
    """A decode's hand-off sends its decode leg to its own port (`LEG_HEADER`, the process's token): the client's
    request holds the slot, so the leg passes a full gate, and a drain, uncounted, its body still within the limit."""

    async def go():
        release = asyncio.Event()
        admission = Admission(1, lambda: LIMIT)
        async with TestServer(app_with(admission, release)) as srv:
            plain = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
            held = asyncio.create_task(raw_exchange(srv.port, plain))
            while admission.inflight < 1:
                await asyncio.sleep(0.01)
            admission.start_drain()

            def leg(token: str, size: int = 2) -> bytes:
                head = f"POST /generate HTTP/1.1\r\nHost: x\r\n{LEG_HEADER}: {token}\r\nContent-Length: {size}\r\n\r\n"
                return head.encode() + b"{}"

            release.set()  # the legs return at once; the held request too, once its turn comes
            ok = await raw_exchange(srv.port, leg(admission.leg_token))
            forged = await raw_exchange(srv.port, leg("guessed"))
            oversize = await raw_exchange(srv.port, leg(admission.leg_token, LIMIT + 1))
            return ok, forged, oversize, await held

    ok, forged, oversize, held = run(go())
    assert ok[0] == 200 and json.loads(ok[2]) == {"read": 2}
    assert forged[0] == 503  # counted like any other request: the instance drains
    assert oversize[0] == 413 and held[0] == 200


def test_drain_refuses_new_requests_and_waits_for_held_ones():
    async def go():
        release = asyncio.Event()
        admission = Admission(8, lambda: LIMIT)
        async with TestServer(app_with(admission, release)) as srv:
            head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
            held = asyncio.create_task(raw_exchange(srv.port, head))
            while admission.inflight < 1:
                await asyncio.sleep(0.01)
            cuts: list[str] = []

            async def cut(reason: str) -> None:
                cuts.append(reason)

            draining = asyncio.create_task(drain(admission, 10.0, cut))
            await asyncio.sleep(0.05)
            refused = await raw_exchange(srv.port, head)
            assert not draining.done(), "the drain ended while a request was held"
            release.set()
            report = await draining
            return refused, await held, report, cuts

    refused, held, report, cuts = run(go())
    assert refused[0] == 503 and refused[1]["Retry-After"] == "1"
    assert json.loads(refused[2])["error"]["code"] == "draining"
    assert held[0] == 200
    assert (report.held, report.cut, cuts) == (1, 0, [])


def test_drain_timeout_cuts_what_is_left():
    async def go():
        admission = Admission(8, lambda: LIMIT)
        cuts: list[str] = []
        with admission.admitted():

            async def cut(reason: str) -> None:
                cuts.append(reason)

            task = asyncio.create_task(drain(admission, 0.2, cut))
            await asyncio.sleep(0.4)
        return await task, cuts

    report, cuts = run(go())
    assert (report.held, report.cut) == (1, 1)
    assert len(cuts) == 1 and "drain timeout of 0.2 s expired" in cuts[0]


def test_a_500_names_a_log_id_not_the_exception(caplog):
    async def go():
        async with TestServer(app_with(Admission(4, lambda: LIMIT))) as srv:
            return await raw_exchange(srv.port, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")

    with caplog.at_level(logging.ERROR):
        status, _, body = run(go())
    message = json.loads(body)["error"]["message"]
    assert status == 500 and "secret" not in message and "RuntimeError" not in message
    ref = message.split("under id ")[1].rstrip(".")
    assert any(ref in r.getMessage() and r.exc_info for r in caplog.records), "the log holds the id and the traceback"


@pytest.mark.parametrize("context", [2048, 4096, 131072])
def test_the_body_limit_holds_any_prompt_that_fits_the_context(context):
    ids = {"prompt": [151935] * context, "max_tokens": 1, "stop": ["\u4e00" * 1024] * 16}
    escaped_cjk = {"prompt": "\u4e00\u4e8c" * context, "stop": ["\t" * 1024] * 16}  # ~2 tokens per pair
    for body in (ids, escaped_cjk):
        assert len(json.dumps(body).encode()) < body_limit_bytes(context)
    assert body_limit_bytes(context) < 40 * context + BODY_OVERHEAD_BYTES


def test_the_inflight_bound_follows_the_scheduler_limits():
    def args(role: Role, **kw) -> ServerArgs:
        cfg = EngineConfig("m", scheduler=SchedulerConfig(max_running_requests=8), disagg=DisaggConfig(role=role, **kw))
        return ServerArgs(cfg)

    assert args(Role.MONOLITHIC).inflight_limit == 32
    assert args(Role.PREFILL, max_bootstrap_queue=100).inflight_limit == 108
    assert args(Role.DECODE, max_prealloc_queue=50).inflight_limit == 58
    explicit = ServerArgs(EngineConfig("m"), max_inflight_requests=5)
    assert explicit.inflight_limit == 5


def test_one_clients_stalled_uploads_leave_another_client_room():
    """Client "a" holds its share of the body budget in uploads that never finish; client "b"'s request is
    still admitted, and "a"'s next upload is refused (429) naming its share, not the server's budget."""
    admission = Admission(8, lambda: LIMIT, body_budget=4000, client_budget=1500)
    with admission.holding_body("a") as take_a:
        take_a(900)
        with admission.holding_body("a") as take_more:
            take_more(500)
            with pytest.raises(APIError) as refused, admission.holding_body("a") as take_again:
                take_again(200)
            assert refused.value.status == 429 and "This client's" in refused.value.message
            with admission.holding_body("b") as take_b:
                take_b(900)  # another client: admitted beside a's 1400 bytes
                assert admission.client_bytes == {"a": 1400, "b": 900} and admission.body_bytes == 2300
    assert admission.client_bytes == {} and admission.body_bytes == 0


def test_a_clients_share_is_never_less_than_one_whole_body():
    admission = Admission(8, lambda: LIMIT, body_budget=4000, client_budget=100)
    with admission.holding_body("a") as take:
        take(LIMIT)  # a whole body of the largest size is admitted whatever the share
    with admission.holding_body("") as take:  # no key, no share: the budget alone
        take(3 * LIMIT)

"""Bootstrap server of one prefill instance (aiohttp, its own port).

Prefill ranks register with `PUT /route`; decode asks `GET /route?tp_rank=-1&pp_rank=-1`
for the topology (or a given rank for its `{rank_ip, rank_port}`) and heartbeats
`GET /health`. Route queries answer 503 until all `tp_size * pp_size` ranks registered.

An instance with DP attention has `dp_size` attention groups of `tp_size` ranks each (`tp_size` is then
a group's tensor ranks): ranks register with their `dp_rank`, and decode reads one group's topology and
health under `/dp/{k}/route` and `/dp/{k}/health` (a group is, to decode, an instance of its own; the
request names the group, `BootstrapInfo.dp_rank`). `/route` without a group answers only an instance of
one group.
With a token, `/route` needs `Authorization: Bearer <token>` (401 otherwise, fail closed).
Every error is a 4xx/503 with a JSON body `{"error": ...}`.

A registered rank keeps its slot: a registration of the same (tp, pp) under another identity
(control endpoint, transfer session) is refused (409) unless the registered rank is gone. Gone
means nothing listens on its control endpoint any more (the connection is refused), or the new
registration names that same endpoint (only one process can listen on an address, so the old one
released it). A slot that changes hands changes the instance id: decode's heartbeat sees a
restarted instance, and resolves and greets it afresh.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import uuid
from dataclasses import asdict, dataclass, fields

from aiohttp import web

from disagg_worker.config import DisaggConfig
from disagg_worker.disagg.channel import is_loopback

_INT_FIELDS = (
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "rank_port",
    "page_size",
    "start_layer",
    "num_layers",
    "kv_head_start",
    "num_kv_heads",
    "head_nbytes",
    "dp_rank",
    "dp_size",
)
_STR_FIELDS = ("rank_ip", "kv_dtype", "session_id", "kv_kind")
KV_KINDS = ("mha", "mla")


def listen_host(advertise_host: str) -> str:
    """Where a prefill instance's bootstrap server listens: on the loopback address it advertises alone (a local
    run; instances advertising 127.0.0.1 and 127.0.0.2 then share one bootstrap port, as pods do), else on every
    interface (decode comes through the pod's address; NetworkPolicy guards it)."""
    return advertise_host if is_loopback(advertise_host) else "0.0.0.0"


def leader_url(d: DisaggConfig) -> str:
    """The bootstrap server this pod's ranks register with, pod 0's: on pod 0 itself, at the loopback address it
    listens on (`listen_host`; 127.0.0.1 when it listens on every interface)."""
    own = d.node_rank == 0 or not d.dist_init_addr
    host = d.advertise_host if own and is_loopback(d.advertise_host) else d.leader_host
    return f"http://[{host}]:{d.bootstrap_port}" if ":" in host else f"http://{host}:{d.bootstrap_port}"


@dataclass(frozen=True)
class RankRegistration:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    rank_ip: str
    rank_port: int
    page_size: int
    kv_dtype: str
    session_id: str  # transfer-engine session id of this rank
    start_layer: int
    num_layers: int
    # The KV heads this rank holds, by global id: [kv_head_start, kv_head_start + num_kv_heads)
    # (replicated heads are held by several ranks), and the bytes of one head of one token.
    kv_head_start: int
    num_kv_heads: int
    head_nbytes: int
    # The pool's layout (`mem.kv_pool.KVKind`): "mha" (per-head K and V) or "mla" (one latent per token).
    kv_kind: str = "mha"
    # The draft model's KV after the model's layers ("" for none; `KVLayout.draft_kv`).
    draft_kv: str = ""
    # DP attention: this rank's attention group among `dp_size` (tp_rank/tp_size are within the group).
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def kv_heads(self) -> range:
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @property
    def layers(self) -> range:
        return range(self.start_layer, self.start_layer + self.num_layers)

    @classmethod
    def from_json(cls, obj: object) -> RankRegistration:
        """Validate a decoded JSON object; raises ValueError naming the first problem."""
        if not isinstance(obj, dict):
            raise ValueError("body must be a JSON object")
        # A rank of the release before KV layouts were named registers without kv_kind: its pool is per-head.
        obj = {"kv_kind": "mha", "draft_kv": "", "dp_rank": 0, "dp_size": 1, **obj}
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in obj]
        if missing:
            raise ValueError(f"missing fields: {missing}")
        for n in _INT_FIELDS:
            v = obj[n]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{n} must be a non-negative integer")
        for n in _STR_FIELDS:
            if not isinstance(obj[n], str) or not obj[n]:
                raise ValueError(f"{n} must be a non-empty string")
        if not 0 < obj["rank_port"] < 65536:
            raise ValueError("rank_port out of range")
        for n in ("num_kv_heads", "head_nbytes"):
            if obj[n] < 1:
                raise ValueError(f"{n} must be at least 1")
        if not isinstance(obj["draft_kv"], str):
            raise ValueError("draft_kv must be a string")
        if obj["kv_kind"] not in KV_KINDS:
            raise ValueError(f"kv_kind must be one of {', '.join(KV_KINDS)}")
        if obj["dp_size"] < 1 or obj["dp_rank"] >= obj["dp_size"]:
            raise ValueError("dp_rank must be below dp_size (at least 1)")
        return cls(**{n: obj[n] for n in names})

    @property
    def slot(self) -> tuple[int, int, int]:
        return (self.dp_rank, self.tp_rank, self.pp_rank)

    @property
    def where(self) -> str:
        return f"tp={self.tp_rank} pp={self.pp_rank}" + (f" dp={self.dp_rank}" if self.dp_size > 1 else "")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:  # unknown path, wrong method, body too large, ...
        if e.status < 400:
            raise
        return _error(e.status, e.reason or "error")


async def _refuses_connections(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether nothing listens on host:port (refused). A silent or slow endpoint is not known gone."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return False


class _Registry:
    def __init__(self, tp_size: int, pp_size: int, dp_size: int = 1):
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.dp_size = dp_size
        self.instance_id = uuid.uuid4().hex
        self.ranks: dict[tuple[int, int, int], RankRegistration] = {}

    @property
    def expected(self) -> int:
        return self.dp_size * self.tp_size * self.pp_size

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.expected

    def check(self, reg: RankRegistration) -> str:
        """ "" if `reg` fits this instance, else why not."""
        mine, its = (self.tp_size, self.pp_size, self.dp_size), (reg.tp_size, reg.pp_size, reg.dp_size)
        if mine != its:
            return "instance is tp={} pp={} dp={}, rank says tp={} pp={} dp={}".format(*mine, *its)
        if reg.tp_rank >= self.tp_size or reg.pp_rank >= self.pp_size:
            return f"rank {reg.where} outside tp={self.tp_size} pp={self.pp_size}"
        for other in self.ranks.values():
            if (other.page_size, other.kv_dtype) != (reg.page_size, reg.kv_dtype):
                return (
                    f"page_size/kv_dtype {reg.page_size}/{reg.kv_dtype} differ from {other.page_size}/{other.kv_dtype}"
                )
            if other.head_nbytes != reg.head_nbytes:
                return f"head_nbytes {reg.head_nbytes} differs from {other.head_nbytes}"
        return ""

    def holder(self, reg: RankRegistration) -> RankRegistration | None:
        """The rank that holds `reg`'s slot under another identity (None: free, or `reg` itself)."""
        held = self.ranks.get(reg.slot)
        return None if held is None or held == reg else held

    def put(self, reg: RankRegistration) -> None:
        """Take the slot (checked: `check` passed and its holder, if any, is gone)."""
        held = self.ranks.get(reg.slot)
        if held is not None and held != reg:
            self.instance_id = uuid.uuid4().hex  # a rank restarted: decode must resolve it afresh
        self.ranks[reg.slot] = reg

    def group(self, dp: int | None) -> tuple[int, str]:
        """The attention group a query names (None: none named), or an error (status, message)."""
        if dp is None:
            if self.dp_size > 1:
                return 400, (
                    f"this prefill instance runs {self.dp_size} attention groups (DP attention): a request names "
                    "its group (the router sends bootstrap_dp_rank)"
                )
            return 0, ""
        if not 0 <= dp < self.dp_size:
            return 404, f"no attention group {dp}: this prefill instance runs {self.dp_size}"
        return dp, ""

    def topology(self, dp: int) -> dict:
        ranks = [r for slot, r in sorted(self.ranks.items()) if slot[0] == dp]
        return {
            "instance_id": self.instance_id,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "page_size": ranks[0].page_size,
            "kv_dtype": ranks[0].kv_dtype,
            "ranks": [asdict(r) for r in ranks],
        }


async def _gone(held: RankRegistration, new: RankRegistration) -> bool:
    """Whether the rank holding a slot is gone, so that `new` may take it (see the module docstring)."""
    if (held.rank_ip, held.rank_port) == (new.rank_ip, new.rank_port):
        return True
    return await _refuses_connections(held.rank_ip, held.rank_port)


class _Routes:
    """The handlers of one instance's app."""

    def __init__(self, reg: _Registry, token: str):
        self._reg = reg
        self._token = token
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, request: web.Request) -> bool:
        if not self._token:
            return True
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), self._expected)

    async def put_route(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token")
        try:
            body = json.loads(await request.read())
            rank = RankRegistration.from_json(body)
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"bad registration: {e}")
        reg = self._reg
        problem = reg.check(rank)
        held = reg.holder(rank)
        if not problem and held is not None and not await _gone(held, rank):
            problem = (
                f"rank {rank.where} is held by a live rank at {held.rank_ip}:{held.rank_port} "
                f"(session {held.session_id})"
            )
        if not problem and reg.holder(rank) not in (None, held):  # taken by another while we probed
            problem = f"rank {rank.where} was just registered by another rank"
        if problem:
            return _error(409, problem)
        reg.put(rank)
        return web.json_response({"ok": True, "registered": len(reg.ranks), "expected": reg.expected})

    async def get_route(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token")
        try:
            tp = int(request.query.get("tp_rank", "-1"))
            pp = int(request.query.get("pp_rank", "-1"))
            dp, problem = self._reg.group(_dp_of(request))
        except ValueError:
            return _error(400, "tp_rank, pp_rank and the group must be integers")
        if problem:
            return _error(dp, problem)
        reg = self._reg
        if not reg.complete:
            return _error(503, f"{len(reg.ranks)} of {reg.expected} ranks registered")
        if tp == -1 and pp == -1:
            return web.json_response(reg.topology(dp))
        rank = reg.ranks.get((dp, tp, pp))
        if rank is None:
            return _error(404, f"no rank tp={tp} pp={pp} in tp={reg.tp_size} pp={reg.pp_size}")
        return web.json_response({"rank_ip": rank.rank_ip, "rank_port": rank.rank_port})

    async def health(self, request: web.Request) -> web.Response:
        reg = self._reg
        try:
            status, problem = reg.group(_dp_of(request)) if "dp" in request.match_info else (0, "")
        except ValueError:
            status, problem = 400, "the group must be an integer"
        if problem:
            return _error(status, problem)
        body = {"instance_id": reg.instance_id, "registered": len(reg.ranks), "expected": reg.expected}
        return web.json_response(body, status=200 if reg.complete else 503)


def _dp_of(request: web.Request) -> int | None:
    """The attention group a path names (`/dp/{dp}/...`), None for the plain paths."""
    dp = request.match_info.get("dp")
    return None if dp is None else int(dp)


def build_app(tp_size: int = 1, pp_size: int = 1, token: str = "", dp_size: int = 1) -> web.Application:
    """The bootstrap app for an instance of `dp_size` attention groups of `tp_size * pp_size` ranks."""
    if tp_size < 1 or pp_size < 1 or dp_size < 1:
        raise ValueError("tp_size, pp_size and dp_size must be >= 1")
    routes = _Routes(_Registry(tp_size, pp_size, dp_size), token)
    app = web.Application(middlewares=[_json_errors], client_max_size=64 * 1024)
    app.router.add_put("/route", routes.put_route)
    app.router.add_get("/route", routes.get_route)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/dp/{dp}/route", routes.get_route)
    app.router.add_get("/dp/{dp}/health", routes.health)
    return app


class BootstrapServer:
    """The bootstrap app served from a daemon thread of the prefill process."""

    def __init__(
        self, port: int, tp_size: int = 1, pp_size: int = 1, token: str = "", host: str = "0.0.0.0", dp_size: int = 1
    ):
        self._app = build_app(tp_size, pp_size, token, dp_size)
        self._host = host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> BootstrapServer:
        """Bind and serve; returns once the port accepts connections (raises on bind error)."""
        ready: list[BaseException | None] = []
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._serve())
                ready.append(None)
            except BaseException as e:  # reported to the caller of start()
                ready.append(e)
            started.set()
            if ready[0] is None:
                self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"bootstrap-{self.port}", daemon=True)
        self._thread.start()
        started.wait()
        if ready[0] is not None:
            raise ready[0]
        return self

    async def _serve(self) -> None:
        self._runner = web.AppRunner(self._app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the port bound when `port` was 0

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

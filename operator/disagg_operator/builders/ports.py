"""Every port a pod of the model listens on, and who may connect to it.

One table per role, from which the workers' port settings and the NetworkPolicies are both built, so
that what a pod listens on and what the policy opens cannot drift apart. Directions, as the worker makes its
connections:
- router -> prefill and decode HTTP (requests, health checks); any client -> router HTTP (the API).
- decode -> prefill bootstrap (where a rank is, heartbeats) and control (hellos, room requests, aborts).
- prefill -> decode control (room updates).
- prefill -> decode Mooncake ports (RPC: the segment descriptor, and over TCP the KV writes themselves).
- decode -> prefill Mooncake ports: over RDMA the passive side of a handshake (decode) fetches the active
  side's segment descriptor from its RPC port. Over TCP nothing connects there (measured with Mooncake
  0.3.13), but the engine listens all the same, so the window is opened to decode alike.
- prefill and decode -> the kvstore pod (`spec.kvCache.store`): mooncake_master's RPC and HTTP metadata service,
  and mooncake_client's transfer engine (a worker writes its pages into the store pod's memory and reads them
  back, both over connections it opens; the store connects to no worker).
Ranks: a pod runs tp * pp ranks; rank i listens on CONTROL_PORT + i and in its own window of
TRANSFER_PORTS_PER_RANK ports for Mooncake's two (its RPC port and the TCP data port).
"""

from dataclasses import dataclass

from disagg_api import settings as S
from disagg_api.setting import Setting

from .. import names
from ..spec import ModelSpec


@dataclass(frozen=True)
class Listener:
    """Ports `first`..`last` of a role's pods; `peers`: the roles of the same model allowed in (None: anyone)."""

    name: str
    first: int
    last: int
    peers: tuple[str, ...] | None


def ranks(spec: ModelSpec, role: str) -> int:
    w = spec.worker(role)
    return w.tp_size * w.pp_size


def role_listeners(spec: ModelSpec, role: str) -> tuple[Listener, ...]:
    """What a pod of `role` listens on, and who may connect, for this model."""
    http = names.HTTP_PORT
    if role == names.KVSTORE:
        rpc, metadata, (first, last) = names.KVSTORE_RPC_PORT, names.KVSTORE_METADATA_PORT, names.KVSTORE_TRANSFER_PORTS
        return (
            Listener("rpc", rpc, rpc, names.WORKER_ROLES),
            Listener("metadata", metadata, metadata, names.WORKER_ROLES),
            Listener("transfer", first, last, names.WORKER_ROLES),
        )
    if role == names.ROUTER:
        return (Listener("http", http, http, None),)
    peer = names.DECODE if role == names.PREFILL else names.PREFILL
    out = [Listener("http", http, http, (names.ROUTER,))]
    if role == names.PREFILL:
        out.append(Listener("bootstrap", names.BOOTSTRAP_PORT, names.BOOTSTRAP_PORT, (names.DECODE,)))
    if spec.transfer.backend == "mooncake":  # the fake backend moves nothing and listens on nothing more
        n = ranks(spec, role)
        out.append(Listener("control", names.CONTROL_PORT, names.CONTROL_PORT + n - 1, (peer,)))
        last = names.TRANSFER_PORT_BASE + n * names.TRANSFER_PORTS_PER_RANK - 1
        out.append(Listener("transfer", names.TRANSFER_PORT_BASE, last, (peer,)))
    return tuple(out)


def port_settings(spec: ModelSpec, role: str) -> list[tuple[Setting, int]]:
    """The worker settings that put its control channel and Mooncake engines where `role_listeners` says."""
    by_name = {listener.name: listener for listener in role_listeners(spec, role)}
    if "control" not in by_name:
        return []
    return [
        (S.CONTROL_PORT, by_name["control"].first),
        (S.TRANSFER_PORT_BASE, by_name["transfer"].first),
        (S.TRANSFER_PORTS_PER_RANK, names.TRANSFER_PORTS_PER_RANK),
    ]

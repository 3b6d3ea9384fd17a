"""Where a worker listens: the control channel on its configured port per rank, Mooncake in its rank's
window, and start-up refusing settings that cannot work."""

from __future__ import annotations

import argparse
import socket

import pytest

from disagg_worker.cli_args import add_disagg_args, add_engine_args, server_args_from_cli
from disagg_worker.config import ConfigError, DisaggConfig, Role
from disagg_worker.disagg.channel import ControlChannel
from disagg_worker.disagg.messages import RoomAbort
from disagg_worker.disagg.mooncake.environ import mooncake_environ
from disagg_worker.env import load_env


def disagg(*argv: str, environ: dict[str, str] | None = None) -> DisaggConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_disagg_args(p)
    return server_args_from_cli(
        p.parse_args(["--model", "m", *argv]), Role.PREFILL, load_env(environ or {})
    ).engine.disagg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_rank_has_its_own_control_port_and_mooncake_window():
    cfg = disagg("--tp-size", "2", "--pp-size", "2", "--control-port", "9000", "--transfer-port-base", "15000")
    ranks = [cfg.rank_index(tp, pp) for pp in range(2) for tp in range(2)]
    assert ranks == [0, 1, 2, 3]
    assert [cfg.control_port_of(r) for r in ranks] == [9000, 9001, 9002, 9003]
    assert [cfg.transfer_ports_of(r) for r in ranks] == [(15000, 15007), (15008, 15015), (15016, 15023), (15024, 15031)]
    env = mooncake_environ(cfg, rank=3)
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("15024", "15031")


def test_without_configured_ports_any_free_port_and_mooncakes_own_range_apply():
    cfg = disagg()
    assert cfg.control_port_of(0) == 0 and cfg.transfer_ports_of(0) is None
    assert "MC_MIN_RPC_PORT" not in mooncake_environ(cfg)


def test_rdma_engines_get_their_window_too_since_the_handshake_uses_the_rpc_port():
    cfg = disagg("--transfer-protocol", "rdma", "--transfer-port-base", "20000", "--transfer-ports-per-rank", "4")
    assert mooncake_environ(cfg) == {"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": "20003"}


def test_an_address_others_reach_with_the_models_secret_starts(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s")
    assert disagg("--advertise-host", "10.1.2.3", "--auth-token-file", str(secret)).advertise_host == "10.1.2.3"
    assert disagg("--advertise-host", "::1").advertise_host == "::1"


@pytest.mark.parametrize(
    "argv,environ,message",
    [
        (["--transfer-port-base", "15000"], {"MC_MIN_RPC_PORT": "16000"}, "keep one of the two"),
        (["--transfer-ports-per-rank", "1"], {}, "at least 2"),
        (["--control-port", "80"], {}, "--control-port 80"),
        (["--advertise-host", "10.1.2.3"], {}, "--advertise-host 10.1.2.3 is reachable from other hosts"),
        (["--device", "cuda"], {}, "the installed Mooncake build (mooncake-transfer-engine-non-cuda) cannot read"),
        (["--advertise-host", "decode-0.decode"], {}, "pass the model's secret (--auth-token-file)"),
        (["--tp-size", "4", "--transfer-port-base", "65530"], {}, "the 32 port(s) of 4 rank(s)"),
    ],
)
def test_port_settings_that_cannot_work_stop_start_up(argv, environ, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        disagg(*argv, environ=environ)


def test_the_control_channel_listens_on_its_configured_port_on_the_advertised_address():
    port = free_port()
    a = ControlChannel("127.0.0.1", port)
    try:
        assert a.endpoint == f"tcp://127.0.0.1:{port}"
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            ControlChannel("127.0.0.1", port)
        b = ControlChannel("127.0.0.1")
        try:
            assert b.send(a.endpoint, RoomAbort(decode_id="d", room=1, reason="x")) and b.peers == 1
            got = a.recv(timeout_ms=5000)
            assert got == [RoomAbort(decode_id="d", room=1, reason="x")]
            b.forget(a.endpoint)
            assert b.peers == 0
        finally:
            b.close()
    finally:
        a.close()

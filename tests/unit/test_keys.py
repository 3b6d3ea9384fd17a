"""Secrets at start-up: read from files, never from the environment, never printed; an empty one stops
start-up; each use of the model's shared secret has its own derived key; bootstrap targets are signed."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from disagg_worker import cli, keys
from disagg_worker.cli_args import add_disagg_args, add_engine_args, server_args_from_cli
from disagg_worker.config import Role
from disagg_worker.router.args import add_router_args
from disagg_worker.router.auth import RouterAuth
from disagg_worker.router.payload import SharedBody


def parse(role: Role, *argv: str):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    if role is not Role.MONOLITHIC:
        add_disagg_args(p)
    return server_args_from_cli(p.parse_args(["--model", "m", *argv]), role, None)


def test_the_shared_secret_comes_from_its_file_reaches_the_config_and_is_never_printed(tmp_path, monkeypatch):
    secret = tmp_path / "token"
    secret.write_text(" s3cret \n")
    monkeypatch.setenv("DISAGG_AUTH_TOKEN", "from-the-environment")  # no longer read
    args = parse(Role.PREFILL, "--auth-token-file", str(secret))
    cfg = args.engine.disagg
    assert cfg.auth_token == "s3cret"
    assert "s3cret" not in repr(args) and "s3cret" not in repr(cfg)
    assert parse(Role.DECODE).engine.disagg.auth_token == ""


def test_api_keys_come_from_the_flag_and_the_file_one_a_line(tmp_path):
    f = tmp_path / "keys"
    f.write_text("k1\n\n  k2  \n")
    args = parse(Role.MONOLITHIC, "--api-key", "k0", "--api-key-file", str(f))
    assert args.api_keys == ("k0", "k1", "k2")
    assert "k1" not in repr(args)
    assert parse(Role.MONOLITHIC).api_keys == ()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["prefill", "--auth-token-file", "{empty}"], "--auth-token-file {empty} is empty"),
        (["decode", "--auth-token-file", "{missing}"], "--auth-token-file {missing}: cannot read it"),
        (["serve", "--api-key", ""], "--api-key is empty"),
        (["serve", "--api-key-file", "{empty}"], "--api-key-file {empty} is empty"),
        (["router", "--api-key-file", "{blank}"], "--api-key-file {blank} is empty"),
        (["router", "--auth-token-file", "{empty}"], "--auth-token-file {empty} is empty"),
    ],
)
def test_auth_asked_for_with_an_empty_or_missing_key_stops_start_up(tmp_path, argv, message):
    files = {"empty": tmp_path / "empty", "blank": tmp_path / "blank", "missing": tmp_path / "missing"}
    files["empty"].write_text("")
    files["blank"].write_text("\n  \n")
    argv = [a.format(**files) for a in argv]
    if argv[0] != "router":
        argv += ["--model", "/nonexistent"]  # start-up must stop before the model is looked at
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(argv) == 2
    assert message.format(**files) in err.getvalue()


def test_each_use_of_the_secret_has_its_own_key():
    derived = {keys.derive("s3cret", p) for p in (keys.BOOTSTRAP, keys.WORKER, keys.TARGET)}
    assert len(derived) == 3 and "s3cret" not in derived
    assert keys.derive("other", keys.WORKER) not in derived


def test_a_target_signature_covers_host_port_and_room_under_one_key():
    sig = keys.sign_target("k", "10.0.0.7", 8998, 42)
    assert keys.target_signed("k", "10.0.0.7", 8998, 42, sig)
    for host, port, room in [("10.0.0.8", 8998, 42), ("10.0.0.7", 8999, 42), ("10.0.0.7", 8998, 43)]:
        assert not keys.target_signed("k", host, port, room, sig)
    assert not keys.target_signed("other", "10.0.0.7", 8998, 42, sig)
    assert not keys.target_signed("k", "10.0.0.7", 8998, 42, "")


def test_the_router_replaces_what_a_client_says_about_targets_and_signs_its_own(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cret")
    p = argparse.ArgumentParser()
    add_router_args(p)
    auth = RouterAuth.from_cli(p.parse_args(["--auth-token-file", str(secret)]))
    body = {"prompt": "x", "bootstrap_host": "evil", "bootstrap_port": 1, "bootstrap_sig": "forged"}
    routed = json.loads(SharedBody.of(body).payload(**auth.target("10.0.0.7", 8998, 5)).decode())
    assert routed["prompt"] == "x" and (routed["bootstrap_host"], routed["bootstrap_port"]) == ("10.0.0.7", 8998)
    target_key = keys.derive("s3cret", keys.TARGET)
    assert keys.target_signed(target_key, "10.0.0.7", 8998, 5, routed["bootstrap_sig"])
    assert auth.worker_headers() == {"Authorization": f"Bearer {keys.derive('s3cret', keys.WORKER)}"}
    unsigned = json.loads(SharedBody.of(body).payload(**RouterAuth().target("10.0.0.7", 8998, 5)).decode())
    assert "bootstrap_sig" not in unsigned and RouterAuth().worker_headers() == {}

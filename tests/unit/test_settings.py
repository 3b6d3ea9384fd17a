"""Each engine setting is declared once (`disagg_api.settings`): the engine commands' flags and their --help, the
configuration chain's fields and defaults, and SGLang's flags for the same settings all come from it."""

import argparse
import re
from dataclasses import fields

import pytest

from disagg_api import settings as S
from disagg_api import tier_settings as T
from disagg_api.setting import Setting, command_line
from disagg_worker.cli import build_parser
from disagg_worker.cli_args import server_args_from_cli
from disagg_worker.config import (
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    Role,
    SchedulerConfig,
    ServerArgs,
    SpeculativeConfig,
)
from disagg_worker.env import load_env
from disagg_worker.flags import NEGATED, SETTING, fill, settings_of
from disagg_worker.lora_config import LoraConfig
from disagg_worker.tier_config import TierConfig

DECLARED = [v for module in (S, T) for v in vars(module).values() if isinstance(v, Setting)]
CHAIN = (ServerArgs, EngineConfig, CacheConfig, TierConfig, SchedulerConfig, SpeculativeConfig, DisaggConfig)
CHAIN += (LoraConfig,)
# What no field holds as it is: files read at start-up, and --kv-dtype (which falls back to --dtype).
READ_AT_START_UP = {S.API_KEY, S.API_KEY_FILE, S.AUTH_TOKEN_FILE, S.KV_DTYPE}
COMMANDS = {"serve": (Role.MONOLITHIC, S.ENGINE), "prefill": (Role.PREFILL, S.ENGINE + S.DISAGG)}
COMMANDS["decode"] = (Role.DECODE, S.ENGINE + S.DISAGG)


def subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def chain(argv: list[str]) -> ServerArgs:
    return server_args_from_cli(parse(argv), COMMANDS[argv[0]][0], load_env({}))


def test_every_setting_is_declared_once_in_one_group():
    flags = [s.flag for s in S.ENGINE + S.DISAGG]
    assert len(flags) == len(set(flags)) == len(DECLARED)
    assert set(S.ENGINE + S.DISAGG) == set(DECLARED)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_each_setting_with_its_help_in_declaration_order_and_no_sglang_flag(command):
    text = subparser(command).format_help().split("options:", 1)[1]
    settings = COMMANDS[command][1]
    positions = [re.search(rf"^  {s.flag}\b", text, re.M).start() for s in settings]
    assert positions == sorted(positions)
    flat = "".join(text.split())  # its lines may break at a hyphen as well as at a space
    assert all("".join(s.help.split()) in flat for s in settings)
    hidden = [s.sglang for s in settings if s.accepts_sglang]
    assert hidden and not any(flag in text for flag in hidden)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_flag_left_out_takes_its_declared_default_in_the_parser_and_in_the_configuration(command):
    role, settings = COMMANDS[command]
    ns = parse([command, "--model", "m"])
    assert {s.flag: getattr(ns, s.dest) for s in settings if not s.required} == {
        s.flag: s.default for s in settings if not s.required
    }
    args = server_args_from_cli(ns, role, load_env({}))
    e = args.engine
    for obj in (args, e, e.cache, e.cache.tiers, e.scheduler, e.scheduler.speculative, e.disagg, e.lora):
        for f in fields(obj):
            s = f.metadata.get(SETTING)
            if s is not None and not s.required:
                assert getattr(obj, f.name) == ((not s.default) if f.metadata[NEGATED] else s.default), f.name


@pytest.mark.parametrize("cls", CHAIN)
def test_a_field_a_flag_fills_has_the_type_its_setting_parses_to(cls):
    names = {int: "int", float: "float", bool: "bool"}
    for f in fields(cls):
        s = f.metadata.get(SETTING)
        if s is not None:
            assert f.type == ("tuple[str, ...]" if s.repeated else names.get(s.type, "str")), f.name


def test_every_setting_fills_one_field_of_the_chain_or_is_read_at_start_up():
    filled = [s for cls in CHAIN for s in settings_of(cls).values()]
    assert len(filled) == len(set(filled)), "a setting fills one field"
    assert set(filled) | READ_AT_START_UP == set(DECLARED) and not set(filled) & READ_AT_START_UP


def test_a_flag_reaches_its_field():
    e = chain(["decode", "--model", "m", "--page-size", "32", "--disable-prefix-cache", "--kv-dtype", "float16"]).engine
    assert (e.cache.page_size, e.cache.enable_prefix_cache, e.cache.kv_dtype) == (32, False, "float16")
    e = chain(["serve", "--model", "m", "--dtype", "bfloat16", "--speculative-algorithm", "ngram"]).engine
    assert (e.cache.kv_dtype, e.scheduler.speculative.algorithm) == ("bfloat16", "NGRAM")


def test_sglangs_flag_for_the_same_setting_gives_the_same_configuration():
    ours = ["--disable-prefix-cache", "--disable-overlap", "--seed", "3", "--max-context-len", "64"]
    ours += ["--transfer-backend", "fake", "--ib-device", "mlx5_0", "--bootstrap-port", "9100", "--decode-prefix-cache"]
    sglang = ["--disable-radix-cache", "--disable-overlap-schedule", "--random-seed", "3", "--context-length", "64"]
    sglang += ["--disaggregation-transfer-backend", "fake", "--disaggregation-ib-device", "mlx5_0"]
    sglang += ["--disaggregation-bootstrap-port", "9100", "--disaggregation-decode-enable-radix-cache"]
    sglang += ["--enable-disagg-layer-pipeline"]  # on by default here: SGLang's switch to turn it on changes nothing
    assert {a for a in sglang if a.startswith("--")} == {s.sglang for s in DECLARED if s.accepts_sglang}
    theirs = chain(["decode", "--model", "m", *sglang])
    assert theirs == chain(["decode", "--model", "m", *ours]) != chain(["decode", "--model", "m"])


def test_layer_wise_streaming_is_on_unless_disabled_and_sglangs_switch_turns_it_on():
    def on(*words: str) -> bool:
        return chain(["prefill", "--model", "m", *words]).engine.disagg.layer_pipeline

    assert on() and on("--enable-disagg-layer-pipeline") and not on("--disable-disagg-layer-pipeline")
    assert on("--disable-disagg-layer-pipeline", "--enable-disagg-layer-pipeline")  # the last word wins


@pytest.mark.parametrize("flag", [S.CHUNK_SIZE.sglang, S.KV_DTYPE.sglang])
def test_sglangs_flag_is_refused_where_its_values_mean_something_else_here(flag, capsys):
    with pytest.raises(SystemExit):
        parse(["serve", "--model", "m", flag, "-1"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_a_repeated_setting_takes_several_words_and_several_uses():
    words = ["--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z", "--max-loras", "3"]
    ns = parse(["serve", "--model", "m", *words])
    lora = fill(LoraConfig, ns, S.ENGINE)
    assert lora.adapters == [("a", "/x"), ("b", "/y"), ("c", "/z")] and lora.max_loras == 3
    assert parse(["serve", "--model", "m"]).lora_modules == ()  # each parse its own: nothing left from the last
    assert command_line([(S.LORA_MODULES, ("a=/x", "b=/y"))]) == ["--lora-modules", "a=/x", "--lora-modules", "b=/y"]


def test_a_command_line_sets_each_setting_and_a_switch_only_when_on():
    words = command_line([(S.PAGE_SIZE, 64), (S.DECODE_PREFIX_CACHE, False), (S.LOCAL_PREFILL, True), (S.KV_DTYPE, "")])
    assert words == ["--page-size", "64", "--local-prefill", "--kv-dtype", ""]
    ns = parse(["decode", "--model", "m", *words])
    assert (ns.page_size, ns.decode_prefix_cache, ns.local_prefill) == (64, False, True)


def test_the_routers_flags_come_from_its_declaration_and_its_policies_are_the_declared_ones():
    from disagg_api import router_settings as R
    from disagg_worker.router.policies import Policy
    from disagg_worker.router.worker import GroupPolicy

    router = subparser("router")
    flags = {s for a in router._actions for s in a.option_strings if s.startswith("--")}
    assert {s.flag for s in R.ROUTER_HEAD + R.ROUTER} | {"--prefill", "--decode", "--help"} == flags
    assert {p.value for p in Policy} == set(R.POLICIES) and {g.value for g in GroupPolicy} == set(R.GROUP_POLICIES)
    ns = router.parse_args(command_line([(R.MIGRATION_LIMIT, 0), (R.POLICY, "cache_aware"), (S.PORT, 9)]))
    assert (ns.migration_limit, ns.policy, ns.port, ns.retries) == (0, "cache_aware", 9, R.RETRIES.default)

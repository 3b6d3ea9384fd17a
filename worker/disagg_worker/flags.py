"""The engine commands' flags and the configuration fields they fill, both made from `disagg_api.settings`.

A field of the configuration chain (`config.py`) names the setting it comes from with `from_flag(S.PAGE_SIZE)`,
which gives it that setting's default too; `add_flags` puts the settings on a parser; `fill` builds one dataclass
of the chain from the parsed flags. What is not a flag's value as it is (a file's contents, the environment,
another dataclass of the chain) is handed to `fill` by whoever builds the chain (`cli_args.server_args_from_cli`).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Iterable, Mapping
from dataclasses import field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from disagg_api.setting import Setting

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    Config = TypeVar("Config", bound=DataclassInstance)

SETTING = "disagg.setting"  # a field's metadata: the setting it comes from
NEGATED = "disagg.negated"  # ... and whether it holds that switch's opposite
EMPTY = '""'  # how --help writes the empty value of a setting whose values it lists


def from_flag(setting: Setting, *, negated: bool = False) -> Any:
    """A config field filled from `setting`, with its default (none for a required one); `negated`: the opposite
    of a switch (`enable_prefix_cache` from `--disable-prefix-cache`)."""
    meta = {SETTING: setting, NEGATED: negated}
    if setting.required:
        return field(metadata=meta)
    return field(default=(not setting.default) if negated else setting.default, metadata=meta)


def add_flags(
    p: argparse.ArgumentParser, settings: Iterable[Setting], values: Mapping[Setting, Mapping[str, str]] | None = None
) -> None:
    """One flag per setting, in order; also SGLang's flag where the setting takes it, not listed in --help.

    `values`: the choices of a setting whose values the worker declares rather than `disagg_api` (`--quantization`:
    the registry of weight formats, `model.formats`), each with its help, which --help lists after the setting's."""
    for s in settings:
        options = _options(s, (values or {}).get(s, {}))
        p.add_argument(s.flag, **options)
        if s.accepts_sglang and s.sglang != s.flag:
            options = {**options, "dest": s.dest, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
            if s.sglang_negates:
                options["action"] = "store_false"
            p.add_argument(s.sglang, **options)


def _options(s: Setting, values: Mapping[str, str]) -> dict[str, Any]:
    listed = [f"{value or EMPTY}: {meaning}" for value, meaning in values.items()]
    help_ = ". ".join(part for part in (s.help, *listed) if part) or None
    if s.switch:
        return {"action": "store_true", "help": help_}
    if s.repeated:
        return {"action": _Extend, "nargs": "+", "default": s.default, "help": help_, "metavar": s.dest.upper()}
    options: dict[str, Any] = {"default": s.default, "help": help_}
    if s.type is not str:
        options["type"] = s.type
    if s.choices or values:
        options["choices"] = list(values or s.choices)
    if s.required:
        options["required"] = True
    return options


class _Extend(argparse.Action):
    """A repeated setting's words, each use adding to one tuple (argparse's own `extend` appends to a list,
    which would be the default's: shared by every parse)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, (*getattr(namespace, self.dest), *values))


def fill(cls: type[Config], ns: argparse.Namespace, settings: Collection[Setting], **given: Any) -> Config:
    """`cls` with every field whose setting is among `settings` (the command's) taken from `ns`, and `given`: a
    field whose setting the command does not take keeps its default."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        s = f.metadata.get(SETTING)
        if s is not None and s in settings:
            value = getattr(ns, s.dest)
            values[f.name] = (not value) if f.metadata[NEGATED] else value
    return cls(**values, **given)


def settings_of(cls: type[DataclassInstance]) -> dict[str, Setting]:
    """The settings `cls`'s fields come from, by field name."""
    return {f.name: f.metadata[SETTING] for f in fields(cls) if SETTING in f.metadata}

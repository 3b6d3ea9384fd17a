"""One setting of the engine commands, and how a command line sets it (`settings` declares them all)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """One flag of the engine commands. `type` turns its word into its value; bool: a switch, on when present."""

    flag: str
    type: Callable[[str], Any] = str
    default: Any = ""
    help: str = ""
    choices: tuple[str, ...] = ()
    required: bool = False
    sglang: str = ""  # SGLang's flag for the same setting ("": SGLang has none)
    accepts_sglang: bool = False  # the worker takes `sglang` too: its values mean the same here
    sglang_negates: bool = False  # a switch whose `sglang` turns on what this flag turns off (on by default here)
    # Takes one or more words and may be given again, each adding to a tuple (`--lora-modules a=p b=q`, vLLM's way).
    repeated: bool = False

    @property
    def dest(self) -> str:
        """The name argparse stores its value under."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def switch(self) -> bool:
        return self.type is bool

    def args(self, value: Any) -> list[str]:
        """The command-line words that set it to `value` (a switch: its flag when `value` is true, else none)."""
        if self.switch:
            return [self.flag] if value else []
        if self.repeated:
            return [word for item in value for word in (self.flag, str(item))]
        return [self.flag, str(value)]


def command_line(values: Iterable[tuple[Setting, Any]]) -> list[str]:
    """The words that set each setting to its value, in the order given."""
    return [word for setting, value in values for word in setting.args(value)]

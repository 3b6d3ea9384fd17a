"""The router's command line (`disagg router`), made from its settings' declaration
(`disagg_api.router_settings`); only the static worker lists are spelled here."""

from __future__ import annotations

import argparse

from disagg_api import router_settings as R
from disagg_worker.flags import add_flags


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, R.ROUTER_HEAD)
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill instance and its bootstrap port (repeatable)",
    )
    p.add_argument("--decode", nargs=1, action="append", metavar="URL", help="a decode instance (repeatable)")
    add_flags(p, R.ROUTER)

"""The endpoint picker's command line (`disagg epp`), made from its settings' declaration
(`disagg_api.epp_settings`); only the static lists (endpoints, prefills) are spelled here."""

from __future__ import annotations

import argparse

from disagg_api import epp_settings as E
from disagg_worker.flags import add_flags


def add_epp_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, E.EPP_HEAD)
    p.add_argument(
        "--endpoint",
        action="append",
        metavar="URL",
        help="an instance that takes client traffic, http://IP:PORT (repeatable; with or instead of --endpoint-dns)",
    )
    p.add_argument(
        "--prefill",
        action="append",
        metavar="URL",
        help="a prefill instance, http://IP:PORT (repeatable; with or instead of --prefill-dns): P/D mode, the "
        "endpoints are decodes and each request names its prefill in x-prefiller-host-port",
    )
    add_flags(p, E.EPP)

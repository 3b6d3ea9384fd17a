"""The coordinated rollout planner, driven through whole rollouts against a simulated StatefulSet controller."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_operator.observe import PodInfo, RoleObservation
from disagg_operator.rollout import max_skew, plan_rollout, progressing_condition, rollout_status, with_leader_counts
from disagg_operator.spec import ModelSpec

OLD, NEW = "hash-old", "hash-new"


def spec(prefill: int, decode: int, **rollout) -> ModelSpec:
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
    """A StatefulSet and its pods: pods at or above the partition move to the new template, one per tick, and a
    new pod becomes Ready `ready_after` seconds after it is created (kwok does it at once)."""

    role: str
    replicas: int
    template: str = OLD
    partition: int = 0
    pods: dict[int, tuple[str, float | None]] = field(default_factory=dict)
    ready_after: float = 1.0

    def __post_init__(self) -> None:
        self.pods = {i: (OLD, 0.0) for i in range(self.replicas)}

    def apply(self, template: str, partition: int) -> None:
        self.template, self.partition = template, partition

    def tick(self, now: float) -> None:
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
        done = updated == self.replicas and self.partition == 0
        obs = RoleObservation(
            self.replicas,
            sum(p.ready_since is not None for p in pods),
            updated,
            partition=self.partition,
            template_hash=self.template,
            current_revision=self.template if done else OLD,
            update_revision=self.template,
        )
        return obs, pods

    def updated_fraction(self) -> float:
        return sum(rev == self.template for rev, _ in self.pods.values()) / self.replicas


def roll(s: ModelSpec, ready_after: float = 1.0, max_ticks: int = 400) -> list[tuple[float, float]]:
    """Run a rollout of both roles to the end; returns (prefill, decode) updated fractions at every tick."""
    sets = {r: FakeSet(r, s.replicas(r), ready_after=ready_after) for r in ("prefill", "decode")}
    samples, now = [], 0.0
    for _ in range(max_ticks):
        observed, pods = {}, []
        for r, fs in sets.items():
            observed[r], role_pods = fs.observe(now)
            pods += role_pods
        plan = plan_rollout(s, observed, pods, {"prefill": NEW, "decode": NEW}, now)
        for r, fs in sets.items():
            fs.apply(NEW, plan.partitions[r])
            fs.tick(now)
        samples.append((sets["prefill"].updated_fraction(), sets["decode"].updated_fraction()))
        if not plan.active and now > 0:
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
    assert counted == {"prefill": prefill, "decode": RoleObservation(2, 2, 1, template_hash=NEW, update_revision=NEW),
                       "router": None}  # fmt: skip
    pods[0] = PodInfo("m-decode-group-0", "decode", ready_since=0.0, revision=NEW, terminating=True)
    assert with_leader_counts(s, {"decode": lagging}, pods)["decode"].updated == 1  # a leader on its way out
    pods[0] = PodInfo("m-decode-group-0", "decode", ready_since=9.0, revision=NEW)
    assert with_leader_counts(s, {"decode": lagging}, pods)["decode"].updated == 2
    assert with_leader_counts(s, {"decode": lagging}, [])["decode"].updated == 2  # no pods observed: LWS's count
    # LWS's own count still bounds it (a group whose other pods it has not replaced yet).
    assert with_leader_counts(s, {"decode": replace(lagging, updated=1)}, pods)["decode"].updated == 1

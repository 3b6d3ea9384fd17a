"""Day two on a real API server: coordinated P/D rollouts in place and with a surge (sampled on every StatefulSet
change), a stalled rollout, a surge that finds no node, scaling prefill through its RoleScaler and with
prefillPerDecode, labels and defaults, drain settings, the HPA example.

kwok plays the kubelets: new pods become Ready at once, and its chaos stage fails pods labelled for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import yaml
from test_operator_support import (
    EXAMPLES,
    POLL_S,
    OperatorUnderTest,
    apply_cr,
    condition,
    events_for,
    install_chart,
    kube_timeout,
    load_example,
    scaled,
    wait_until,
)

from disagg_operator.config import OperatorConfig
from disagg_operator.observe import parse_time

CHAOS = "pod-container-running-failed.stage.kwok.x-k8s.io"
TICK_S = OperatorConfig().tick_s  # the operator's clock, as the chart runs it


@pytest.fixture(scope="module")
def operator(kube_cluster, tmp_path_factory):
    install_chart(kube_cluster)
    op = OperatorUnderTest(kube_cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    op.stop()


def tiny(prefill: int, decode: int, **spec) -> dict:
    cr = load_example("dm-cpu-tcp.yaml")
    cr["spec"]["prefill"]["replicas"], cr["spec"]["decode"]["replicas"] = prefill, decode
    for role in ("prefill", "decode"):
        cr["spec"][role].pop("resources", None)  # kwok nodes have room; keep scheduling trivial
    cr["spec"].update(spec)
    return cr


def wait_ready(cluster, namespace: str, name: str = "tiny", timeout: float = 120) -> None:
    cluster.kubectl(
        "-n", namespace, "wait", "--for=condition=Ready", f"dm/{name}", f"--timeout={kube_timeout(timeout)}"
    )


class SetWatcher:
    """Every change of the namespace's StatefulSets, as the API server streams them (no sample is missed)."""

    def __init__(self, cluster, namespace: str):
        from kubernetes import client, watch

        self.api = client.AppsV1Api(cluster.api_client())
        self.watch = watch.Watch()
        self.namespace = namespace
        self.latest: dict[str, dict] = {}
        self.samples: list[dict[str, dict]] = []
        self.stopping = False
        self._listed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SetWatcher:
        """Start watching; returns once the watch has listed both StatefulSets, so no later change is missed."""
        self._thread.start()
        if not self._listed.wait(scaled(30)):
            raise TimeoutError(f"the watch listed {sorted(self.latest)} of the two StatefulSets")
        return self

    def __exit__(self, *exc) -> None:
        self.stopping = True
        self.watch.stop()
        self._thread.join(10)

    def _run(self) -> None:
        try:
            self._follow()
        except Exception:  # the stream is cut when the test stops watching
            if not self.stopping:
                raise

    def _follow(self) -> None:
        stream = self.watch.stream(
            self.api.list_namespaced_stateful_set, self.namespace, timeout_seconds=int(scaled(300))
        )
        for event in stream:
            sts = event["object"]
            role = sts.metadata.labels["disagg.dev/role"]
            self.latest[role] = {
                "replicas": sts.spec.replicas,
                "ready": sts.status.ready_replicas or 0,
                "partition": sts.spec.update_strategy.rolling_update.partition,
                "updated": sts.status.updated_replicas or 0,
                "current": (sts.status.observed_generation or 0) >= sts.metadata.generation,
                "image": sts.spec.template.spec.containers[0].image,
            }
            if len(self.latest) == 2:
                self.samples.append({r: dict(v) for r, v in self.latest.items()})
                self._listed.set()


def rollout_samples(samples: list[dict[str, dict]], image: str) -> Iterator[tuple[float, float]]:
    """(prefill, decode) fractions of pods on the new template, at each change where both controllers have seen
    the new template (until then a StatefulSet's counts describe the old one)."""
    for s in samples:
        if all(r["image"] == image and r["current"] for r in s.values()):
            yield s["prefill"]["updated"] / s["prefill"]["replicas"], s["decode"]["updated"] / s["decode"]["replicas"]


@pytest.mark.parametrize("prefill,decode", [(2, 4), (1, 1)])
def test_an_image_change_in_place_rolls_decode_first_within_the_skew_bound(
    kube_cluster, operator, namespace, prefill, decode
):
    in_place = {"maxSurge": 0}
    apply_cr(kube_cluster, namespace, tiny(prefill, decode, rollout=in_place))
    wait_ready(kube_cluster, namespace)
    image = "ghcr.io/disagg/worker:0.2.0"
    with SetWatcher(kube_cluster, namespace) as watcher:
        apply_cr(kube_cluster, namespace, tiny(prefill, decode, image=image, rollout=in_place))

        def finished() -> bool:
            dm = kube_cluster.get("-n", namespace, "dm", "tiny")
            ready = next(c for c in dm["status"]["conditions"] if c["type"] == "Ready")["status"] == "True"
            return (
                ready
                and dm["status"]["observedGeneration"] == dm["metadata"]["generation"]
                and "rollout" not in dm["status"]
            )

        wait_until(finished, 120, interval=POLL_S, what="the rollout to finish and the model to be Ready")
        # The operator saw the end through its own watch; this one streams the same changes on its own time.
        wait_until(
            lambda: list(rollout_samples(watcher.samples[-1:], image)) == [(1.0, 1.0)],
            30,
            what="the watch to see the rollout end",
        )
    fractions = list(rollout_samples(watcher.samples, image))
    bound = 1 / min(prefill, decode)  # one pod's worth of the smaller role
    assert fractions and fractions[-1] == (1.0, 1.0), watcher.samples[-3:]
    assert all(abs(p - d) <= bound + 1e-9 for p, d in fractions), fractions
    assert all(d >= p for p, d in fractions), f"decode leads: {fractions}"
    first = next((p, d) for p, d in fractions if p or d)
    assert first[0] == 0 and first[1] > 0, "decode's first pod is the first one updated"
    assert any(s["prefill"]["partition"] == prefill for s in watcher.samples), "prefill was held while decode moved"
    dm = kube_cluster.get("-n", namespace, "dm", "tiny")["status"]
    assert dm["prefill"]["updatedReplicas"] == prefill and dm["decode"]["updatedReplicas"] == decode
    pods = kube_cluster.get("-n", namespace, "pods", "-l", "disagg.dev/model=tiny,disagg.dev/role in (prefill,decode)")
    assert {p["spec"]["containers"][0]["image"] for p in pods["items"]} == {image}
    revisions = {p["metadata"]["labels"]["disagg.dev/revision"] for p in pods["items"]}
    assert len(revisions) == 1
    # The operator posts Events through a queue, after the status write that caused them.
    steps = wait_until(
        lambda: [e["message"] for e in events_for(kube_cluster, namespace, "tiny") if e["reason"] == "RollingOut"],
        30,
        interval=POLL_S,
        what="the RollingOut Event",
    )
    assert any("decode first" in m for m in steps), steps


def test_a_rollout_whose_new_pods_fail_is_reported_by_its_deadline_and_goes_no_further(
    kube_cluster, operator, namespace
):
    rollout = {"progressDeadlineSeconds": 15, "minReadySeconds": 5, "maxSurge": 0}
    apply_cr(kube_cluster, namespace, tiny(1, 2, rollout=rollout))
    wait_ready(kube_cluster, namespace)
    broken = tiny(1, 2, rollout=rollout, image="ghcr.io/disagg/worker:broken")
    broken["metadata"]["labels"] = {CHAOS: "true"}  # propagates to the new pods only: kwok fails them
    start = time.monotonic()
    apply_cr(kube_cluster, namespace, broken)

    def stalled() -> dict | None:
        c = condition(kube_cluster, namespace, "tiny", "Progressing")
        return c if c.get("reason") == "ProgressDeadlineExceeded" else None

    reported = wait_until(stalled, 60, interval=POLL_S, what="Progressing=False/ProgressDeadlineExceeded")
    took = time.monotonic() - start
    # The promise: reported once the deadline has passed since the last progress, by the operator's next tick.
    # On the operator's own clock (whole seconds) from the progress it recorded to the report it stamped; the
    # slack beyond a tick is the machine's (a tick and the handlers run late on a loaded one).
    status = kube_cluster.get("-n", namespace, "dm", "tiny")["status"]
    silent = parse_time(reported["lastTransitionTime"]) - parse_time(status["rollout"]["lastProgressTime"])
    assert 15 < silent <= 15 + 1 + TICK_S + scaled(5), f"reported {silent:.0f} s after the last progress"
    # And as the user sees it, from the apply (the rollout's first step follows it) to the condition.
    assert 15 <= took <= 15 + TICK_S + scaled(10), f"reported after {took:.0f} s"
    assert reported["status"] == "False" and "tiny-decode-1" in reported["message"], reported
    prefill = kube_cluster.get("-n", namespace, "sts", "tiny-prefill")
    assert prefill["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 1, "prefill was never released"
    assert (prefill["status"].get("updatedReplicas") or 0) == 0
    decode = kube_cluster.get("-n", namespace, "sts", "tiny-decode")
    assert decode["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 1, "no second decode pod released"
    warnings = wait_until(
        lambda: [e for e in events_for(kube_cluster, namespace, "tiny") if e["reason"] == "ProgressDeadlineExceeded"],
        30,
        interval=POLL_S,
        what="the Warning Event (posted after the status)",
    )
    assert warnings[0]["type"] == "Warning"


def rolled(cluster, namespace: str) -> bool:
    dm = cluster.get("-n", namespace, "dm", "tiny")
    ready = next(c for c in dm["status"]["conditions"] if c["type"] == "Ready")["status"] == "True"
    return (
        ready and dm["status"]["observedGeneration"] == dm["metadata"]["generation"] and "rollout" not in dm["status"]
    )


@pytest.mark.parametrize("prefill,decode", [(1, 1), (2, 3)])
def test_an_image_change_with_a_surge_starts_new_pods_beside_the_old_and_never_runs_a_role_short(
    kube_cluster, operator, namespace, prefill, decode
):
    apply_cr(kube_cluster, namespace, tiny(prefill, decode))  # maxSurge left to its default: one pod per role
    wait_ready(kube_cluster, namespace)
    wanted = {"prefill": prefill, "decode": decode}
    image = "ghcr.io/disagg/worker:0.2.0"
    with SetWatcher(kube_cluster, namespace) as watcher:
        apply_cr(kube_cluster, namespace, tiny(prefill, decode, image=image))
        wait_until(lambda: rolled(kube_cluster, namespace), 120, interval=POLL_S, what="the rollout to finish")
        wait_until(
            lambda: all(
                r["image"] == image and r["replicas"] == r["updated"] == wanted[k] and r["current"]
                for k, r in watcher.samples[-1].items()
            ),
            30,
            what="the watch to see the surge pods go",
        )
    new = [s for s in watcher.samples if all(r["image"] == image for r in s.values())]
    # Each role grew by one pod on the new template, and no old pod was released before both had one.
    assert {k: max(s[k]["replicas"] for s in new) for k in wanted} == {k: n + 1 for k, n in wanted.items()}
    first_release = next((i for i, s in enumerate(new) if any(s[k]["partition"] < wanted[k] for k in wanted)), len(new))
    assert first_release < len(new), "no old pod was ever released"
    assert all(s[k]["replicas"] == wanted[k] + 1 for s in new[first_release : first_release + 1] for k in wanted)
    # From then on no role had fewer Ready pods than its replicas (kwok makes a created pod Ready at once).
    short = [s for s in watcher.samples if any(s[k]["current"] and s[k]["ready"] < wanted[k] for k in wanted)]
    assert not short, short[:3]
    pods = kube_cluster.get("-n", namespace, "pods", "-l", "disagg.dev/model=tiny,disagg.dev/role in (prefill,decode)")
    live = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
    assert {p["spec"]["containers"][0]["image"] for p in live} == {image}
    assert sorted(p["metadata"]["name"] for p in live) == sorted(
        f"tiny-{k}-{i}" for k, n in wanted.items() for i in range(n)
    )


def test_surge_pods_without_a_node_are_reported_and_the_rollout_goes_on_in_place(kube_cluster, operator, namespace):
    rollout = {"progressDeadlineSeconds": 15}
    apply_cr(kube_cluster, namespace, tiny(1, 1, rollout=rollout))
    wait_ready(kube_cluster, namespace)
    nodes = [n["metadata"]["name"] for n in kube_cluster.get("nodes")["items"]]
    image = "ghcr.io/disagg/worker:0.3.0"
    try:
        for node in nodes:  # no node takes a new pod: the surge pods stay Pending
            kube_cluster.kubectl("cordon", node)
        with SetWatcher(kube_cluster, namespace) as watcher:
            apply_cr(kube_cluster, namespace, tiny(1, 1, image=image, rollout=rollout))

            def reported() -> dict | None:
                c = condition(kube_cluster, namespace, "tiny", "Progressing")
                return c if c.get("reason") == "SurgeUnschedulable" else None

            said = wait_until(reported, 60, interval=POLL_S, what="Progressing=False/SurgeUnschedulable")
            assert said["status"] == "False" and "tiny-prefill-1" in said["message"], said
            assert "tiny-decode-1" in said["message"] and "in place" in said["message"], said
            status = kube_cluster.get("-n", namespace, "dm", "tiny")["status"]
            assert sorted(status["rollout"]["inPlace"]) == ["tiny-decode-1", "tiny-prefill-1"]
            wait_until(
                lambda: all(s["replicas"] == 1 for s in watcher.samples[-1].values()),
                30,
                what="both StatefulSets back to one replica",
            )
            fell = len(watcher.samples) - 1
            for node in nodes:
                kube_cluster.kubectl("uncordon", node)
            wait_until(lambda: rolled(kube_cluster, namespace), 120, interval=POLL_S, what="the in-place rollout")
        grew = [s for s in watcher.samples[fell:] if any(r["replicas"] > 1 for r in s.values())]
        assert not grew, "the rollout surged again after giving up"
    finally:
        for node in nodes:
            kube_cluster.kubectl("uncordon", node, check=False)
    pods = kube_cluster.get("-n", namespace, "pods", "-l", "disagg.dev/model=tiny,disagg.dev/role in (prefill,decode)")
    assert {p["spec"]["containers"][0]["image"] for p in pods["items"]} == {image}


def test_prefill_scales_through_its_role_scaler(kube_cluster, operator, namespace):
    apply_cr(kube_cluster, namespace, tiny(1, 1))
    wait_ready(kube_cluster, namespace)
    kube_cluster.kubectl("-n", namespace, "scale", "rolescaler/tiny-prefill", "--replicas=3")
    wait_until(
        lambda: kube_cluster.get("-n", namespace, "sts", "tiny-prefill")["spec"]["replicas"] == 3,
        30,
        interval=POLL_S,
        what="sts at 3",
    )
    wait_until(
        lambda: kube_cluster.get("-n", namespace, "dm", "tiny")["status"]["prefill"]["ready"] == "3/3",
        60,
        interval=POLL_S,
        what="3/3",
    )
    assert kube_cluster.get("-n", namespace, "dm", "tiny")["spec"]["prefill"]["replicas"] == 3
    scale = kube_cluster.get("-n", namespace, "--subresource=scale", "rolescaler", "tiny-prefill")
    assert scale["spec"]["replicas"] == 3
    wait_until(
        lambda: (
            kube_cluster.get("-n", namespace, "--subresource=scale", "rolescaler", "tiny-prefill")["status"]
            == {"replicas": 3, "selector": "disagg.dev/model=tiny,disagg.dev/role=prefill"}
        ),
        30,
        interval=POLL_S,
        what="the scaler's status",
    )
    kube_cluster.kubectl(
        "-n", namespace, "patch", "dm", "tiny", "--type=merge", "-p", '{"spec":{"prefill":{"replicas":2}}}'
    )
    wait_until(
        lambda: kube_cluster.get("-n", namespace, "rolescaler", "tiny-prefill")["spec"]["replicas"] == 2,
        30,
        interval=POLL_S,
        what="an edit of the model reaching the scaler",
    )
    wait_ready(kube_cluster, namespace)


def test_with_prefill_per_decode_one_scale_of_decode_moves_both(kube_cluster, operator, namespace):
    apply_cr(kube_cluster, namespace, tiny(1, 2, scaling={"prefillPerDecode": 0.5}))
    wait_ready(kube_cluster, namespace)
    assert kube_cluster.get("-n", namespace, "sts", "tiny-prefill")["spec"]["replicas"] == 1
    kube_cluster.kubectl("-n", namespace, "scale", "dm/tiny", "--replicas=6")
    wait_until(
        lambda: kube_cluster.get("-n", namespace, "sts", "tiny-prefill")["spec"]["replicas"] == 3,
        30,
        interval=POLL_S,
        what="prefill 3",
    )
    wait_ready(kube_cluster, namespace)
    status = kube_cluster.get("-n", namespace, "dm", "tiny")["status"]
    assert (status["prefill"]["ready"], status["decode"]["ready"]) == ("3/3", "6/6")
    assert kube_cluster.get("-n", namespace, "rolescaler", "tiny-prefill")["spec"]["replicas"] == 3


def test_labels_reach_children_and_pods_and_the_name_is_the_default_model_name(kube_cluster, operator, namespace):
    cr = tiny(1, 1)
    del cr["spec"]["servedModelName"]
    cr["metadata"]["labels"] = {"team": "search"}
    apply_cr(kube_cluster, namespace, cr)
    wait_ready(kube_cluster, namespace)
    for kind in ("sts", "deploy", "svc", "pdb", "networkpolicy", "pods", "rolescaler"):
        items = kube_cluster.get("-n", namespace, kind, "-l", "disagg.dev/model=tiny")["items"]
        assert items and all(i["metadata"]["labels"].get("team") == "search" for i in items), kind
    router = kube_cluster.get("-n", namespace, "deploy", "tiny-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][router["args"].index("--served-model-name") + 1] == "tiny"
    renamed = tiny(1, 1, servedModelName="other")
    renamed["metadata"]["labels"] = {"team": "search"}
    rejected = apply_cr(kube_cluster, namespace, renamed, check=False)
    assert rejected.returncode != 0 and "servedModelName is immutable" in rejected.stderr


def test_the_api_server_keeps_the_drain_settings_of_every_pod(kube_cluster, operator, namespace):
    apply_cr(kube_cluster, namespace, tiny(1, 1, drain={"timeoutSeconds": 45}))
    wait_ready(kube_cluster, namespace)
    for kind, name in (("sts", "tiny-prefill"), ("sts", "tiny-decode"), ("deploy", "tiny-router")):
        pod = kube_cluster.get("-n", namespace, kind, name)["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
        assert pod["terminationGracePeriodSeconds"] == 5 + 45 + 5
        assert c["args"][c["args"].index("--drain-timeout") + 1] == "45"


def test_the_autoscaling_example_drives_both_scale_subresources(kube_cluster, operator, namespace):
    apply_cr(kube_cluster, namespace, tiny(1, 1))
    wait_ready(kube_cluster, namespace)
    kube_cluster.kubectl("-n", namespace, "apply", "-f", str(EXAMPLES / "autoscaling.yaml"))
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "autoscaling.yaml").read_text()) if d]
    hpas = [d["metadata"]["name"] for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert sorted(hpas) == ["tiny-decode", "tiny-prefill"]

    def able(name: str) -> dict | None:
        conds = kube_cluster.get("-n", namespace, "hpa", name).get("status", {}).get("conditions", [])
        c = next((c for c in conds if c["type"] == "AbleToScale"), None)
        return c if c and c["status"] == "True" else None

    for name in hpas:  # the HPA controller read the target's scale subresource (metrics need an adapter here)
        assert (
            wait_until(lambda n=name: able(n), 60, interval=POLL_S, what=f"{name} AbleToScale")["reason"]
            == "SucceededGetScale"
        )


def test_the_service_account_gets_only_what_role_scalers_need(kube_cluster, operator):
    from test_operator_support import OPERATOR_NS, RELEASE

    sa = f"system:serviceaccount:{OPERATOR_NS}:{RELEASE}"

    def can(*args: str) -> bool:
        return kube_cluster.kubectl("auth", "can-i", "--as", sa, *args, check=False).stdout.strip() == "yes"

    assert can("create", "rolescalers.disagg.dev", "-n", "default")
    assert can("patch", "rolescalers.disagg.dev/status", "-n", "default")
    assert can("patch", "disaggregatedmodels.disagg.dev", "-n", "default")  # hands a RoleScaler's replicas on
    assert not can("delete", "rolescalers.disagg.dev", "-n", "default")
    assert not can("create", "roles", "-n", "default")
    assert not can("get", "pods", "--subresource=proxy", "-n", "default")

"""`spec.gateway` without a cluster: the InferencePool, the endpoint picker and its identity, the NetworkPolicies and
the HTTPRoute the operator builds; what it deletes when the block goes; and how a cluster without the InferencePool
CRD is reported (Degraded naming it, once in an Event, the rest of the model applied)."""

import copy

import pytest
from kubernetes.client.exceptions import ApiException

from disagg_operator import names
from disagg_operator.builders import build_gateway_children, build_worker_statefulset, retired_gateway
from disagg_operator.builders.common import front_end_labels
from disagg_operator.config import OperatorConfig
from disagg_operator.spec import ModelSpec
from disagg_operator.status import Findings, RoleObservation, compute_status
from tests.unit.test_operator_status import ALL_READY, CR, FakeKube, RecordingRuntime, conds

CFG = OperatorConfig()
ROUTE = {"parentRefs": [{"name": "inference-gateway", "namespace": "gateways"}], "hostnames": ["llm.example.com"]}


def with_gateway(**gateway) -> dict:
    cr = copy.deepcopy(CR)
    cr["spec"]["gateway"] = gateway
    return cr


def children(cr: dict) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in build_gateway_children(ModelSpec.from_cr(cr), CFG)}


def test_no_gateway_block_builds_nothing_and_retires_every_gateway_object():
    spec = ModelSpec.from_cr(CR)
    assert build_gateway_children(spec, CFG) == []
    retired = [(o["kind"], o["metadata"]["name"]) for o in retired_gateway(spec)]
    assert retired == [
        ("HTTPRoute", "m"),
        ("InferencePool", "m"),
        ("ServiceAccount", "m-epp"),
        ("Service", "m-epp"),
        ("Deployment", "m-epp"),
        ("PodDisruptionBudget", "m-epp"),
        ("NetworkPolicy", "m-epp"),
        ("NetworkPolicy", "m-gateway"),
        ("NetworkPolicy", "m-gateway-prefill"),
    ]
    assert retired_gateway(ModelSpec.from_cr(with_gateway(enabled=False))) == retired_gateway(spec)


def test_the_pool_selects_the_decode_pods_and_names_the_picker():
    made = children(with_gateway(failureMode="FailOpen"))
    pool = made[("InferencePool", "m")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {"matchLabels": {names.MODEL_LABEL: "m", names.ROLE_LABEL: "decode"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "m-epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
    }
    assert children(with_gateway())[("InferencePool", "m")]["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    # The decode pods are what the selector finds: their headless Service selects them by the same labels.
    assert pool["spec"]["selector"]["matchLabels"] == front_end_labels(ModelSpec.from_cr(CR), "decode")


def test_every_gateway_object_is_owned_by_the_model():
    made = children(with_gateway(httpRoute=ROUTE))
    assert {k for k, _ in made} == {
        "ServiceAccount",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "InferencePool",
        "HTTPRoute",
    }
    for obj in made.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("DisaggregatedModel", "u1", True)
        assert obj["metadata"]["namespace"] == "ns"


def test_the_route_sends_the_gateways_traffic_to_the_pool():
    route = children(with_gateway(httpRoute=ROUTE))[("HTTPRoute", "m")]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway", "namespace": "gateways"}
    ]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "m"}]
    assert ("HTTPRoute", "m") not in children(with_gateway())
    retired = retired_gateway(ModelSpec.from_cr(with_gateway()))
    assert [(o["kind"], o["metadata"]["name"]) for o in retired] == [("HTTPRoute", "m")]
    assert retired_gateway(ModelSpec.from_cr(with_gateway(httpRoute=ROUTE))) == []


def test_the_picker_runs_disagg_epp_over_the_decode_service():
    from disagg_worker.cli import build_parser

    cr = with_gateway(replicas=2, image="picker:1", policy="round_robin")
    deploy = children(cr)[("Deployment", "m-epp")]
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert deploy["spec"]["replicas"] == 2 and c["image"] == "picker:1" and c["command"] == ["disagg"]
    ns = build_parser().parse_args(c["args"])
    assert ns.command == "epp"
    assert ns.endpoint_dns == "m-decode.ns.svc.cluster.local:8000"
    # P/D mode: the picker names each request's prefill, from the prefill pods' headless Service.
    assert ns.prefill_dns == "m-prefill.ns.svc.cluster.local:8000"
    assert (ns.grpc_port, ns.grpc_health_port, ns.metrics_port) == (9002, 9003, 9090)
    assert (ns.policy, ns.served_model_name, ns.auth_token_file) == ("round_robin", "m", "/var/run/disagg/auth/token")
    assert not ns.tokenizer
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert pod["serviceAccountName"] == "m-epp" and pod["automountServiceAccountToken"] is False
    default = children(with_gateway())[("Deployment", "m-epp")]["spec"]["template"]["spec"]["containers"][0]
    assert default["image"] == "img"  # the worker image, which holds `disagg epp`


def pod_of(cr: dict, role: str) -> dict:
    return build_worker_statefulset(ModelSpec.from_cr(cr), role, CFG)["spec"]["template"]["spec"]


def test_decode_pods_behind_a_gateway_admit_exactly_the_models_prefills():
    from disagg_worker.cli import build_parser

    (c,) = pod_of(with_gateway(), names.DECODE)["containers"]
    ns = build_parser().parse_args(c["args"])
    assert ns.prefill_allow == "m-prefill.ns.svc.cluster.local"
    assert not ns.api_key_file  # the model has no API keys: the decode takes the worker token alone
    # Without the block the flag is not given (loopback only), and the pods keep the template they had.
    assert "--prefill-allow" not in pod_of(CR, names.DECODE)["containers"][0]["args"]
    assert "--prefill-allow" not in pod_of(with_gateway(), names.PREFILL)["containers"][0]["args"]


def test_decode_pods_behind_a_gateway_take_the_clients_api_keys():
    from disagg_worker.cli import build_parser

    cr = with_gateway()
    cr["spec"]["apiKeySecret"] = {"name": "client-keys", "key": "keys.txt"}
    pod = pod_of(cr, names.DECODE)
    (c,) = pod["containers"]
    assert build_parser().parse_args(c["args"]).api_key_file == "/var/run/disagg/api-keys/keys"
    assert {v["name"]: v for v in pod["volumes"]}["api-keys"]["secret"]["secretName"] == "client-keys"
    assert {"name": "api-keys", "mountPath": "/var/run/disagg/api-keys", "readOnly": True} in c["volumeMounts"]
    # The prefill pods take no client's request: they never see the keys.
    prefill = pod_of(cr, names.PREFILL)
    assert "api-keys" not in {v["name"] for v in prefill["volumes"]}
    assert "--api-key-file" not in prefill["containers"][0]["args"]
    without = copy.deepcopy(CR)
    without["spec"]["apiKeySecret"] = {"name": "client-keys"}
    assert "api-keys" not in {v["name"] for v in pod_of(without, names.DECODE)["volumes"]}


def test_cache_aware_mounts_the_model_for_its_tokenizer():
    from disagg_worker.cli import build_parser

    deploy = children(with_gateway(policy="cache_aware"))[("Deployment", "m-epp")]
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    assert build_parser().parse_args(c["args"]).tokenizer == "/models/x"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def test_the_picker_service_and_an_identity_granted_nothing():
    made = children(with_gateway())
    ports = [(p["name"], p["port"]) for p in made[("Service", "m-epp")]["spec"]["ports"]]
    assert ports == [("grpc-ext-proc", 9002), ("grpc-health", 9003), ("http-metrics", 9090)]
    assert made[("Service", "m-epp")]["spec"]["ports"][0]["appProtocol"] == "http2"
    # `disagg epp` finds its endpoints by DNS and makes no API call: its own ServiceAccount, no token, no Role.
    assert made[("ServiceAccount", "m-epp")]["automountServiceAccountToken"] is False
    assert not {k for k, _ in made} & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    pod = made[("Deployment", "m-epp")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "m-epp" and pod["automountServiceAccountToken"] is False


def test_the_gateway_pods_are_let_in_to_the_picker_and_the_pool():
    made = children(with_gateway(httpRoute=ROUTE))
    gateway = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}},
        "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}},
    }
    epp = made[("NetworkPolicy", "m-epp")]["spec"]
    assert epp["podSelector"]["matchLabels"][names.ROLE_LABEL] == "epp"
    assert epp["ingress"][0] == {"ports": [{"protocol": "TCP", "port": 9002}], "from": [gateway]}
    pool = made[("NetworkPolicy", "m-gateway")]["spec"]
    assert pool["podSelector"]["matchLabels"][names.ROLE_LABEL] == "decode"
    picker = {"podSelector": {"matchLabels": {names.MODEL_LABEL: "m", names.ROLE_LABEL: "epp"}}}
    assert pool["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}], "from": [gateway, picker]}]

    # The decode pods hand the request to its prefill, whose /health the picker reads: both reach its serving port.
    prefill = made[("NetworkPolicy", "m-gateway-prefill")]["spec"]
    assert prefill["podSelector"]["matchLabels"] == {names.MODEL_LABEL: "m", names.ROLE_LABEL: "prefill"}
    decode = {"podSelector": {"matchLabels": {names.MODEL_LABEL: "m", names.ROLE_LABEL: "decode"}}}
    assert prefill["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}], "from": [decode, picker]}]

    mine = [{"namespaceSelector": {"matchLabels": {"team": "edge"}}}]
    allowed = children(with_gateway(httpRoute=ROUTE, allowFrom=mine))[("NetworkPolicy", "m-epp")]["spec"]
    assert allowed["ingress"][0]["from"] == mine
    anyone = children(with_gateway())[("NetworkPolicy", "m-epp")]["spec"]
    assert anyone["ingress"][0]["from"] == [{"namespaceSelector": {}}]


def test_status_names_the_pool_and_the_picker():
    spec = ModelSpec.from_cr(with_gateway(httpRoute=ROUTE))
    observed = {**ALL_READY, "epp": RoleObservation(1, 1, 1)}
    status = compute_status(spec, 3, observed, [], [], {}, "http://e", "T1", Findings())
    assert status["gateway"] == {
        "pool": "m",
        "endpointPicker": "m-epp.ns.svc:9002",
        "readyReplicas": 1,
        "ready": "1/1",
        "httpRoute": "m",
    }
    assert compute_status(ModelSpec.from_cr(CR), 3, ALL_READY, [], [], {}, "e", "T1")["gateway"] is None


class NoInferencePoolCRD(FakeKube):
    """An API server that serves no InferencePool: applying one is a 404 (the resource, not the object)."""

    def apply(self, obj):
        if obj["kind"] == "InferencePool":
            raise ApiException(status=404, reason="Not Found")
        super().apply(obj)


@pytest.fixture
def no_crd():
    rt = RecordingRuntime(NoInferencePoolCRD(), CFG, lambda cr, e: rt.events.append(e))
    return rt


def test_a_cluster_without_the_inferencepool_crd_degrades_the_model_and_serves_it(no_crd):
    cr = with_gateway()
    no_crd.apply_children(cr)  # no exception: the rest of the model is applied
    assert "StatefulSet/m-decode" in no_crd.kube.applied and "Deployment/m-router" in no_crd.kube.applied
    (event,) = no_crd.events
    assert event.type == "Warning" and event.reason == "GatewayUnavailable"
    assert "inferencepools.inference.networking.k8s.io" in event.message
    no_crd.apply_children(cr)
    assert len(no_crd.events) == 1  # told once, not on every retry

    no_crd.refresh_status(cr, ALL_READY, [])
    c = conds(no_crd.kube.status_writes[-1])
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "GatewayUnavailable"
    assert "InferencePool is not installed" in c["Degraded"]["message"]
    assert c["Ready"]["status"] == "True"  # the router serves it all the same

    no_crd.apply_children(CR)  # spec.gateway removed: nothing of the gateway is left to fail
    no_crd.refresh_status(CR, ALL_READY, [])
    assert conds(no_crd.kube.status_writes[-1])["Degraded"]["status"] == "False"


def test_a_node_drain_takes_one_picker_pod_at_a_time():
    made = children(with_gateway(replicas=2))
    pdb = made[("PodDisruptionBudget", "m-epp")]
    deployment = made[("Deployment", "m-epp")]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]

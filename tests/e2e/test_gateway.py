"""A DisaggregatedModel behind a gateway on the real node: `spec.gateway` makes the model's InferencePool and its
endpoint picker, and an Envoy pod configured as Gateway API gateways configure one for a pool (the ext_proc filter
to the picker's Service, FailClose, an ORIGINAL_DST cluster that connects to the pod the picker names) sends the
official `openai` client's requests to the decode pod the picker chose. The decode runs the prefill leg the picker
named (`x-prefiller-host-port`): the answer is the router's, and the prefill's metrics count the request."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import REPO, RealNode, new_namespace
from tests.e2e.models import QUESTION, Model, chat_from_pod, example, port_forward, requests_finished, served
from tests.integration.gateway import HTTP2, ORIGINAL_DST, SERVED, ext_proc, listener, socket_address
from tests.timing import scaled

pytestmark = pytest.mark.timeout(scaled(1200))

POOL_CRD = REPO / "charts" / "disagg-operator" / "files" / "inference.networking.k8s.io_inferencepools.yaml"
POOL_CRD_NAME = "inferencepools.inference.networking.k8s.io"
API_KEY = "sk-e2e-gateway-client"
ENVOY_PORT = 8080


def envoy_config(picker: str) -> dict:
    """One listener on every address of the pod: the picker asked for each request (FailClose: a request it did not
    answer is refused), then the ORIGINAL_DST cluster to the address it named; `picker` is its Service's name."""
    epp = {
        "name": "epp",
        "type": "STRICT_DNS",
        "dns_lookup_family": "V4_ONLY",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": "epp",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(9002, picker)}}]}],
        },
        "typed_extension_protocol_options": HTTP2,
    }
    gateway = listener("gateway", ENVOY_PORT, [ext_proc(False)], address="0.0.0.0", fallback=False)
    return {
        "admin": {"address": socket_address(9901)},
        "static_resources": {"listeners": [gateway], "clusters": [epp, ORIGINAL_DST]},
    }


def start_envoy(node: RealNode, namespace: str, image: str, picker: str) -> str:
    """The gateway's pod (its configuration in a ConfigMap) and a Service in front of it; returns the Service's
    name once the pod is Ready."""
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "gateway-envoy", "namespace": namespace},
        "data": {"envoy.json": json.dumps(envoy_config(picker))},
    }
    labels = {"app": "e2e-gateway"}
    container = {
        "name": "envoy",
        "image": image,
        "imagePullPolicy": "Never",
        "args": ["-c", "/etc/envoy/envoy.json", "-l", "warning"],
        "ports": [{"containerPort": ENVOY_PORT}],
        "readinessProbe": {"tcpSocket": {"port": ENVOY_PORT}, "periodSeconds": 2},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy"}],
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gateway", "namespace": namespace, "labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
            "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": "gateway-envoy"}}],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "gateway", "namespace": namespace},
        "spec": {"selector": labels, "ports": [{"port": ENVOY_PORT, "targetPort": ENVOY_PORT}]},
    }
    for obj in (config, pod, service):
        node.kubectl("apply", "-f", "-", input=json.dumps(obj))
    node.kubectl("-n", namespace, "wait", "--for=condition=Ready", "pod/gateway", "--timeout=120s", timeout=150)
    return "gateway"


@pytest.fixture(scope="module")
def model(
    real_node: RealNode, operator_release: str, worker_image: str, operator_image: str, report: Callable[[str], None]
) -> Iterator[Model]:
    real_node.kubectl("apply", "--server-side", "-f", str(POOL_CRD))
    real_node.kubectl("wait", "--for=condition=Established", f"crd/{POOL_CRD_NAME}", "--timeout=60s")
    namespace = new_namespace(real_node, "e2e-gateway")
    real_node.kubectl("-n", namespace, "create", "secret", "generic", "api-keys", f"--from-literal=api-key={API_KEY}")
    cr = example(namespace, gateway={}, apiKeySecret={"name": "api-keys"})
    try:
        with served(real_node, cr, operator_image, report, "a model behind a gateway", epps=1) as m:
            yield m
    finally:
        real_node.kubectl("delete", "crd", POOL_CRD_NAME, "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture(scope="module")
def gateway(real_node: RealNode, model: Model, envoy_image: str) -> Iterator[str]:
    """The base URL of the gateway, port-forwarded to this machine."""
    status = real_node.get("-n", model.namespace, f"disaggregatedmodels/{model.name}")["status"]
    picker = f"{model.name}-epp.{model.namespace}.svc.cluster.local"
    assert status.get("gateway"), status  # the operator reports the pool and the picker
    service = start_envoy(real_node, model.namespace, envoy_image, picker)
    with port_forward(real_node, model.namespace, service, ENVOY_PORT) as url:
        yield url


def pod_names(node: RealNode, model: Model, role: str) -> list[str]:
    return [p["metadata"]["name"] for p in model.pods(node, role)]


def test_the_openai_client_chats_through_envoy_and_the_picker_and_the_answer_is_disaggregated(
    real_node: RealNode, model: Model, gateway: str, report: Callable[[str], None]
) -> None:
    (decode,), (prefill,) = pod_names(real_node, model, "decode"), pod_names(real_node, model, "prefill")
    decode_ip = model.pods(real_node, "decode")[0]["status"]["podIP"]
    before = {pod: requests_finished(real_node, model.namespace, pod) for pod in (decode, prefill)}
    client = OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, timeout=scaled(180), max_retries=0)
    ask = {"model": model.served_name, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0}

    raw = client.chat.completions.with_raw_response.create(**ask, max_tokens=32)
    reply = raw.parse()
    assert raw.headers[SERVED] == f"{decode_ip}:8000"  # the gateway connected to the decode the picker named
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert (
        text == chat_from_pod(real_node, model, api_key=API_KEY)["choices"][0]["message"]["content"]
    )  # the router's answer

    chunks = list(client.chat.completions.create(**ask, max_tokens=32, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        reply.choices[0].finish_reason
    ]

    after = {pod: requests_finished(real_node, model.namespace, pod) for pod in (decode, prefill)}
    # Three answers (two through the gateway, one through the router), each a prefill leg and a decode leg.
    assert after[prefill] - before[prefill] >= 3 and after[decode] - before[decode] >= 3, (before, after)
    legs = after[prefill] - before[prefill]
    report(f"through Envoy and the picker: greedy answers equal the router's, {legs:.0f} prefill legs")


def test_a_client_without_a_key_is_refused_at_the_decode(real_node: RealNode, model: Model, gateway: str) -> None:
    client = OpenAI(base_url=f"{gateway}/v1", api_key="sk-not-a-key", timeout=scaled(60), max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.chat.completions.create(
            model=model.served_name, messages=[{"role": "user", "content": QUESTION}], max_tokens=4
        )
    assert refused.value.status_code == 401
    assert refused.value.body["code"] == "invalid_api_key"

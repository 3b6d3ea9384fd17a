"""The real node runs pods: Service DNS through CoreDNS, Service traffic through kube-proxy, and a
NetworkPolicy enforced by kube-router, both when it is created and when it is deleted."""

from __future__ import annotations

import ipaddress
import json

from tests.e2e.conftest import RealNode
from tests.timing import wait_until

POD_SUBNET = ipaddress.ip_network("10.244.0.0/24")  # hack/node/node.sh


def _manifests(image: str) -> str:
    server = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {
            "containers": [
                {
                    "name": "web",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-m", "http.server", "8080"],
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                }
            ]
        },
    }
    client = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "client", "labels": {"app": "client"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "client", "image": image, "imagePullPolicy": "Never", "command": ["sleep", "infinity"]}
            ],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [server, client, service]})


DENY_INGRESS = json.dumps(
    {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "web-deny-ingress"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"]},
    }
)

# Run in the client pod: resolve the Service's name, then GET it; prints "<address> <status>".
FETCH = """
import socket, sys, urllib.request
host = sys.argv[1]
address = socket.gethostbyname(host)
print(address, urllib.request.urlopen(f"http://{host}/", timeout=3).status)
"""


def test_pod_reaches_service_by_name_until_a_policy_denies_it(
    real_node: RealNode, namespace: str, operator_image: str
) -> None:
    ns = ("-n", namespace)
    real_node.kubectl(*ns, "apply", "-f", "-", input=_manifests(operator_image))
    real_node.kubectl(*ns, "wait", "--for=condition=Ready", "pod/web", "pod/client", "--timeout=120s", timeout=150)

    for name in ("web", "client"):
        pod = real_node.get(*ns, f"pod/{name}")
        assert pod["spec"]["nodeName"] == real_node.name
        assert ipaddress.ip_address(pod["status"]["podIP"]) in POD_SUBNET
    cluster_ip = real_node.get(*ns, "service/web")["spec"]["clusterIP"]
    host = f"web.{namespace}.svc.cluster.local"

    def fetch() -> str | None:
        proc = real_node.kubectl(*ns, "exec", "client", "--", "python3", "-c", FETCH, host, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None

    # The endpoints reach kube-proxy a moment after the server turns Ready.
    assert wait_until(fetch, 30, 0.5, what=f"GET http://{host}/") == f"{cluster_ip} 200"

    real_node.kubectl(*ns, "apply", "-f", "-", input=DENY_INGRESS)
    wait_until(lambda: fetch() is None, 30, 0.5, what="the deny-ingress policy blocking the client")
    # Still blocked a moment later: enforcement, not a transient failure.
    assert fetch() is None

    real_node.kubectl(*ns, "delete", "networkpolicy", "web-deny-ingress")
    assert wait_until(fetch, 30, 0.5, what="traffic restored after deleting the policy") == f"{cluster_ip} 200"


# Run in a pod: what happens when it tries to leave the machine; prints one word per attempt.
ESCAPE = """
import errno, socket
try:
    socket.create_connection(("1.1.1.1", 53), timeout=3)
    print("connected")
except OSError as e:
    print("unreachable" if e.errno == errno.ENETUNREACH else f"other:{e!r}")
try:
    socket.gethostbyname("example.com")
    print("resolved")
except socket.gaierror:
    print("unresolved")
"""


def test_pods_have_no_way_off_the_machine(real_node: RealNode, namespace: str, operator_image: str) -> None:
    pod = json.loads(_manifests(operator_image))["items"][1]
    real_node.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(pod))
    real_node.kubectl("-n", namespace, "wait", "--for=condition=Ready", "pod/client", "--timeout=120s", timeout=150)
    out = real_node.kubectl("-n", namespace, "exec", "client", "--", "python3", "-c", ESCAPE).stdout.split()
    # No route leaves the pod network, and CoreDNS answers for cluster.local only.
    assert out == ["unreachable", "unresolved"]

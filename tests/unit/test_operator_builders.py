"""The manifests the operator builds from a DisaggregatedModel, checked without a cluster."""

import copy
from pathlib import Path

import pytest
import yaml

from disagg_operator import crd, names
from disagg_operator.builders import build_auth_secret, build_children
from disagg_operator.builders.router import router_args
from disagg_operator.builders.workers import worker_args
from disagg_operator.config import OperatorConfig
from disagg_operator.engine_fields import ENGINE_FIELDS
from disagg_operator.spec import ModelSpec

REPO = Path(__file__).resolve().parents[2]
CFG = OperatorConfig()


def load_example(name: str) -> dict:
    cr = yaml.safe_load((REPO / "examples" / name).read_text())
    cr["metadata"].update(namespace="ns1", uid="uid-1", generation=1)
    return cr


def children_by_kind_name(cr: dict) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(ModelSpec.from_cr(cr), CFG)}


def container(children: dict, kind: str, name: str) -> dict:
    return children[(kind, name)]["spec"]["template"]["spec"]["containers"][0]


@pytest.fixture
def tiny() -> dict:
    return load_example("dm-cpu-tcp.yaml")


@pytest.fixture
def gpu() -> dict:
    return load_example("dm-rdma-gpu.yaml")


def test_children_are_the_documented_set_with_owner_references(tiny):
    children = children_by_kind_name(tiny)
    assert set(children) == {
        ("Service", "tiny-prefill"),
        ("Service", "tiny-decode"),
        ("Service", "tiny-bootstrap"),
        ("Service", "tiny-router"),
        ("StatefulSet", "tiny-prefill"),
        ("StatefulSet", "tiny-decode"),
        ("Deployment", "tiny-router"),
        ("PodDisruptionBudget", "tiny-prefill"),
        ("PodDisruptionBudget", "tiny-decode"),
        ("PodDisruptionBudget", "tiny-router"),
        ("NetworkPolicy", "tiny-prefill"),
        ("NetworkPolicy", "tiny-decode"),
        ("NetworkPolicy", "tiny-router"),
    }
    for obj in children.values():
        assert obj["metadata"]["namespace"] == "ns1"
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "disagg.dev/v1alpha1",
                "kind": "DisaggregatedModel",
                "name": "tiny",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert obj["metadata"]["labels"][names.LABEL_MANAGED_BY] == "disagg-operator"
        assert obj["metadata"]["labels"][names.MODEL_LABEL] == "tiny"


def test_prefill_command_line_follows_the_worker_contract(tiny):
    c = container(children_by_kind_name(tiny), "StatefulSet", "tiny-prefill")
    assert c["command"] == ["disagg"]
    assert c["args"] == [
        "prefill",
        "--model",
        "/models/tiny-llama",
        "--served-model-name",
        "tiny-llama",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--advertise-host",
        "$(POD_IP)",
        "--bootstrap-port",
        "8998",
        "--control-port",
        "9000",
        "--transfer-port-base",
        "15000",
        "--transfer-ports-per-rank",
        "8",
        "--auth-token-file",
        "/var/run/disagg/auth/token",
        "--transfer-backend",
        "mooncake",
        "--transfer-protocol",
        "tcp",
        "--device",
        "cpu",
        "--tp-size",
        "1",
        "--pp-size",
        "1",
        "--page-size",
        "16",
        "--kv-dtype",
        "float32",
        "--dtype",
        "float32",
        "--chunk-size",
        "512",
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "16",
        "--drain-timeout",
        "30",
    ]


def test_decode_has_no_bootstrap_port_and_uses_its_own_engine_overrides(gpu):
    args = worker_args(ModelSpec.from_cr(gpu), names.DECODE)
    assert args[0] == "decode" and "--bootstrap-port" not in args
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--tp-size"] == "2" and flags["--max-running-requests"] == "256"
    assert flags["--page-size"] == "64" and flags["--ib-device"] == "mlx5_0"
    assert flags["--transfer-protocol"] == "rdma"


def test_extra_args_and_env_come_last(tiny):
    tiny["spec"]["prefill"]["args"] = ["--log-level", "debug"]
    tiny["spec"]["prefill"]["env"] = [{"name": "FOO", "value": "bar"}]
    c = container(children_by_kind_name(tiny), "StatefulSet", "tiny-prefill")
    assert c["args"][-2:] == ["--log-level", "debug"]
    assert c["env"][-1] == {"name": "FOO", "value": "bar"}


def test_every_pod_gets_identity_from_the_api_and_the_shared_secret_as_a_file_never_as_env(tiny):
    children = children_by_kind_name(tiny)
    for kind, name in [("StatefulSet", "tiny-prefill"), ("StatefulSet", "tiny-decode"), ("Deployment", "tiny-router")]:
        pod = children[(kind, name)]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert not [e for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})], "a secret in the environment"
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["auth"]["secret"] == {
            "secretName": "tiny-auth",
            "items": [{"key": "token", "path": "token"}],
            "defaultMode": 0o440,
        }
        assert {"name": "auth", "mountPath": "/var/run/disagg/auth", "readOnly": True} in c["volumeMounts"]
        assert c["args"][c["args"].index("--auth-token-file") + 1] == "/var/run/disagg/auth/token"
        assert "api-keys" not in vols and "--api-key-file" not in c["args"]


def test_the_api_key_secret_reaches_the_router_only_as_a_file(tiny):
    tiny["spec"]["apiKeySecret"] = {"name": "client-keys", "key": "keys.txt"}
    children = children_by_kind_name(tiny)
    router = children[("Deployment", "tiny-router")]["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in router["volumes"]}
    assert vols["api-keys"]["secret"] == {
        "secretName": "client-keys",
        "items": [{"key": "keys.txt", "path": "keys"}],
        "defaultMode": 0o440,
    }
    c = router["containers"][0]
    assert {"name": "api-keys", "mountPath": "/var/run/disagg/api-keys", "readOnly": True} in c["volumeMounts"]
    assert c["args"][c["args"].index("--api-key-file") + 1] == "/var/run/disagg/api-keys/keys"
    for role in ("prefill", "decode"):
        pod = children[("StatefulSet", f"tiny-{role}")]["spec"]["template"]["spec"]
        assert "api-keys" not in {v["name"] for v in pod["volumes"]}
    tiny["spec"]["apiKeySecret"] = {"name": "client-keys"}
    router = children_by_kind_name(tiny)[("Deployment", "tiny-router")]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in router["volumes"]}["api-keys"]["secret"]["items"] == [
        {"key": "api-key", "path": "keys"}
    ]


def test_pods_are_non_root_with_read_only_root_and_health_probes(tiny):
    children = children_by_kind_name(tiny)
    for kind, name in [("StatefulSet", "tiny-prefill"), ("StatefulSet", "tiny-decode"), ("Deployment", "tiny-router")]:
        pod = children[(kind, name)]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 1000
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        # The router is Ready from its first verified pair until it drains, and alive as long as it answers.
        ready = "/ready" if kind == "Deployment" else "/health"
        assert c["readinessProbe"]["httpGet"] == {"path": ready, "port": "http"}
        live = "/livez" if kind == "Deployment" else "/health"
        assert c["livenessProbe"]["httpGet"] == {"path": live, "port": "http"}
        assert c["startupProbe"]["httpGet"] == {"path": live, "port": "http"}
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_rdma_adds_ipc_lock_gpus_and_the_rdma_device(gpu):
    children = children_by_kind_name(gpu)
    c = container(children, "StatefulSet", "llama-8b-prefill")
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert c["resources"]["limits"] == {
        "memory": "192Gi",
        "ephemeral-storage": "5Gi",
        "nvidia.com/gpu": 4,
        "rdma/ib": 1,
    }
    pod = children[("StatefulSet", "llama-8b-prefill")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_gpu_example_pods_get_one_gpu_per_rank_and_run_their_ranks_on_cuda(gpu):
    children = children_by_kind_name(gpu)
    for role, tp, pp in (("prefill", 4, 1), ("decode", 2, 1)):
        c = container(children, "StatefulSet", f"llama-8b-{role}")
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp * pp == gpu["spec"][role]["resources"]["gpus"]
        flags = dict(zip(c["args"][1::2], c["args"][2::2], strict=False))
        assert (flags["--device"], flags["--tp-size"], flags["--pp-size"]) == ("cuda", str(tp), str(pp))
        assert c["args"].count("--device") == 1


def test_a_role_without_gpus_runs_on_the_cpu_and_asks_for_none(gpu):
    gpu["spec"]["decode"]["resources"]["gpus"] = 0
    gpu["spec"]["prefill"].update(tpSize=2, ppSize=2)
    gpu["spec"]["prefill"]["resources"]["gpus"] = 4
    children = children_by_kind_name(gpu)
    decode = container(children, "StatefulSet", "llama-8b-decode")
    assert "nvidia.com/gpu" not in decode["resources"]["limits"]
    assert decode["args"][decode["args"].index("--device") + 1] == "cpu"
    prefill = container(children, "StatefulSet", "llama-8b-prefill")
    flags = dict(zip(prefill["args"][1::2], prefill["args"][2::2], strict=False))
    assert (flags["--device"], flags["--tp-size"], flags["--pp-size"]) == ("cuda", "2", "2")
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 4


@pytest.mark.parametrize("example,device", [("dm-cpu-tcp.yaml", "cpu"), ("dm-rdma-gpu.yaml", "cuda")])
def test_the_worker_parses_the_generated_command_line(example, device):
    from disagg_worker.cli import build_parser

    spec = ModelSpec.from_cr(load_example(example))
    for role in names.WORKER_ROLES:
        ns = build_parser().parse_args(worker_args(spec, role))
        w = spec.worker(role)
        assert (ns.command, ns.device, ns.tp_size, ns.pp_size) == (role, device, w.tp_size, w.pp_size)


def test_the_gpu_resource_name_comes_from_the_operator_config(gpu):
    cfg = OperatorConfig(gpu_resource="amd.com/gpu")
    sts = [c for c in build_children(ModelSpec.from_cr(gpu), cfg) if c["kind"] == "StatefulSet"]
    for s in sts:
        limits = s["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert "nvidia.com/gpu" not in limits and limits["amd.com/gpu"] in (4, 2)


def test_tcp_asks_for_no_rdma_device_nor_ipc_lock(tiny):
    c = container(children_by_kind_name(tiny), "StatefulSet", "tiny-decode")
    assert "add" not in c["securityContext"]["capabilities"]
    assert c["resources"]["limits"] == {"memory": "4Gi", "ephemeral-storage": "5Gi"}


def test_model_volume_is_a_read_only_pvc(gpu):
    sts = children_by_kind_name(gpu)[("StatefulSet", "llama-8b-decode")]
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert c["args"][2] == "/models/Meta-Llama-3.1-8B-Instruct"


def test_hugging_face_id_is_passed_through_with_a_cache_volume(tiny):
    tiny["spec"]["model"] = {"huggingFaceId": "Qwen/Qwen2.5-0.5B-Instruct", "cachePvc": "hf-cache"}
    sts = children_by_kind_name(tiny)[("StatefulSet", "tiny-prefill")]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][1:3] == ["--model", "Qwen/Qwen2.5-0.5B-Instruct"]
    assert {"name": "HF_HOME", "value": "/cache/huggingface"} in c["env"]
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert vols["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}


def test_a_builtin_model_is_served_from_the_image_without_a_volume(tiny):
    tiny["spec"]["model"] = {"builtin": "smollm2"}
    children = children_by_kind_name(tiny)
    for role in ("prefill", "decode"):
        pod = children[("StatefulSet", f"tiny-{role}")]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["args"][1:3] == ["--model", "/opt/models/SmolLM2-135M-Instruct"]
        assert not {"model", "hf-cache"} & {v["name"] for v in pod["volumes"]}
        assert not {"/models", "/cache/huggingface"} & {m["mountPath"] for m in c["volumeMounts"]}
        assert not any(e["name"] == "HF_HOME" for e in c.get("env", []))


def test_router_finds_workers_through_the_headless_services(tiny):
    args = router_args(ModelSpec.from_cr(tiny), OperatorConfig(cluster_domain="example.org"))
    assert args == [
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "tiny-llama",
        "--policy",
        "round_robin",
        "--prefill-dns",
        "tiny-prefill.ns1.svc.example.org:8000",
        "--decode-dns",
        "tiny-decode.ns1.svc.example.org:8000",
        "--bootstrap-port",
        "8998",
        "--drain-timeout",
        "30",
        "--auth-token-file",
        "/var/run/disagg/auth/token",
    ]
    children = children_by_kind_name(tiny)
    for role in ("prefill", "decode"):
        svc = children[("Service", f"tiny-{role}")]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == {"disagg.dev/model": "tiny", "disagg.dev/role": role}
        assert children[("StatefulSet", f"tiny-{role}")]["spec"]["serviceName"] == f"tiny-{role}"


def test_bootstrap_service_targets_prefill_bootstrap_port(tiny):
    svc = children_by_kind_name(tiny)[("Service", "tiny-bootstrap")]
    assert svc["spec"]["selector"] == {"disagg.dev/model": "tiny", "disagg.dev/role": "prefill"}
    assert svc["spec"]["ports"] == [{"name": "bootstrap", "port": 8998, "targetPort": "bootstrap", "protocol": "TCP"}]


def ingress(children: dict, policy: str) -> dict[tuple[int, int], list[str] | None]:
    """(first port, last port) -> the roles allowed in (None: anyone), for one NetworkPolicy."""
    out: dict[tuple[int, int], list[str] | None] = {}
    for rule in children[("NetworkPolicy", policy)]["spec"]["ingress"]:
        (port,) = rule["ports"]
        assert port["protocol"] == "TCP"
        froms = rule.get("from")
        roles = None
        if froms is not None:
            roles = []
            for f in froms:
                assert set(f) == {"podSelector"}, "peers are pods of this model, in its namespace"
                labels = f["podSelector"]["matchLabels"]
                assert labels["disagg.dev/model"] == policy.rsplit("-", 1)[0]
                roles.append(labels["disagg.dev/role"])
        out[(port["port"], port.get("endPort", port["port"]))] = roles
    return out


def test_each_role_opens_exactly_its_ports_each_to_the_peers_that_connect(tiny):
    children = children_by_kind_name(tiny)
    for role in ("prefill", "decode", "router"):
        np = children[("NetworkPolicy", f"tiny-{role}")]["spec"]
        assert np["podSelector"] == {"matchLabels": {"disagg.dev/model": "tiny", "disagg.dev/role": role}}
        assert np["policyTypes"] == ["Ingress"]
    assert ingress(children, "tiny-prefill") == {
        (8000, 8000): ["router"],
        (8998, 8998): ["decode"],
        (9000, 9000): ["decode"],
        (15000, 15007): ["decode"],
    }
    assert ingress(children, "tiny-decode") == {
        (8000, 8000): ["router"],
        (9000, 9000): ["prefill"],
        (15000, 15007): ["prefill"],
    }
    assert ingress(children, "tiny-router") == {(8000, 8000): None}


def test_port_ranges_grow_with_the_ranks_of_a_pod_and_the_flags_say_the_same(gpu):
    spec = ModelSpec.from_cr(gpu)
    children = children_by_kind_name(gpu)
    assert ingress(children, "llama-8b-prefill")[(9000, 9003)] == ["decode"]  # tp=4: four ranks
    assert ingress(children, "llama-8b-prefill")[(15000, 15031)] == ["decode"]
    assert ingress(children, "llama-8b-decode")[(9000, 9001)] == ["prefill"]  # tp=2
    assert ingress(children, "llama-8b-decode")[(15000, 15015)] == ["prefill"]
    for role, ranks in (("prefill", 4), ("decode", 2)):
        flags = dict(zip(worker_args(spec, role)[1::2], worker_args(spec, role)[2::2], strict=False))
        per_rank = int(flags["--transfer-ports-per-rank"])
        first = int(flags["--transfer-port-base"])
        control = int(flags["--control-port"])
        assert (control, control + ranks - 1) in ingress(children, f"llama-8b-{role}")
        assert (first, first + ranks * per_rank - 1) in ingress(children, f"llama-8b-{role}")


def test_the_fake_backend_listens_on_no_transfer_ports_and_none_are_opened(tiny):
    tiny["spec"]["transfer"] = {"backend": "fake"}
    children = children_by_kind_name(tiny)
    assert ingress(children, "tiny-prefill") == {(8000, 8000): ["router"], (8998, 8998): ["decode"]}
    assert ingress(children, "tiny-decode") == {(8000, 8000): ["router"]}
    for role in ("prefill", "decode"):
        args = container(children, "StatefulSet", f"tiny-{role}")["args"]
        assert "--control-port" not in args and "--transfer-port-base" not in args


def test_no_worker_sets_mooncakes_port_range_in_its_environment(tiny):
    for role in ("prefill", "decode"):
        env = container(children_by_kind_name(tiny), "StatefulSet", f"tiny-{role}")["env"]
        assert not {e["name"] for e in env} & {"MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"}


def test_replicas_follow_the_spec_per_role(gpu):
    children = children_by_kind_name(gpu)
    assert children[("StatefulSet", "llama-8b-prefill")]["spec"]["replicas"] == 1
    assert children[("StatefulSet", "llama-8b-decode")]["spec"]["replicas"] == 2
    assert children[("Deployment", "llama-8b-router")]["spec"]["replicas"] == 2


def test_builders_are_pure_and_do_not_alias_the_cr(tiny):
    before = copy.deepcopy(tiny)
    first = build_children(ModelSpec.from_cr(tiny), CFG)
    first[0]["metadata"]["labels"]["x"] = "y"
    assert tiny == before
    assert build_children(ModelSpec.from_cr(tiny), CFG) != first


def test_defaults_match_when_the_api_server_filled_nothing():
    cr = {
        "metadata": {"name": "m", "namespace": "d", "uid": "u"},
        "spec": {"model": {"hostPath": "/m", "path": "x"}, "servedModelName": "m", "image": "img"},
    }
    args = worker_args(ModelSpec.from_cr(cr), names.PREFILL)
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--transfer-backend"] == "mooncake" and flags["--transfer-protocol"] == "tcp"
    assert flags["--page-size"] == "16" and flags["--kv-dtype"] == "bfloat16"


def test_generated_auth_secret_holds_the_token(tiny):
    secret = build_auth_secret(ModelSpec.from_cr(tiny), "s3cret")
    assert secret["metadata"]["name"] == "tiny-auth"
    assert secret["data"] == {"token": "czNjcmV0"}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_named_auth_secret_is_used_instead(tiny):
    tiny["spec"]["auth"] = {"secretName": "mine"}
    children = children_by_kind_name(tiny)
    for kind, name in [("StatefulSet", "tiny-prefill"), ("StatefulSet", "tiny-decode"), ("Deployment", "tiny-router")]:
        vols = {v["name"]: v for v in children[(kind, name)]["spec"]["template"]["spec"]["volumes"]}
        assert vols["auth"]["secret"]["secretName"] == "mine"


def _pod(children: dict, kind: str, name: str) -> dict:
    return children[(kind, name)]["spec"]["template"]["spec"]


@pytest.mark.parametrize("timeout", [None, 120])
def test_pods_drain_before_the_kubelet_kills_them(tiny, timeout):
    if timeout is not None:
        tiny["spec"]["drain"] = {"timeoutSeconds": timeout}
    drain = timeout or 30
    children = children_by_kind_name(tiny)
    for kind, name in [("StatefulSet", "tiny-prefill"), ("StatefulSet", "tiny-decode"), ("Deployment", "tiny-router")]:
        pod = _pod(children, kind, name)
        c = pod["containers"][0]
        assert c["args"][c["args"].index("--drain-timeout") + 1] == str(drain)
        # preStop keeps serving while Services and the router drop the pod; SIGTERM then starts the drain.
        assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": names.PRESTOP_SLEEP_SECONDS}}}
        grace = pod["terminationGracePeriodSeconds"]
        assert grace == names.PRESTOP_SLEEP_SECONDS + drain + names.EXIT_MARGIN_SECONDS
        assert grace > names.PRESTOP_SLEEP_SECONDS + drain


def test_both_roles_carry_one_pairing_revision_that_follows_what_they_must_agree_on(tiny):
    def revisions(cr: dict) -> dict[str, str]:
        children = children_by_kind_name(cr)
        out = {}
        for role in ("prefill", "decode"):
            template = children[("StatefulSet", f"tiny-{role}")]["spec"]["template"]
            env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
            assert env["DISAGG_REVISION"]["valueFrom"] == {
                "fieldRef": {"fieldPath": "metadata.labels['disagg.dev/revision']"}
            }
            assert env["DISAGG_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
            out[role] = template["metadata"]["labels"]["disagg.dev/revision"]
        return out

    before = revisions(tiny)
    assert before["prefill"] == before["decode"]
    tiny["spec"]["decode"]["engine"] = {"maxRunningRequests": 8}  # decode only, compatible: same revision
    assert revisions(tiny) == before
    tiny["spec"]["image"] = "ghcr.io/disagg/worker:0.2.0"
    after = revisions(tiny)
    assert after["prefill"] == after["decode"] != before["prefill"]


def test_template_hash_and_partition_are_what_the_rollout_planner_reads_and_sets(tiny):
    spec = ModelSpec.from_cr(tiny)
    objs = {o["metadata"]["name"]: o for o in build_children(spec, CFG, {"decode": 1}) if o["kind"] == "StatefulSet"}
    assert objs["tiny-decode"]["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}
    assert objs["tiny-prefill"]["spec"]["updateStrategy"]["rollingUpdate"] == {"partition": 0}
    hashes = {n: o["metadata"]["annotations"]["disagg.dev/template-hash"] for n, o in objs.items()}
    tiny["spec"]["decode"]["engine"] = {"maxRunningRequests": 8}
    changed = {
        o["metadata"]["name"]: o["metadata"]["annotations"]["disagg.dev/template-hash"]
        for o in build_children(ModelSpec.from_cr(tiny), CFG)
        if o["kind"] == "StatefulSet"
    }
    assert changed["tiny-prefill"] == hashes["tiny-prefill"] and changed["tiny-decode"] != hashes["tiny-decode"]
    tiny["spec"]["rollout"] = {"minReadySeconds": 20}
    sts = children_by_kind_name(tiny)[("StatefulSet", "tiny-decode")]
    assert sts["spec"]["minReadySeconds"] == 20


def test_the_crs_own_labels_reach_every_child_and_pod_but_not_its_internal_ones(tiny):
    tiny["metadata"]["labels"] = {
        "team": "search",
        "app.kubernetes.io/version": "1.2",
        "app.kubernetes.io/managed-by": "argocd",  # the operator's own key: not copied
        "disagg.dev/role": "x",  # internal: not copied
    }
    children = children_by_kind_name(tiny)
    for (kind, name), obj in children.items():
        labels = obj["metadata"]["labels"]
        assert labels["team"] == "search" and labels["app.kubernetes.io/version"] == "1.2", name
        assert labels["app.kubernetes.io/managed-by"] == "disagg-operator"
        if kind in ("StatefulSet", "Deployment"):
            pod_labels = obj["spec"]["template"]["metadata"]["labels"]
            assert pod_labels["team"] == "search"
            assert pod_labels["disagg.dev/role"] == obj["metadata"]["labels"]["app.kubernetes.io/component"]
            assert "team" not in obj["spec"]["selector"]["matchLabels"]


def test_worker_pods_carry_llm_ds_labels_and_the_router_does_not(tiny):
    """llm-d's endpoint picker and routing sidecar find the P/D roles by `llm-d.ai/role` and speak SGLang's protocol
    to pods labelled `llm-d.ai/engine-type: sglang`; the labels select nothing of ours (no selector holds them)."""
    tiny["metadata"]["labels"] = {"llm-d.ai/role": "x"}  # the CR's own value of the key does not win
    kids = children_by_kind_name(tiny)
    for role in ("prefill", "decode"):
        sts = kids[("StatefulSet", f"tiny-{role}")]
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert (pod_labels["llm-d.ai/role"], pod_labels["llm-d.ai/engine-type"]) == (role, "sglang")
        assert not {"llm-d.ai/role", "llm-d.ai/engine-type"} & set(sts["spec"]["selector"]["matchLabels"])
    router_pod = kids[("Deployment", "tiny-router")]["spec"]["template"]["metadata"]["labels"]
    assert "llm-d.ai/engine-type" not in router_pod
    tiny["spec"]["decode"] = {**tiny["spec"].get("decode", {}), "replicas": 1, "tpSize": 2, "gpusPerNode": 1}
    group = children_by_kind_name(tiny)[("LeaderWorkerSet", "tiny-decode-group")]["spec"]["leaderWorkerTemplate"]
    assert group["workerTemplate"]["metadata"]["labels"]["llm-d.ai/role"] == "decode"


def test_served_model_name_defaults_to_the_crs_name(tiny):
    del tiny["spec"]["servedModelName"]
    spec = ModelSpec.from_cr(tiny)
    assert spec.served_model_name == "tiny"
    args = worker_args(spec, names.DECODE)
    assert args[args.index("--served-model-name") + 1] == "tiny"
    assert router_args(spec, CFG)[router_args(spec, CFG).index("--served-model-name") + 1] == "tiny"


def test_an_expert_parallel_decode_gets_its_ep_size_and_prefill_does_not(tiny):
    cr = tiny
    cr["spec"]["decode"] = {**cr["spec"].get("decode", {}), "tpSize": 2, "epSize": 2}
    kids = children_by_kind_name(cr)
    decode = container(kids, "StatefulSet", "tiny-decode")["args"]
    assert decode[decode.index("--ep-size") + 1] == "2" and decode[decode.index("--tp-size") + 1] == "2"
    assert "--ep-size" not in container(kids, "StatefulSet", "tiny-prefill")["args"]


def test_speculative_settings_reach_decode_and_nothing_changes_without_them(tiny):
    plain = children_by_kind_name(tiny)
    for name in ("tiny-prefill", "tiny-decode"):
        assert not any(a.startswith("--speculative") for a in container(plain, "StatefulSet", name)["args"])
    tiny["spec"]["speculative"] = {"algorithm": "NGRAM", "numDraftTokens": 6}
    kids = children_by_kind_name(tiny)
    args = container(kids, "StatefulSet", "tiny-decode")["args"]
    assert args[args.index("--speculative-algorithm") + 1] == "NGRAM"
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "6"
    assert args[args.index("--speculative-ngram-min-match-window-size") + 1] == "2"
    assert args[args.index("--speculative-ngram-max-match-window-size") + 1] == "8"
    # Prefill has nothing to draft for NGRAM: its pods keep their template (no rollout of prefill).
    assert container(kids, "StatefulSet", "tiny-prefill") == container(plain, "StatefulSet", "tiny-prefill")
    assert "--speculative-algorithm" not in container(kids, "Deployment", "tiny-router")["args"]


@pytest.mark.parametrize("algorithm", ["EAGLE", "STANDALONE"])
def test_a_draft_model_reaches_both_roles_from_the_model_volume_and_joins_the_pairing_revision(tiny, algorithm):
    """Prefill runs the draft over the prompt and sends its KV with the model's pages: both roles get the same
    flags, the draft's directory inside the mounted model volume, and a revision of their own (a prefill and a
    decode that disagree on the draft are never paired)."""
    plain = children_by_kind_name(tiny)
    tiny["spec"]["speculative"] = {"algorithm": algorithm, "draftModelPath": "drafts/tiny-eagle", "numSteps": 4}
    kids = children_by_kind_name(tiny)
    want = [
        "--speculative-algorithm",
        algorithm,
        "--speculative-draft-model-path",
        "/models/drafts/tiny-eagle",
        "--speculative-num-steps",
        "4",
    ]
    revisions = set()
    for name in ("tiny-prefill", "tiny-decode"):
        args = container(kids, "StatefulSet", name)["args"]
        i = args.index("--speculative-algorithm")
        assert args[i : i + len(want)] == want, name
        assert "--speculative-num-draft-tokens" not in args
        template = kids[("StatefulSet", name)]["spec"]["template"]
        revisions.add(template["metadata"]["labels"]["disagg.dev/revision"])
    plain_revision = plain[("StatefulSet", "tiny-decode")]["spec"]["template"]["metadata"]["labels"]
    assert len(revisions) == 1 and revisions != {plain_revision["disagg.dev/revision"]}


def test_a_dp_attention_decode_gets_its_groups_and_prefill_does_not(tiny):
    cr = tiny
    cr["spec"]["decode"] = {**cr["spec"].get("decode", {}), "tpSize": 2, "enableDpAttention": True, "dpSize": 2}
    kids = children_by_kind_name(cr)
    decode = container(kids, "StatefulSet", "tiny-decode")["args"]
    assert "--enable-dp-attention" in decode and decode[decode.index("--dp-size") + 1] == "2"
    prefill = container(kids, "StatefulSet", "tiny-prefill")["args"]
    assert "--enable-dp-attention" not in prefill and "--dp-size" not in prefill


def test_a_cache_aware_router_reads_the_models_tokenizer_from_the_workers_volume(tiny):
    tiny["spec"]["router"] = {**tiny["spec"].get("router", {}), "policy": "cache_aware"}
    children = children_by_kind_name(tiny)
    router, prefill = (
        container(children, "Deployment", "tiny-router"),
        container(children, "StatefulSet", "tiny-prefill"),
    )
    args = router["args"]
    assert args[args.index("--policy") + 1] == "cache_aware"
    assert args[args.index("--tokenizer") + 1] == prefill["args"][prefill["args"].index("--model") + 1]
    model_mount = next(m for m in prefill["volumeMounts"] if m["name"] == "model")
    assert model_mount in router["volumeMounts"] and model_mount["readOnly"] is True
    pod = children[("Deployment", "tiny-router")]["spec"]["template"]["spec"]
    worker_pod = children[("StatefulSet", "tiny-prefill")]["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "model") == next(
        v for v in worker_pod["volumes"] if v["name"] == "model"
    )
    # The other policies need no model: the router mounts none.
    tiny["spec"]["router"]["policy"] = "least_load"
    plain = container(children_by_kind_name(tiny), "Deployment", "tiny-router")
    assert "--tokenizer" not in plain["args"] and all(m["name"] != "model" for m in plain["volumeMounts"])


def test_decode_cache_and_conditional_disaggregation_reach_the_decode_pods_and_the_router(tiny):
    tiny["spec"]["router"] = {**tiny["spec"].get("router", {}), "policy": "cache_aware", "decodeOnlyTokens": 64}
    tiny["spec"]["decode"] = {**tiny["spec"].get("decode", {}), "prefixCache": True}
    kids = children_by_kind_name(tiny)
    router = container(kids, "Deployment", "tiny-router")["args"]
    decode = container(kids, "StatefulSet", "tiny-decode")["args"]
    prefill = container(kids, "StatefulSet", "tiny-prefill")["args"]
    assert router[router.index("--decode-only-tokens") + 1] == "64"
    assert "--decode-prefix-cache" in decode and "--local-prefill" in decode
    assert "--decode-prefix-cache" not in prefill and "--local-prefill" not in prefill
    # Off (the default): no flag, so existing models' pods do not roll on upgrade.
    tiny["spec"]["router"] = {"policy": "cache_aware"}
    tiny["spec"]["decode"].pop("prefixCache")
    kids = children_by_kind_name(tiny)
    assert "--decode-only-tokens" not in container(kids, "Deployment", "tiny-router")["args"]
    assert not {"--decode-prefix-cache", "--local-prefill"} & set(container(kids, "StatefulSet", "tiny-decode")["args"])


def test_a_role_whose_instances_span_nodes_is_one_leaderworkerset_of_groups(tiny):
    tiny["spec"]["decode"] = {**tiny["spec"].get("decode", {}), "replicas": 3, "tpSize": 2, "gpusPerNode": 1}
    kids = children_by_kind_name(tiny)
    assert ("StatefulSet", "tiny-decode") not in kids and ("StatefulSet", "tiny-prefill") in kids
    lws = kids[("LeaderWorkerSet", "tiny-decode-group")]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 3
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # the leader is Ready only once the workers' ranks met
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"] == 0
    template = group["workerTemplate"]
    digest = lws["metadata"]["annotations"][names.TEMPLATE_HASH_ANNOTATION]
    assert template["metadata"]["labels"][names.TEMPLATE_HASH_LABEL] == digest
    args = template["spec"]["containers"][0]["args"]
    assert args[args.index("--nnodes") + 1] == "2" and args[args.index("--tp-size") + 1] == "2"
    assert args[args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert args[args.index("--dist-init-addr") + 1] == f"$(LWS_LEADER_ADDRESS):{names.DIST_PORT}"
    # The router finds (and the bootstrap Service reaches) only the pods that serve HTTP: the leaders.
    assert kids[("Service", "tiny-decode")]["spec"]["selector"][names.LWS_WORKER_INDEX_LABEL] == "0"
    assert names.LWS_WORKER_INDEX_LABEL not in kids[("Service", "tiny-prefill")]["spec"]["selector"]
    # The group's pods reach one another on any port (the collectives'); nothing else changes.
    ingress = kids[("NetworkPolicy", "tiny-decode")]["spec"]["ingress"]
    group = {names.MODEL_LABEL: "tiny", names.ROLE_LABEL: "decode", names.LWS_NAME_LABEL: "tiny-decode-group"}
    group_rule = {"from": [{"podSelector": {"matchLabels": group}}]}
    assert ingress[-1] == group_rule and all("ports" in r for r in ingress[:-1])
    assert all("ports" in r for r in kids[("NetworkPolicy", "tiny-prefill")]["spec"]["ingress"])


def test_a_prefill_that_spans_nodes_is_bootstrapped_through_its_leaders(gpu):
    gpu["spec"]["prefill"] = {**gpu["spec"]["prefill"], "tpSize": 4, "gpusPerNode": 2, "resources": {"gpus": 2}}
    gpu["spec"]["decode"] = {**gpu["spec"]["decode"], "tpSize": 4, "gpusPerNode": 8, "resources": {"gpus": 4}}
    kids = children_by_kind_name(gpu)
    name = gpu["metadata"]["name"]
    assert kids[("Service", f"{name}-bootstrap")]["spec"]["selector"][names.LWS_WORKER_INDEX_LABEL] == "0"
    pod = kids[("LeaderWorkerSet", f"{name}-prefill-group")]["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2  # one node's ranks
    assert ("StatefulSet", f"{name}-decode") in kids  # 4 ranks fit its 8-GPU nodes


def _variants() -> list[dict]:
    """The CPU example, and the same with each setting the workers' command lines carry changed."""

    def spec_with(**changes) -> dict:
        cr = load_example("dm-cpu-tcp.yaml")
        for path, value in changes.items():
            *parents, key = path.split("__")
            node = cr["spec"]
            for p in parents:
                node = node.setdefault(p, {})
            if value is None:
                node.pop(key, None)
            else:
                node[key] = value
        return cr

    volume = {"model__pvc": "models", "model__hostPath": None}
    return [
        load_example("dm-cpu-tcp.yaml"),
        load_example("dm-rdma-gpu.yaml"),
        spec_with(engine={}, decode__engine={"chunkSize": 128, "dtype": "float16"}, prefill__engine={"pageSize": 64}),
        spec_with(speculative={"algorithm": "NGRAM", "numDraftTokens": 6, "ngramMaxMatchWindowSize": 12}),
        spec_with(**volume, speculative={"algorithm": "EAGLE", "draftModelPath": "/eagle/", "numSteps": 4}),
        spec_with(decode__tpSize=4, decode__epSize=4, decode__enableDpAttention=True, decode__dpSize=2),
        spec_with(decode__prefixCache=True, router__policy="cache_aware", router__decodeOnlyTokens=64),
        spec_with(
            transfer={"backend": "mooncake", "protocol": "rdma", "ibDevice": "mlx5_0"}, drain={"timeoutSeconds": 45}
        ),
        spec_with(transfer={"backend": "fake"}, servedModelName=None),
    ]


# The CRD's engine fields and the worker's flags that carry them, spelled out apart from the operator's table.
ENGINE_FLAGS = {
    "pageSize": "page_size",
    "kvDtype": "kv_dtype",
    "dtype": "dtype",
    "chunkSize": "chunk_size",
    "maxTotalTokens": "max_total_tokens",
    "maxRunningRequests": "max_running_requests",
}


def _speculative_values(d: dict | None, role: str) -> dict:
    if not d or (role == names.PREFILL and "draftModelPath" not in d):
        return {"algorithm": ""}
    if "draftModelPath" in d:
        path = f"{names.MODEL_MOUNT}/{d['draftModelPath'].strip('/')}"
        return {"algorithm": d["algorithm"], "draft_model_path": path, "num_steps": d.get("numSteps", 3)}
    windows = (d.get("ngramMinMatchWindowSize", 2), d.get("ngramMaxMatchWindowSize", 8))
    return {"algorithm": d["algorithm"], "num_draft_tokens": d.get("numDraftTokens", 8), "windows": windows}


def _parsed_speculative(ns, expected: dict) -> dict:
    parsed = {
        "algorithm": ns.speculative_algorithm,
        "draft_model_path": ns.speculative_draft_model_path,
        "num_steps": ns.speculative_num_steps,
        "num_draft_tokens": ns.speculative_num_draft_tokens,
        "windows": (ns.speculative_ngram_min_match_window_size, ns.speculative_ngram_max_match_window_size),
    }
    return {k: parsed[k] for k in expected}


@pytest.mark.parametrize("cr", _variants())
def test_the_worker_parses_the_command_line_into_the_crs_values(cr):
    """Every setting the operator sends reaches the worker as the CR says (the defaults as the API server fills
    them in), read by the worker's own parser."""
    from disagg_worker.cli import build_parser

    spec = cr["spec"]
    engine_schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaults = {k: v["default"] for k, v in engine_schema["properties"]["engine"]["properties"].items()}
    for role in names.WORKER_ROLES:
        ns = build_parser().parse_args(worker_args(ModelSpec.from_cr(cr), role))
        r = spec.get(role, {})
        engine = {**defaults, **spec.get("engine", {}), **r.get("engine", {})}
        assert {field: getattr(ns, dest) for field, dest in ENGINE_FLAGS.items()} == engine
        assert (ns.command, ns.served_model_name) == (role, spec.get("servedModelName") or cr["metadata"]["name"])
        sizes = (r.get("tpSize", 1), r.get("ppSize", 1), r.get("epSize", 1), r.get("dpSize", 1))
        assert (ns.tp_size, ns.pp_size, ns.ep_size, ns.dp_size) == sizes
        assert ns.enable_dp_attention == r.get("enableDpAttention", False)
        assert ns.decode_prefix_cache == r.get("prefixCache", False)
        assert ns.local_prefill == (role == names.DECODE and spec["router"].get("decodeOnlyTokens", 0) > 0)
        transfer = spec.get("transfer", {})
        assert ns.transfer_backend == transfer.get("backend", "mooncake")
        assert (ns.transfer_protocol, ns.ib_device) == (transfer.get("protocol", "tcp"), transfer.get("ibDevice", ""))
        assert ns.drain_timeout == spec.get("drain", {}).get("timeoutSeconds", 30)
        expected = _speculative_values(spec.get("speculative"), role)
        assert _parsed_speculative(ns, expected) == expected


def test_every_value_the_crds_engine_block_accepts_is_one_the_worker_takes():
    """A value the worker refused would fail in a pod's log instead of at `kubectl apply`."""
    from disagg_worker.cli import build_parser

    props = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    engine = props["properties"]["engine"]["properties"]
    assert list(engine) == [f.name for f in ENGINE_FIELDS]
    for f in ENGINE_FIELDS:
        node = engine[f.name]
        for value in node.get("enum", [node.get("minimum"), node["default"]]):
            ns = build_parser().parse_args(["decode", "--model", "m", *f.setting.args(value)])
            assert getattr(ns, f.setting.dest) == value


def test_a_migration_limit_the_cr_sets_reaches_the_router_and_none_is_added_otherwise(tiny):
    import argparse

    from disagg_worker.router.args import add_router_args

    assert "--migration-limit" not in router_args(ModelSpec.from_cr(tiny), CFG), "an unset field rolls no router"
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    for limit in (0, 5):
        tiny["spec"]["router"] = {**tiny["spec"].get("router", {}), "migrationLimit": limit}
        assert parser.parse_args(router_args(ModelSpec.from_cr(tiny), CFG)[1:]).migration_limit == limit


def test_spec_tracing_reaches_the_router_and_every_worker_and_nothing_is_added_without_it(tiny):
    import argparse

    from disagg_worker.cli import build_parser
    from disagg_worker.router.args import add_router_args

    router = argparse.ArgumentParser()
    add_router_args(router)
    untraced = ModelSpec.from_cr(tiny)
    assert not any("otlp" in a for a in router_args(untraced, CFG) + worker_args(untraced, names.DECODE))
    tiny["spec"]["tracing"] = {"otlpEndpoint": "otel-collector.observability:4318", "samplingRatio": 0.25}
    spec = ModelSpec.from_cr(tiny)
    parsed = [router.parse_args(router_args(spec, CFG)[1:])]
    parsed += [build_parser().parse_args(worker_args(spec, role)) for role in (names.PREFILL, names.DECODE)]
    for ns in parsed:
        assert (ns.otlp_traces_endpoint, ns.otlp_traces_sampling_ratio) == ("otel-collector.observability:4318", 0.25)

"""Each CEL rule of the CRD rejects a violating DisaggregatedModel at `kubectl apply`, with the rule's message."""

from __future__ import annotations

import copy
import json

import pytest
from test_operator_support import REPO, apply_cr, kube_timeout, load_example

from disagg_operator import crd

ALL_MESSAGES = {message for _, _, message in crd.RULES}


def message_of(fragment: str) -> str:
    matches = [m for _, r, m in crd.RULES if fragment in r]
    assert len(matches) == 1, fragment
    return matches[0]


def tiny(**spec) -> dict:
    cr = load_example("dm-cpu-tcp.yaml")
    for path, value in spec.items():
        node = cr["spec"]
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return cr


SLO = {"ttftMs": 500, "itlMs": 50}
DIGEST = "0123456789abcdef0123456789abcdef"  # an API key's digest, as spec.router.flowControl names a key

VIOLATIONS = [
    ("prefill replicas", tiny(prefill__replicas=-1), "self.prefill.replicas >= 0"),
    (
        "cache-aware router with a downloaded model",
        tiny(router__policy="cache_aware", model={"huggingFaceId": "Qwen/Qwen2.5-0.5B-Instruct"}),
        "self.router.policy != 'cache_aware'",
    ),
    (
        "decode-only tokens without the cache-aware router",
        tiny(router__policy="least_load", router__decodeOnlyTokens=64),
        "self.router.decodeOnlyTokens == 0",
    ),
    ("decode replicas", tiny(decode__replicas=-2), "self.decode.replicas >= 0"),
    ("router replicas", tiny(router__replicas=-1), "self.router.replicas >= 0"),
    ("pipeline sizes", tiny(prefill__ppSize=2, decode__ppSize=3), "decode.ppSize == self.prefill.ppSize"),
    ("tensor sizes", tiny(prefill__tpSize=3, decode__tpSize=2), "dpSize) % (self.decode.tpSize"),
    (
        "tensor sizes per attention group",
        tiny(prefill__tpSize=4, prefill__enableDpAttention=True, prefill__dpSize=2, decode__tpSize=3),
        "dpSize) % (self.decode.tpSize",
    ),
    ("plain data parallelism", tiny(decode__tpSize=2, decode__dpSize=2), "self.decode.dpSize == 1 || "),
    (
        "attention groups dividing the ranks",
        tiny(prefill__tpSize=4, prefill__enableDpAttention=True, prefill__dpSize=3),
        "self.prefill.tpSize % self.prefill.dpSize == 0",
    ),
    (
        "prefill dp attention over stages",
        tiny(prefill__ppSize=2, prefill__enableDpAttention=True, decode__ppSize=2),
        "!self.prefill.enableDpAttention || ",
    ),
    (
        "decode dp attention over stages",
        tiny(prefill__ppSize=2, decode__enableDpAttention=True, decode__ppSize=2),
        "!self.decode.enableDpAttention || ",
    ),
    ("prefill plain data parallelism", tiny(prefill__tpSize=2, prefill__dpSize=2), "self.prefill.dpSize == 1 || "),
    (
        "decode attention groups dividing the ranks",
        tiny(decode__tpSize=2, decode__enableDpAttention=True, decode__dpSize=4),
        "self.decode.tpSize % self.decode.dpSize == 0",
    ),
    ("prefill expert sizes", tiny(prefill__tpSize=2, prefill__epSize=4), "self.prefill.epSize == 1 || "),
    ("decode expert sizes", tiny(decode__tpSize=4, decode__epSize=2), "self.decode.epSize == 1 || "),
    ("page size", tiny(decode__engine={"pageSize": 32}), "engine.pageSize"),
    (
        "speculative windows",
        tiny(speculative={"algorithm": "NGRAM", "ngramMinMatchWindowSize": 5, "ngramMaxMatchWindowSize": 3}),
        "ngramMinMatchWindowSize <= ",
    ),
    ("draft model without a path", tiny(speculative={"algorithm": "EAGLE"}), "? !has(self.draftModelPath)"),
    (
        "ngram with a draft path",
        tiny(speculative={"algorithm": "NGRAM", "draftModelPath": "d"}),
        "? !has(self.draftModelPath)",
    ),
    (
        "draft outside a model volume",
        tiny(speculative={"algorithm": "EAGLE", "draftModelPath": "d"}, model={"builtin": "smollm2"}),
        "has(self.speculative.draftModelPath)",
    ),
    (
        "draft model on several ranks",
        tiny(speculative={"algorithm": "STANDALONE", "draftModelPath": "d"}, prefill__tpSize=2, decode__tpSize=2),
        "(self.prefill.tpSize * self.prefill.ppSize == 1",
    ),
    ("kv dtype", tiny(prefill__engine={"kvDtype": "bfloat16"}), "engine.kvDtype"),
    ("prefill gpus", tiny(prefill__tpSize=2, prefill__resources={"gpus": 3}), "self.prefill.resources.gpus == 0"),
    ("decode gpus", tiny(decode__resources={"gpus": 2}), "self.decode.resources.gpus == 0"),
    (
        "prefill ranks not whole nodes",
        tiny(prefill__tpSize=12, decode__tpSize=4),
        "self.prefill.tpSize * self.prefill.ppSize % self.prefill.gpusPerNode == 0",
    ),
    (
        "decode ranks not whole nodes",
        tiny(decode__tpSize=4, decode__gpusPerNode=3),
        "self.decode.tpSize * self.decode.ppSize % self.decode.gpusPerNode == 0",
    ),
    (
        "prefill beyond eight nodes",
        tiny(prefill__tpSize=4, prefill__ppSize=4, prefill__gpusPerNode=1, decode__ppSize=4, decode__tpSize=2),
        "self.prefill.tpSize * self.prefill.ppSize <= self.prefill.gpusPerNode * 8",
    ),
    (
        "decode beyond eight nodes",
        tiny(decode__tpSize=16, decode__gpusPerNode=1),
        "self.decode.tpSize * self.decode.ppSize <= self.decode.gpusPerNode * 8",
    ),
    (
        "gpus per pod of a group",
        tiny(decode__tpSize=4, decode__gpusPerNode=2, decode__resources={"gpus": 4}),
        "self.decode.resources.gpus == 0",
    ),
    ("rdma needs mooncake", tiny(transfer={"backend": "fake", "protocol": "rdma"}), "protocol != 'rdma'"),
    (
        "ib device needs rdma",
        tiny(transfer={"backend": "mooncake", "protocol": "tcp", "ibDevice": "mlx5_0"}),
        "ibDevice",
    ),
    (
        "both model sources",
        tiny(model={"hostPath": "/m", "path": "x", "huggingFaceId": "a/b"}),
        "filter(x, x).size() == 1",
    ),
    ("no model source", tiny(model={"cacheSize": "1Gi"}), "filter(x, x).size() == 1"),
    ("builtin and a path", tiny(model={"builtin": "smollm2", "hostPath": "/m", "path": "x"}), "filter(x, x)"),
    ("builtin with a volume", tiny(model={"builtin": "smollm2", "pvc": "p"}), "all(x, !x)"),
    ("path without volume", tiny(model={"path": "x"}), "has(self.pvc) || has(self.hostPath)"),
    ("two volumes", tiny(model={"path": "x", "pvc": "p", "hostPath": "/m"}), "has(self.pvc) && has(self.hostPath)"),
    (
        "a prefill host tier of a ratio and a size",
        tiny(kvCache={"prefill": {"hostRatio": 2, "hostSize": "1Gi"}}),
        "has(self.prefill.hostRatio) && has(self.prefill.hostSize)",
    ),
    (
        "a decode host tier of a ratio and a size",
        tiny(kvCache={"decode": {"hostRatio": 2, "hostSize": "1Gi"}}),
        "has(self.decode.hostRatio) && has(self.decode.hostSize)",
    ),
    ("a KV store without memory", tiny(kvCache={"store": {"memory": "0Gi"}}), "self.store.memory.matches"),
    ("an slo with the planner off", tiny(scaling={"slo": SLO, "planner": {"mode": "Off"}}), "mode != 'Off'"),
    ("a planner without an slo", tiny(scaling={"planner": {"mode": "Apply"}}), "mode == 'Off' || has(self.slo)"),
    (
        "a planner keeping a ratio that is not set",
        tiny(scaling={"slo": SLO, "planner": {"relation": "PrefillPerDecode"}}),
        "'PrefillPerDecode' || has(self.prefillPerDecode)",
    ),
    (
        "a planner sizing prefill on its own beside a ratio",
        tiny(scaling={"slo": SLO, "prefillPerDecode": 0.5, "planner": {}}),
        "'Independent' || !has(self.prefillPerDecode)",
    ),
    (
        "prefill bounds where prefill follows decode",
        tiny(
            scaling={
                "slo": SLO,
                "prefillPerDecode": 0.5,
                "planner": {"relation": "PrefillPerDecode", "prefill": {"maxReplicas": 4}},
            }
        ),
        "!has(self.planner.prefill)",
    ),
    (
        "a fast loop slower than the slow one",
        tiny(scaling={"slo": SLO, "planner": {"intervalSeconds": 30, "correctionIntervalSeconds": 60}}),
        "correctionIntervalSeconds <=",
    ),
    (
        "prefill minimum above its maximum",
        tiny(scaling={"slo": SLO, "planner": {"prefill": {"minReplicas": 3, "maxReplicas": 2}}}),
        "has(self.planner.prefill.minReplicas)",
    ),
    (
        "decode minimum above the default maximum",
        tiny(scaling={"slo": SLO, "planner": {"decode": {"minReplicas": 9}}}),
        "has(self.planner.decode.minReplicas)",
    ),
    (
        "a gpu budget below the minimums",
        tiny(
            prefill__resources={"gpus": 1},
            decode__resources={"gpus": 1},
            scaling={"slo": SLO, "planner": {"gpuBudget": 1}},
        ),
        "gpuBudget >=",
    ),
    (
        "a cache-aware gateway picker with a downloaded model",
        tiny(gateway={"policy": "cache_aware"}, model={"huggingFaceId": "Qwen/Qwen2.5-0.5B-Instruct"}),
        "self.gateway.policy != 'cache_aware'",
    ),
    (
        "cache size without a download cache",
        tiny(model={"hostPath": "/m", "path": "x", "cacheSize": "10Gi"}),
        "!has(self.cacheSize)",
    ),
    (
        "a flow priority range upside down",
        tiny(router__flowControl={"minPriority": 3, "maxPriority": 2}),
        "self.minPriority <= self.maxPriority",
    ),
    ("an empty flow queue", tiny(router__flowControl={"queueSize": 0}), "self.queueSize >= 1"),
    ("a flow queue without a time to live", tiny(router__flowControl={"queueTTLSeconds": 0}), "queueTTLSeconds > 0.0"),
    (
        "an objective named twice",
        tiny(router__flowControl={"objectives": [{"name": "chat", "priority": 5}, {"name": "chat", "priority": 1}]}),
        "self.objectives.exists_one",
    ),
    (
        "an objective a header cannot carry",
        tiny(router__flowControl={"objectives": [{"name": "chat, batch", "priority": 5}]}),
        "o.name.matches(",
    ),
    (
        "an objective above the highest priority",
        tiny(router__flowControl={"objectives": [{"name": "chat", "priority": 11}]}),
        "o.priority <= self.maxPriority",
    ),
    (
        "a key named by the key itself",
        tiny(
            apiKeySecret={"name": "keys"},
            router__flowControl={"keyPriorities": [{"digest": "sk-team-a-secret", "priority": 1}]},
        ),
        "k.digest.matches(",
    ),
    (
        "a key capped twice",
        tiny(
            apiKeySecret={"name": "keys"},
            router__flowControl={
                "keyPriorities": [{"digest": DIGEST, "priority": 1}, {"digest": DIGEST, "priority": 2}]
            },
        ),
        "self.keyPriorities.exists_one",
    ),
    (
        "a key capped below the lowest priority",
        tiny(
            apiKeySecret={"name": "keys"},
            router__flowControl={"minPriority": 0, "keyPriorities": [{"digest": DIGEST, "priority": -1}]},
        ),
        "k.priority <= self.maxPriority",
    ),
    (
        "key caps without API keys",
        tiny(router__flowControl={"keyPriorities": [{"digest": DIGEST, "priority": 1}]}),
        "has(self.apiKeySecret)",
    ),
    (
        "an adapter from two sources",
        tiny(lora={"adapters": [{"name": "sql", "configMap": "sql", "hostPath": "/srv/sql"}]}),
        "(has(self.configMap) ? 1 : 0)",
    ),
    (
        "an adapter's path without a pvc",
        tiny(lora={"adapters": [{"name": "sql", "configMap": "sql", "path": "v2"}]}),
        "has(self.pvc) || !has(self.path)",
    ),
    (
        "an adapter's path out of its pvc",
        tiny(lora={"adapters": [{"name": "sql", "pvc": "adapters", "path": "sql/../../etc"}]}),
        "[.][.]",
    ),
    (
        "an adapter named twice",
        tiny(lora={"adapters": [{"name": "sql", "configMap": "a"}, {"name": "sql", "configMap": "b"}]}),
        "self.adapters.exists_one",
    ),
    (
        "an adapter named as the served model",
        tiny(lora={"adapters": [{"name": "tiny-llama", "configMap": "a"}]}),
        "a.name != ",
    ),
    (
        "adapters on a tensor-parallel decode",
        tiny(decode__tpSize=2, lora={"adapters": [{"name": "sql", "configMap": "a"}]}),
        "self.decode.tpSize == 1 && self.decode.ppSize == 1",
    ),
]


@pytest.fixture(scope="module")
def crd_installed(kube_cluster):
    kube_cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds" / "disagg.dev_disaggregatedmodels.yaml")
    )
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", f"--timeout={kube_timeout(60)}", "crd/disaggregatedmodels.disagg.dev"
    )


def test_every_rule_is_exercised_here():
    exercised = {message_of(f) for _, _, f in VIOLATIONS} | {m for _, r, m in crd.RULES if "oldSelf" in r}
    exercised |= {m for w, _, m in crd.RULES if w == ""}
    assert exercised == ALL_MESSAGES


@pytest.mark.parametrize("case,cr,fragment", VIOLATIONS, ids=[v[0] for v in VIOLATIONS])
def test_violation_is_rejected_with_the_rules_message(kube_cluster, crd_installed, namespace, case, cr, fragment):
    proc = apply_cr(kube_cluster, namespace, copy.deepcopy(cr), check=False)
    assert proc.returncode != 0
    assert message_of(fragment) in proc.stderr


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("a" * 41, "size() <= 40"),
        ("9lives", "metadata.name.matches("),
    ],
)
def test_names_that_cannot_name_children_are_rejected(kube_cluster, crd_installed, namespace, name, fragment):
    cr = load_example("dm-cpu-tcp.yaml", name=name)
    proc = apply_cr(kube_cluster, namespace, cr, check=False)
    assert proc.returncode != 0 and message_of(fragment) in proc.stderr


def test_a_role_that_spans_nodes_needs_a_shorter_name(kube_cluster, crd_installed, namespace):
    cr = load_example("dm-cpu-tcp.yaml", name="a" * 35)
    apply_cr(kube_cluster, namespace, cr)  # 35 characters: fine for one-node roles
    cr["spec"]["decode"].update(tpSize=2, gpusPerNode=1)
    cr["metadata"]["name"] = "b" * 35
    proc = apply_cr(kube_cluster, namespace, cr, check=False)
    assert proc.returncode != 0 and message_of("size() <= 34") in proc.stderr
    cr["metadata"]["name"] = "b" * 34
    apply_cr(kube_cluster, namespace, cr)


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("model", {"hostPath": "/m", "path": "other"}, "model is immutable"),
        ("servedModelName", "renamed", "servedModelName is immutable"),
        ("transfer", {"backend": "fake", "protocol": "tcp"}, "transfer is immutable"),
    ],
)
def test_immutable_fields_cannot_change(kube_cluster, crd_installed, namespace, field, value, fragment):
    apply_cr(kube_cluster, namespace, load_example("dm-cpu-tcp.yaml"))
    changed = load_example("dm-cpu-tcp.yaml")
    changed["spec"][field] = value
    proc = apply_cr(kube_cluster, namespace, changed, check=False)
    assert proc.returncode != 0 and fragment in proc.stderr


def test_the_download_cache_may_change_but_not_the_model(kube_cluster, crd_installed, namespace):
    cr = tiny(model={"huggingFaceId": "Qwen/Qwen2.5-0.5B-Instruct"})
    apply_cr(kube_cluster, namespace, copy.deepcopy(cr))
    cr["spec"]["model"]["cacheSize"] = "40Gi"
    apply_cr(kube_cluster, namespace, copy.deepcopy(cr))
    cr["spec"]["model"]["huggingFaceId"] = "Qwen/Qwen2.5-7B-Instruct"
    proc = apply_cr(kube_cluster, namespace, cr, check=False)
    assert proc.returncode != 0 and "model is immutable" in proc.stderr


def test_eight_ranks_fit_an_eight_gpu_node_and_sixteen_span_two(kube_cluster, crd_installed, namespace):
    def ranks(tp: int, pp: int, gpus: int, **more) -> dict:
        return {"tpSize": tp, "ppSize": pp, "resources": {"gpus": gpus}, **more}

    # Sixteen ranks span two eight-GPU nodes: each pod asks for one node's GPUs, not the instance's.
    whole = tiny(prefill=ranks(4, 2, 8), decode=ranks(8, 2, 16))
    proc = apply_cr(kube_cluster, namespace, whole, check=False)
    assert proc.returncode != 0
    assert message_of("self.decode.resources.gpus ==") in proc.stderr
    assert message_of("self.prefill.resources.gpus ==") not in proc.stderr
    uneven = tiny(prefill=ranks(4, 2, 8), decode=ranks(8, 2, 6, gpusPerNode=6))
    proc = apply_cr(kube_cluster, namespace, uneven, check=False)
    assert proc.returncode != 0
    assert message_of("self.decode.tpSize * self.decode.ppSize % self.decode.gpusPerNode == 0") in proc.stderr
    apply_cr(kube_cluster, namespace, tiny(prefill=ranks(4, 2, 8), decode=ranks(8, 2, 8)))


@pytest.mark.parametrize("example", ["dm-cpu-tcp.yaml", "dm-rdma-gpu.yaml"])
def test_examples_pass_validation_and_get_defaults(kube_cluster, crd_installed, namespace, example):
    out = kube_cluster.kubectl(
        "-n", namespace, "apply", "--dry-run=server", "-o", "json", "-f", str(REPO / "examples" / example)
    )
    spec = json.loads(out.stdout)["spec"]
    assert spec["prefill"]["tpSize"] >= 1 and spec["imagePullPolicy"] == "IfNotPresent"
    assert spec["auth"] == {}


def test_speculative_algorithms_are_checked_at_apply(kube_cluster, crd_installed, namespace):
    """An unknown algorithm is refused naming the ones there are; NGRAM, and a draft model in the model's volume
    on single-rank roles, are taken."""
    proc = apply_cr(kube_cluster, namespace, tiny(speculative={"algorithm": "MEDUSA"}), check=False)
    assert proc.returncode != 0 and "spec.speculative.algorithm" in proc.stderr and "STANDALONE" in proc.stderr
    apply_cr(kube_cluster, namespace, tiny(speculative={"algorithm": "NGRAM"}))
    apply_cr(kube_cluster, namespace, tiny(speculative={"algorithm": "EAGLE", "draftModelPath": "drafts/eagle"}))


def test_a_planner_within_its_rules_is_taken_with_its_defaults(kube_cluster, crd_installed, namespace):
    cr = tiny(
        prefill__resources={"gpus": 1},
        decode__resources={"gpus": 1},
        scaling={"slo": SLO, "planner": {"mode": "Apply", "gpuBudget": 2, "decode": {"maxReplicas": 1}}},
    )
    out = kube_cluster.kubectl(
        "-n", namespace, "apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(cr)
    )
    scaling = json.loads(out.stdout)["spec"]["scaling"]
    assert scaling["slo"] == {**SLO, "percentile": 90}
    assert scaling["planner"] == {
        "mode": "Apply",
        "gpuBudget": 2,
        "decode": {"maxReplicas": 1},
        "intervalSeconds": 60,
        "correctionIntervalSeconds": 10,
        "relation": "Independent",
        "maxStepReplicas": 4,
        "scaleDownStabilizationSeconds": 300,
    }


def test_flow_control_within_its_rules_is_taken_with_the_routers_defaults(kube_cluster, crd_installed, namespace):
    """Objectives at the range's ends and of every allowed spelling, a key's cap by its digest: taken, and the
    settings left out get the router's defaults."""
    objectives = [{"name": "chat", "priority": 10}, {"name": "batch.nightly_v2", "priority": -10}]
    cr = tiny(
        apiKeySecret={"name": "keys"},
        router__flowControl={"objectives": objectives, "keyPriorities": [{"digest": DIGEST, "priority": 0}]},
    )
    out = kube_cluster.kubectl(
        "-n", namespace, "apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(cr)
    )
    assert json.loads(out.stdout)["spec"]["router"]["flowControl"] == {
        "enabled": True,
        "queueSize": 256,
        "queueTTLSeconds": 30,
        "minPriority": -10,
        "maxPriority": 10,
        "objectives": objectives,
        "keyPriorities": [{"digest": DIGEST, "priority": 0}],
    }
    assert (
        "flowControl"
        not in json.loads(
            kube_cluster.kubectl(
                "-n", namespace, "apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(tiny())
            ).stdout
        )["spec"]["router"]
    )


def test_the_flow_control_model_the_docs_show_is_taken(kube_cluster, crd_installed, namespace):
    text = (REPO / "docs" / "flow-control.md").read_text().split("## With the operator", 1)[1]
    cr = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    out = kube_cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-o", "json", "-f", "-", input=cr)
    flow = json.loads(out.stdout)["spec"]["router"]["flowControl"]
    assert flow["enabled"] is True and [o["name"] for o in flow["objectives"]] == ["chat", "batch"]


def test_adapters_within_the_rules_are_taken_with_the_workers_defaults(kube_cluster, crd_installed, namespace):
    """Each source once, a name of every allowed spelling: taken, the slots at the workers' defaults; a name that
    cannot be a directory of /lora is refused by the schema."""
    adapters = [
        {"name": "sql", "configMap": "sql-adapter"},
        {"name": "Chat.v2_final-1", "pvc": "adapters", "path": "chat/v2"},
        {"name": "med", "hostPath": "/srv/adapters/med"},
    ]
    out = kube_cluster.kubectl(
        "-n",
        namespace,
        "apply",
        "--dry-run=server",
        "-o",
        "json",
        "-f",
        "-",
        input=json.dumps(tiny(lora={"adapters": adapters})),
    )
    assert json.loads(out.stdout)["spec"]["lora"] == {"adapters": adapters, "maxLoras": 1, "maxLoraRank": 16}
    bad = tiny(lora={"adapters": [{"name": "../sql", "configMap": "a"}]})
    proc = apply_cr(kube_cluster, namespace, bad, check=False)
    assert proc.returncode != 0 and "spec.lora.adapters[0].name" in proc.stderr


def test_the_lora_model_the_docs_show_is_taken(kube_cluster, crd_installed, namespace):
    text = (REPO / "docs" / "lora.md").read_text().split("## With the operator", 1)[1]
    cr = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    out = kube_cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-o", "json", "-f", "-", input=cr)
    lora = json.loads(out.stdout)["spec"]["lora"]
    assert [a["name"] for a in lora["adapters"]] == ["sql", "chat"] and lora["maxLoras"] == 2

"""Which router pods the operator believes: only those the model's own router Deployment created.

A router's /health report opens or holds the surge-rollout gate and fills PairingVerified, and the operator
presents the model's health token to read it; a label is no proof, since anyone who may create a pod in the
namespace can set it. So a pod is probed only when its controlling owner is a ReplicaSet whose controlling owner
is the Deployment named as the model's router, and that Deployment's controlling owner is the model: every link
checked by uid, from what the watch indexes hold (observe.py: the pods, ReplicaSets and Deployments labelled as
the operator's). A router pod whose ReplicaSet the index has not seen yet (the Deployment controller made both a
moment ago) waits for the next round without being named; any other pod that fails the check is refused and
named (reconcile.py posts a Warning event when the set changes).

Owner references are not signed either: a pod whose creator copies the real ReplicaSet's uid passes, and is then
counted by that ReplicaSet's controller as one of its replicas (which deletes surplus pods). The check stops a
pod that only carries the labels; docs/security.md says what it does not stop.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from . import names
from .observe import OwnerLink, PodInfo


@dataclass(frozen=True)
class RouterTargets:
    probe: dict[str, str]  # router pod name -> pod IP, for those the model's Deployment created
    refused: tuple[str, ...] = ()  # router-labelled pods it did not create (sorted)


def router_targets(
    model_uid: str, model_name: str, pods: Iterable[PodInfo], links: Iterable[OwnerLink]
) -> RouterTargets:
    """The router pods of the model `model_uid` to probe, and those to refuse (see the module docstring)."""
    by_uid: Mapping[str, OwnerLink] = {link.uid: link for link in links if link.uid}
    deployment = names.child_name(model_name, names.ROUTER)
    probe: dict[str, str] = {}
    refused = []
    for pod in pods:
        if pod.role != names.ROUTER or pod.terminating:
            continue
        replica_set = by_uid.get(pod.owner_uid) if pod.owner_kind == "ReplicaSet" else None
        if pod.owner_kind == "ReplicaSet" and replica_set is None:
            continue  # its ReplicaSet is not in the index yet: the next round decides
        owner = by_uid.get(replica_set.owner_uid) if replica_set and replica_set.kind == "ReplicaSet" else None
        if owner is None or (owner.kind, owner.name, owner.owner_uid) != ("Deployment", deployment, model_uid):
            refused.append(pod.name)
        elif pod.ip:
            probe[pod.name] = pod.ip
    return RouterTargets(probe, tuple(sorted(refused)))

"""Prefill's RoleScaler and prefillPerDecode: who wins when, and which writes it costs."""

import pytest

from disagg_operator.builders import build_role_scaler
from disagg_operator.scaling import ScalerObservation, ScalerSync, observe_scaler, sync_scaler
from disagg_operator.spec import ModelSpec, prefill_for_decode


def cr(prefill: int = 1, decode: int = 2, ratio: float | None = None) -> dict:
    spec = {
        "model": {"hostPath": "/m", "path": "x"},
        "image": "img",
        "prefill": {"replicas": prefill},
        "decode": {"replicas": decode},
    }
    if ratio is not None:
        spec["scaling"] = {"prefillPerDecode": ratio}
    return {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": spec}


SELECTOR = "disagg.dev/model=m,disagg.dev/role=prefill"


def synced(replicas: int, generation: int = 3, current: int | None = None) -> ScalerObservation:
    status = {"replicas": replicas if current is None else current, "selector": SELECTOR}
    return ScalerObservation(replicas, generation, {**status, "observedGeneration": generation})


@pytest.mark.parametrize("decode,ratio,prefill", [(2, 0.5, 1), (6, 0.5, 3), (5, 0.5, 3), (1, 0.25, 1), (0, 0.5, 0)])
def test_prefill_follows_decode_rounded_up_and_at_least_one(decode, ratio, prefill):
    assert prefill_for_decode(decode, ratio) == prefill
    assert ModelSpec.from_cr(cr(prefill=7, decode=decode, ratio=ratio)).replicas("prefill") == prefill


def test_the_scaler_starts_with_the_models_prefill_replicas_and_names_its_target():
    obj = build_role_scaler(ModelSpec.from_cr(cr(prefill=2)), "prefill")
    assert obj["kind"] == "RoleScaler" and obj["metadata"]["name"] == "m-prefill"
    assert obj["spec"] == {"model": "m", "role": "prefill", "replicas": 2}
    assert obj["metadata"]["ownerReferences"][0]["kind"] == "DisaggregatedModel"


def test_in_step_there_is_nothing_to_write():
    assert sync_scaler(ModelSpec.from_cr(cr(prefill=2)), synced(2), 2) == ScalerSync()
    behind = synced(2, current=1)  # the status still shows the StatefulSet before its last scale
    assert sync_scaler(ModelSpec.from_cr(cr(prefill=2)), behind, 1).scaler_status is None  # still scaling
    assert sync_scaler(ModelSpec.from_cr(cr(prefill=2)), behind, 2).scaler_status["replicas"] == 2  # settled


def test_scaling_the_scaler_is_handed_to_the_model():
    scaled = ScalerObservation(4, 4, {"replicas": 2, "selector": SELECTOR, "observedGeneration": 3})
    sync = sync_scaler(ModelSpec.from_cr(cr(prefill=2)), scaled, 2)
    assert sync.model_replicas == 4 and sync.scaler_replicas is None
    assert sync.scaler_status == {"replicas": 2, "selector": SELECTOR, "observedGeneration": 4}


def test_editing_the_model_moves_the_scaler_so_an_hpa_reads_the_truth():
    sync = sync_scaler(ModelSpec.from_cr(cr(prefill=3)), synced(2), 3)
    assert sync.scaler_replicas == 3 and sync.model_replicas is None
    assert sync.scaler_status == {"replicas": 3, "selector": SELECTOR, "observedGeneration": 3}


def test_with_a_ratio_the_scaler_only_shows_what_decode_implies():
    scaled = ScalerObservation(9, 4, {"replicas": 1, "selector": SELECTOR, "observedGeneration": 3})
    sync = sync_scaler(ModelSpec.from_cr(cr(decode=6, ratio=0.5)), scaled, 1)
    assert sync.model_replicas is None and sync.scaler_replicas == 3


def test_observe_scaler_reads_spec_generation_and_status():
    obj = {"metadata": {"generation": 2}, "spec": {"replicas": 5}, "status": {"observedGeneration": 1}}
    assert observe_scaler(obj) == ScalerObservation(5, 2, {"observedGeneration": 1})
    assert observe_scaler({"metadata": {}, "spec": {}}) == ScalerObservation(0, 0, {})


def test_a_new_scaler_counts_as_in_step_until_someone_scales_it():
    fresh = ScalerObservation(1, 1, {})  # just created, no status yet
    edited = sync_scaler(ModelSpec.from_cr(cr(prefill=2)), fresh, None)
    assert edited == ScalerSync(None, 2, None)  # the model was edited: the scaler follows; status waits
    scaled_early = ScalerObservation(4, 2, {})
    assert sync_scaler(ModelSpec.from_cr(cr(prefill=1)), scaled_early, None).model_replicas == 4

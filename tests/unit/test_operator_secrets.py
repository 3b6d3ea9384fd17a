"""Secrets a model refers to must exist before anything of it is applied: a user sees why in the status."""

from __future__ import annotations

import pytest

from disagg_operator.apply_errors import ReconcileError
from tests.unit.test_operator_status import CR, runtime  # noqa: F401 - the fixture


def test_a_missing_api_key_secret_is_reported_before_anything_is_applied(runtime):  # noqa: F811
    cr = {**CR, "spec": {**CR["spec"], "apiKeySecret": {"name": "client-keys"}}}
    with pytest.raises(ReconcileError, match="API key Secret client-keys not found.*'api-key'") as err:
        runtime.apply_children(cr)
    assert not err.value.permanent and runtime.kube.applied == []
    runtime.kube.objects[("Secret", "client-keys")] = {"data": {"api-key": "azE="}}
    runtime.apply_children(cr)
    assert "Deployment/m-router" in runtime.kube.applied

"""Property-based fuzz of the served OpenAPI schema: whatever schemathesis sends, no 5xx.

Requests that pass validation do generate (capped at 2 tokens by the server's -n, in a 128-token
context), so every endpoint's real path runs, not only its validation.
"""

from __future__ import annotations

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from hypothesis import HealthCheck, settings

from lucebox_core.server import ModelService, ServeConfig, create_app
from lucebox_core.server.testing import ServerThread


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("LUCEBOX_HOME", str(tmp_path_factory.mktemp("lucebox-home")))
    service = ModelService(ServeConfig(ctx_size=128, n_predict=2))
    service.load()
    assert service.status == "ok", service.error
    with ServerThread(create_app(service.config, service)) as url:
        # The coverage phase alone sends hundreds of boundary cases per endpoint: too slow with a model
        # behind every valid one. Examples and hypothesis-driven fuzzing stay.
        config = SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False},
                                                          "stateful": {"enabled": False}}})
        yield schemathesis.openapi.from_url(f"{url}/schema/openapi.json", config=config)
    service.close()
    patch.undo()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_no_request_makes_a_server_error(case):
    response = case.call(timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        assert "error" in response.json(), response.text  # every failure has an API-shaped JSON body

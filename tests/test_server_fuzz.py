"""Property-based fuzz of the served OpenAPI schema: whatever schemathesis sends, no 5xx.

Requests that pass validation do generate (capped at 2 tokens by the server's -n, in a 128-token
context), so every endpoint's real path runs, not only its validation.

The tool-schema fuzz gives schemathesis's chat requests a tool with a generated JSON schema (the subset
tools use, now and then something no grammar enforces or no validator accepts) and a tool_choice: the
answer is never a 5xx, and every call that max_tokens did not cut validates against its tool's schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from lucebox_core.server import ModelService, ServeConfig, create_app
from lucebox_core.server.testing import ServerThread


def _served_schema(tmp_path_factory, model: str | None = None):
    """A served tiny model (the default one, or `model`) and the OpenAPI schema schemathesis fuzzes it with."""
    patch = pytest.MonkeyPatch()
    patch.setenv("LUCEBOX_HOME", str(tmp_path_factory.mktemp("lucebox-home")))
    service = ModelService(ServeConfig(model=model, ctx_size=128, n_predict=2))
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


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    yield from _served_schema(tmp_path_factory)


@pytest.fixture(scope="module")
def gemma4_api_schema(tmp_path_factory):
    """The same server on a tiny Gemma-4 (its own template, parser and grammar behind every endpoint)."""
    from lucebox_gemma4 import synth

    model = synth.write(tmp_path_factory.mktemp("gemma4") / "tiny-q8_0.gguf", size="tiny", type="q8_0", seed=3)
    yield from _served_schema(tmp_path_factory, str(model))


schema = schemathesis.pytest.from_fixture("api_schema")
gemma4_schema = schemathesis.pytest.from_fixture("gemma4_api_schema")


def _check_response(case) -> None:
    response = case.call(timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        assert "error" in response.json(), response.text  # every failure has an API-shaped JSON body


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_no_request_makes_a_server_error(case):
    _check_response(case)


@gemma4_schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_no_request_makes_a_server_error_on_gemma4(case):
    _check_response(case)


# -- the tool-schema fuzz -----------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "city", "n", "x_y", "deep", "odd key", "ünï"])
PATTERNS = ["^[a-z]{1,4}$", "^[0-9]+$", "ab", "^x", "(", "a(?=b)"]  # the last two: no grammar takes them


def _bounds(kind: str):
    number = st.integers(-50, 50) if kind == "integer" else st.floats(-50, 50, allow_nan=False).map(lambda f: round(f, 2))
    return st.fixed_dictionaries({}, optional={"minimum": number, "maximum": number, "exclusiveMinimum": number})


LEAVES = st.one_of(
    st.fixed_dictionaries({"type": st.just("string"), "maxLength": st.integers(0, 8)}, optional={
        "minLength": st.integers(0, 3), "pattern": st.sampled_from(PATTERNS)}),  # short: calls finish in time
    st.builds(lambda extra: {"type": "integer", **extra}, _bounds("integer")),
    st.builds(lambda extra: {"type": "number", **extra}, _bounds("number")),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": ["string", "null"], "maxLength": 3},
                     {"enum": ["red", "green", 3, None]}, {"const": "fixed"}, {}, {"type": "integr"},
                     {"type": "array", "uniqueItems": True}, {"not": {"type": "string"}}, {"enum": []}]),
)


def _object(children):
    return st.builds(
        lambda properties, required, closed: {"type": "object", "properties": properties,
                                              "required": [k for k in properties if k in required],
                                              **({"additionalProperties": False} if closed else {})},
        st.dictionaries(NAMES, children, min_size=1, max_size=3), st.sets(NAMES), st.booleans())


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    _object(children),
    st.builds(lambda items, low, high: {"type": "array", "items": items, "minItems": low, "maxItems": high},
              children, st.integers(0, 1), st.integers(1, 2)),
    st.builds(lambda options: {"anyOf": options}, st.lists(children, min_size=1, max_size=2)),
), max_leaves=5)


@pytest.fixture(scope="module")
def tool_schema_api(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("LUCEBOX_HOME", str(tmp_path_factory.mktemp("lucebox-home")))
    service = ModelService(ServeConfig(ctx_size=512, n_predict=48))
    service.load()
    assert service.status == "ok", service.error
    tokenizer = service.loaded.tokenizer
    # Under "auto", the opening tag the likeliest token wherever the text is free, so calls do happen.
    bias = {str(tokenizer.token_to_id("<tool_call>")): 100, **{str(t): 96 for t in tokenizer.eot_ids}}
    with ServerThread(create_app(service.config, service)) as url:
        config = SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}, "examples": {"enabled": False},
                                                          "stateful": {"enabled": False}}})
        chat = schemathesis.openapi.from_url(f"{url}/schema/openapi.json", config=config)

        @chat.hook
        def flatmap_body(context, body):
            # What schemathesis drew that a tool request keeps: a seed, and stop strings (which must not cut a call).
            body = body if isinstance(body, dict) else {}
            sampling = {"temperature": 1.0, "seed": body["seed"] if isinstance(body.get("seed"), int) else 0}
            if isinstance(body.get("stop"), str) or (isinstance(body.get("stop"), list) and len(body["stop"]) <= 4
                                                     and all(isinstance(x, str) for x in body["stop"])):
                sampling["stop"] = body["stop"]
            return st.builds(
                lambda schema, choice: {
                    **sampling, "messages": [{"role": "user", "content": "Call the tool."}], "max_tokens": 48,
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                    "tool_choice": choice, **({"logit_bias": bias} if choice == "auto" else {})},
                st.one_of(_object(SCHEMAS), _object(SCHEMAS), _object(SCHEMAS), SCHEMAS),  # mostly objects, as tools take
                st.sampled_from(["auto", "required", {"type": "function", "function": {"name": "f"}}] * 2
                                + [{"type": "function", "function": {"name": "f"}}]))

        yield chat
    service.close()
    patch.undo()


tool_schema = schemathesis.pytest.from_fixture("tool_schema_api").include(path="/v1/chat/completions", method="POST")


@pytest.mark.slow
@tool_schema.parametrize()
@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_tool_schemas_never_make_a_server_error_and_calls_validate(case):
    response = case.call(timeout=120)
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        assert "error" in response.json(), response.text
        return
    choice = response.json()["choices"][0]
    schema = case.body["tools"][0]["function"]["parameters"]
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError:
        return  # not a valid schema, so no validation to promise (the server need not refuse it)
    calls = choice["message"].get("tool_calls") or []
    if choice["finish_reason"] == "length":
        calls = calls[:-1]  # max_tokens cut the output: no promise about the call it cut
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)

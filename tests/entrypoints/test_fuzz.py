"""Property-based fuzzing of every endpoint, generated from the app's own OpenAPI schema.

For each operation of ``/openapi.json`` hypothesis draws request bodies three ways: valid per the
schema, valid then mutated (a field set to arbitrary JSON, a required field removed, an unknown
field added), and arbitrary JSON; routes that parse their own body (raw safetensors uploads) also
get arbitrary bytes, and query parameters are drawn from their schemas plus unknown ones. The
properties: no response is a 5xx other than the documented ones (503 not ready, 504 timed out),
every error has the one error shape of api.md, and after each operation's run the server is still
healthy (``/health`` and a valid rollout answer 200). The server has an API key and an admin key and
every fuzzed request carries the admin key, so the fuzz reaches every route's body handling; a
second pass sends the same shapes with no key or a wrong one and expects 401/403 from every guarded
route, whatever the body.

Decisions:

- A converter from the JSON-schema subset FastAPI emits (``$ref``, ``anyOf``, ``enum``, ``const``,
  numeric bounds, arrays, objects with ``additionalProperties``) to strategies, rather than
  schemathesis: one light dependency (hypothesis) and full control over the budget.
- Budget: ``MAX_EXAMPLES`` per operation, derandomized (the same examples in every CI run), no
  example database; the server runs with small limits so that valid rollouts cost milliseconds.
- Two kinds of operation are fuzzed with care, not skipped: pause and memory release change server
  state, so each such example is followed by continue/resume (a paused server would hold the next
  rollout forever by design); ``/init_weights_update_group`` with a *valid* body joins a process
  group at the given address and waits for its peers (up to ``timeout_s``), so its bodies are always
  made invalid (``master_port`` not a port) and only the validation layer is fuzzed there.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.entrypoints.app import create_app
from diffusion_rollout.entrypoints.auth_gate import route_key_levels

# An extreme flow_shift overflows in numpy before validation refuses the schedule (a 400).
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")

MAX_EXAMPLES = 25
# The rollout endpoint has the largest input space and the deepest code behind it.
EXAMPLES = {"/rollout/generate": 150}
# A longer, random search (nightly or by hand): DIFFUSION_ROLLOUT_FUZZ_SCALE=20 DIFFUSION_ROLLOUT_FUZZ_RANDOM=1.
SCALE = float(os.environ.get("DIFFUSION_ROLLOUT_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("DIFFUSION_ROLLOUT_FUZZ_RANDOM") == "1"
FUZZ_LIMITS = {
    "max_steps": 3,
    "max_pixels": 64 * 64,
    "max_outputs_per_request": 2,
    "max_frames": 5,
    "max_queue_depth": 8,
    # Below the examples' 10 s deadline: a fuzzed rollout with a min_weight_version that is never held
    # waits this long, then answers 504. At 60 s, a deadline miss under load sent Hypothesis into
    # shrinking through such waits, a minute each (seen on a loaded 2-core machine).
    "request_timeout_s": 4.0,
    "api_key": "fuzz-api-key",
    "admin_key": "fuzz-admin-key",
}
ADMIN = {"Authorization": "Bearer fuzz-admin-key"}
# 5xx answers api.md documents: not ready (loading, released, shutting down) and a request timeout.
DOCUMENTED_5XX = {(503, "service_unavailable"), (504, "request_timeout")}
VALID_ROLLOUT = {"prompt": "a red cat", "width": 32, "height": 32, "num_inference_steps": 2, "seed": 1}
RESTORE_AFTER = {
    "/pause_generation": "/continue_generation",
    "/release_memory_occupation": "/resume_memory_occupation",
}

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8,
)


# ---------------------------------------------------------------------------- schema -> strategy
def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    if depth > 6:
        return st.none()
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, defs, depth + 1) for s in schema[key]])
    if "allOf" in schema:
        return from_schema(schema["allOf"][0], defs, depth + 1)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            lo = int(schema["exclusiveMinimum"]) + 1
        if "exclusiveMaximum" in schema:
            hi = int(schema["exclusiveMaximum"]) - 1
        return st.integers(
            min_value=None if lo is None else int(lo), max_value=None if hi is None else int(hi)
        )
    if kind == "number":
        return st.floats(
            min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
            max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=max(schema.get("minLength", 0), 30))
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, depth + 1)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, min(schema.get("maxItems", 4), 4)))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fixed = {k: from_schema(v, defs, depth + 1) for k, v in props.items() if k in required}
        optional = {k: from_schema(v, defs, depth + 1) for k, v in props.items() if k not in required}
        if not props:
            return st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=3)
        return st.fixed_dictionaries(fixed, optional=optional)
    return JSON_VALUES


def mutate(value: Any) -> st.SearchStrategy:
    """A valid body made (probably) invalid: one field changed, removed or added."""
    if not isinstance(value, dict) or not value:
        return st.one_of(st.just(value), JSON_VALUES)
    keys = sorted(value)

    def apply(args):
        how, key, new_key, junk = args
        out = dict(value)
        if how == "set":
            out[key] = junk
        elif how == "drop":
            out.pop(key)
        else:
            out[new_key or "unknown_field"] = junk
        return out

    return st.tuples(
        st.sampled_from(["set", "drop", "add"]), st.sampled_from(keys), st.text(max_size=8), JSON_VALUES
    ).map(apply)


def servable_rollouts() -> st.SearchStrategy:
    """Rollout bodies that mostly pass validation and run (schema-valid ones rarely fit the limits):
    any subset of the fields drawn from their schemas, over a servable geometry and step count."""
    props = SPEC_DEFS["GenerateRequest"]["properties"]
    fields = {k: from_schema(v, SPEC_DEFS) for k, v in props.items() if k != "extra_sampling_params"}
    geometry = st.fixed_dictionaries(
        {
            "width": st.sampled_from([16, 32, 48, 64]),
            "height": st.sampled_from([16, 32, 48, 64]),
            "num_inference_steps": st.integers(1, 3),
            "num_outputs_per_prompt": st.integers(1, 2),
        },
        optional={"max_sequence_length": st.integers(1, 64)},
    )
    return st.tuples(st.fixed_dictionaries({}, optional=fields), geometry).map(
        lambda fg: {**VALID_ROLLOUT, **fg[0], **fg[1]}
    )


# ---------------------------------------------------------------------------- operations
# The schema only: an app over an engine that is never started (nothing loads).
SPEC = create_app(ServerConfig(model="unused", device="cpu")).openapi()
SPEC_DEFS = SPEC["components"]["schemas"]
OPERATIONS = [
    (method.upper(), path, op) for path, methods in SPEC["paths"].items() for method, op in methods.items()
]


def request_strategy(method: str, path: str, op: dict) -> st.SearchStrategy:
    json_schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if json_schema is not None:
        valid = from_schema(json_schema, SPEC_DEFS)
        if path == "/rollout/generate":
            valid = st.one_of(valid, servable_rollouts())
        json_body = st.one_of(valid, valid.flatmap(mutate), JSON_VALUES)
        body = json_body.map(lambda b: ("json", b))
    elif method == "POST":
        # Routes that read their own body (safetensors uploads, LoRA in either form).
        body = st.one_of(
            JSON_VALUES.map(lambda b: ("json", b)),
            st.binary(max_size=256).map(lambda b: ("bytes", b)),
            st.just(("none", None)),
        )
    else:
        body = st.just(("none", None))
    if path == "/init_weights_update_group":
        body = body.map(
            lambda kb: (
                ("json", {**kb[1], "master_port": "not-a-port"})
                if kb[0] == "json" and isinstance(kb[1], dict)
                else kb
            )
        )

    params = {}
    for p in op.get("parameters", []):
        if p.get("in") == "query":
            params[p["name"]] = from_schema(p.get("schema", {}), SPEC_DEFS)
    query = st.fixed_dictionaries({}, optional=params) if params else st.just({})
    extra = st.dictionaries(st.sampled_from(["x", "finale", "target"]), st.text(max_size=5), max_size=1)
    query = st.tuples(query, extra).map(lambda qe: {**qe[1], **qe[0]})
    return st.tuples(body, query)


def _query_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path):
    from tests.conftest import ServedModel

    server = ServedModel(tiny_model_path("sd3"), **FUZZ_LIMITS)
    yield server
    server.close()


def _send(server, method: str, path: str, body, query: dict, auth: dict[str, str] = ADMIN):
    kind, payload = body
    params = {k: t for k, v in query.items() if (t := _query_text(v)) is not None}
    kwargs: dict[str, Any] = {"params": params, "headers": dict(auth)}
    if kind == "json":
        kwargs["content"] = json.dumps(payload).encode()
        kwargs["headers"]["Content-Type"] = "application/json"
    elif kind == "bytes":
        kwargs["content"] = payload
        kwargs["headers"]["Content-Type"] = "application/octet-stream"
    return server.client.request(method, path, **kwargs)


def _assert_healthy(server) -> None:
    assert server.client.get("/health").status_code == 200
    r = server.client.post("/rollout/generate", json=VALID_ROLLOUT, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert server.engine.worker.paused is False and server.engine.status == "ready"


@pytest.mark.parametrize(("method", "path", "op"), OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
def test_fuzz_endpoint_never_5xx_and_server_stays_healthy(fuzz_server, method, path, op):
    @settings(
        max_examples=max(1, round(EXAMPLES.get(path, MAX_EXAMPLES) * SCALE)),
        deadline=datetime.timedelta(seconds=10),
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(request_strategy(method, path, op))
    def check(request):
        body, query = request
        try:
            r = _send(fuzz_server, method, path, body, query)
        finally:
            if path in RESTORE_AFTER:
                fuzz_server.client.post(RESTORE_AFTER[path], headers=ADMIN)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["code"] == r.status_code and err["message"] and err["type"], r.text
            documented = (r.status_code, err["type"]) in DOCUMENTED_5XX
            assert r.status_code < 500 or documented, f"{method} {path} {body} {query} -> {r.text[:500]}"

    check()
    _assert_healthy(fuzz_server)


# The routes that need a key, as the app's own gate reads them (test_reliability_keys.py checks
# that every route but the public ones is among them).
GUARDED_PATHS = route_key_levels(create_app(ServerConfig(model="unused", device="cpu")))
GUARDED = [(m, p, op) for m, p, op in OPERATIONS if p in GUARDED_PATHS]


@pytest.mark.parametrize(("method", "path", "op"), GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED])
def test_fuzz_without_the_key_is_refused_before_the_body(fuzz_server, method, path, op):
    @settings(max_examples=5, deadline=None, derandomize=True, database=None)
    @given(request_strategy(method, path, op), st.sampled_from([{}, {"Authorization": "Bearer wrong"}]))
    def check(request, auth):
        body, query = request
        r = _send(fuzz_server, method, path, body, query, auth)
        assert r.status_code == (403 if auth else 401), (method, path, r.text[:300])

    check()


def test_every_operation_is_fuzzed():
    paths = {p for _, p, _ in OPERATIONS}
    assert {"/rollout/generate", "/update_weights", "/lora/load", "/pause_generation", "/metrics"} <= paths
    assert len(OPERATIONS) >= 25

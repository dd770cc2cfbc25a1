"""The HTTP API reference (api.md's ``openapi`` section): every route of the app, from its OpenAPI
schema; the app is constructed, never started (no model is loaded).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from gen_markdown import cell, docstring_markdown, md

# ------------------------------------------------------------------------------------ the HTTP API
# Section titles for the routers (entrypoints/routers/*.py); a router not named here gets its
# module name. The order is the app's.
ROUTER_TITLES = {
    "health": "Health and information",
    "rollout": "Rollouts",
    "weights": "Full-weight updates",
    "lora": "LoRA adapters",
    "admin": "Pause and memory",
    "metrics": "Metrics",
    "sglang_compat": "SGLang routes",
}
# Routers whose module docstring is about internals rather than use (the route is described by
# hand above the generated reference).
ROUTER_DOC_SKIPPED = {"rollout"}
KEY_NAMES = {"api": "API key", "admin": "admin key"}


def build_app():
    """The app as ``serve`` builds it, with nothing loaded: the model loads in the lifespan, which
    never runs here (OpenAPI generation needs only the routes)."""
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app

    return create_app(ServerConfig())


def _schema_type(schema: dict[str, Any], schemas: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_model_anchor(name)})"
    if "anyOf" in schema:
        kinds = [_schema_type(s, schemas) for s in schema["anyOf"] if s.get("type") != "null"]
        return " or ".join(dict.fromkeys(kinds))
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " or ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"list of {_schema_type(schema.get('items', {}), schemas)}"
    if kind == "object":
        return "object"
    if kind == "string" and schema.get("contentMediaType") == "application/octet-stream":
        return "bytes"
    return kind or "any"


_BOUNDS = (
    ("minimum", ">="),
    ("exclusiveMinimum", ">"),
    ("maximum", "<="),
    ("exclusiveMaximum", "<"),
    ("minLength", "length >="),
    ("maxLength", "length <="),
    ("minItems", "items >="),
    ("maxItems", "items <="),
)


def _number(value: float) -> str:
    """``1.0`` as 1, and a bound such as 2**63 as ``2^63`` rather than 9.22337e+18."""
    whole = int(value) if float(value).is_integer() else 0
    if whole >= 2**20 and whole & (whole - 1) == 0:
        return f"2^{whole.bit_length() - 1}"
    return f"{value:g}"


def _bounds(schema: dict[str, Any]) -> str:
    """The JSON schema's bounds in words; a list's bounds on its items read "each >= 1"."""
    parts: list[str] = []

    def add(sub: dict[str, Any], prefix: str = "") -> None:
        parts.extend(f"{prefix}{sign} {_number(sub[key])}" for key, sign in _BOUNDS if key in sub)
        if isinstance(sub.get("items"), dict):
            add(sub["items"], "each ")

    for sub in [schema, *schema.get("anyOf", [])]:
        add(sub)
    return ", ".join(dict.fromkeys(parts))


def _default(schema: dict[str, Any], required: bool) -> str:
    if required:
        return "required"
    if "default" in schema:
        return f"`{json.dumps(schema['default'])}`"
    return "unset"


def _fields_table(model: dict[str, Any], schemas: dict[str, Any]) -> list[str]:
    """One row per field; the bounds and description columns only where some field has one."""
    required = set(model.get("required", []))
    rows = [
        [
            f"`{name}`",
            cell(_schema_type(schema, schemas)),
            _default(schema, name in required),
            cell(_bounds(schema)),
            cell(md(schema.get("description", ""))),
        ]
        for name, schema in model.get("properties", {}).items()
    ]
    header = ["field", "type", "default", "bounds", "description"]
    keep = [i for i in range(len(header)) if i < 3 or any(row[i] for row in rows)]
    lines = ["| " + " | ".join(header[i] for i in keep) + " |", "|" + " --- |" * len(keep)]
    lines += ["| " + " | ".join(row[i] for i in keep) + " |" for row in rows]
    return lines


def _anchor(anchor: str) -> list[str]:
    """The lines that give the next heading the id ``anchor`` in the repository and on the site
    alike (GitHub shows a ``{#id}`` attribute list as text). The blank line matters: GitHub would
    read a heading right after the tag as part of an HTML block."""
    return [f'<a id="{anchor}"></a>', ""]


def _model_anchor(name: str) -> str:
    return "model-" + name.lower()


def _route_anchor(method: str, path: str) -> str:
    return method.lower() + "-" + re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _endpoint_modules(app: Any) -> dict[tuple[str, str], str]:
    """``(path, method) -> module`` of the function that serves it (its router)."""
    import fastapi.routing

    iter_contexts = getattr(fastapi.routing, "iter_route_contexts", None)  # nested routers
    routes = list(iter_contexts(app.routes)) if iter_contexts else list(app.routes)
    modules: dict[tuple[str, str], str] = {}
    for route in routes:
        endpoint = getattr(route, "endpoint", None)
        for method in getattr(route, "methods", None) or ():
            if endpoint is not None:
                modules[(route.path, method.lower())] = endpoint.__module__
    return modules


def openapi_reference() -> str:
    """Every route of the app: method, path, summary, the key it needs, query parameters and body
    fields, grouped by router; then the body models they refer to."""
    from diffusion_rollout.entrypoints.auth_gate import route_key_levels

    app = build_app()
    spec = app.openapi()
    schemas = spec.get("components", {}).get("schemas", {})
    levels = route_key_levels(app)
    modules = _endpoint_modules(app)
    groups: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            module = modules.get((path, method), "other")
            groups.setdefault(module, []).append((path, method.upper(), op))

    def key_of(path: str) -> str:
        return KEY_NAMES.get(levels.get(path, ""), "none")

    out: list[str] = [
        f"Generated from the app's OpenAPI schema by `python docs/generate.py`: "
        f"{sum(len(v) for v in groups.values())} routes.",
        "",
        "| method | path | summary | key |",
        "| --- | --- | --- | --- |",
    ]
    for ops in groups.values():
        for path, method, op in ops:
            out.append(
                f"| {method} | [`{path}`](#{_route_anchor(method, path)}) | {op.get('summary', '')} "
                f"| {key_of(path)} |"
            )
    out.append("")
    used_models: list[str] = []
    for module, ops in groups.items():
        name = module.rsplit(".", 1)[-1]
        out += [f"### {ROUTER_TITLES.get(name, name)}", ""]
        if name not in ROUTER_DOC_SKIPPED:
            out += [docstring_markdown(getattr(sys.modules.get(module), "__doc__", None)), ""]
        for path, method, op in ops:
            out += [*_anchor(_route_anchor(method, path)), f"#### {method} `{path}`", ""]
            key = levels.get(path)
            needs = f"needs the {KEY_NAMES[key]} when the server has one" if key else "no key"
            out += [f"*{op.get('summary', '')}*: {needs}.", ""]
            if op.get("description"):
                out += [md(op["description"]), ""]
            params = op.get("parameters", [])
            if params:
                out += [
                    "Query parameters:",
                    "",
                    "| parameter | type | default | description |",
                    "| --- | --- | --- | --- |",
                ]
                for p in params:
                    s = p.get("schema", {})
                    out.append(
                        f"| `{p['name']}` | {cell(_schema_type(s, schemas))} "
                        f"| {_default(s, p.get('required', False))} | {cell(md(p.get('description', '')))} |"
                    )
                out.append("")
            body = op.get("requestBody")
            for media, media_spec in (body or {}).get("content", {}).items():
                schema = media_spec.get("schema", {})
                refs = [schema.get("$ref")] + [s.get("$ref") for s in schema.get("anyOf", [])]
                for ref in filter(None, refs):
                    model = ref.rsplit("/", 1)[-1]
                    used_models.append(model)
                    optional = "required" if body.get("required") else "optional"
                    out += [f"Body (`{media}`, {optional}): [{model}](#{_model_anchor(model)}).", ""]
            if not body and not params and method == "POST":
                out += ["No body schema: see the section's introduction.", ""]
    out += ["### Request bodies", ""]
    seen: set[str] = set()
    queue = list(dict.fromkeys(used_models))
    while queue:
        name = queue.pop(0)
        if name in seen or name not in schemas:
            continue
        seen.add(name)
        model = schemas[name]
        out += [*_anchor(_model_anchor(name)), f"#### {name}", ""]
        if model.get("description"):
            out += [md(model["description"]), ""]
        if model.get("additionalProperties") is False:
            out += ["Unknown fields are refused (422).", ""]
        out += [*_fields_table(model, schemas), ""]
        queue += [n for n in re.findall(r"#/components/schemas/(\w+)", json.dumps(model)) if n not in seen]
    return "\n".join(out)

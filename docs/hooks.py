"""MkDocs hooks (``hooks:`` in mkdocs.yml): the parts of the site that come from the repository.

- ``on_files``: ``benchmarks/RESULTS.md`` becomes the page ``results.md``, and every file under
  ``benchmarks/results/`` is added under ``results/`` (the plots, the JSON and logs the rows link,
  ``HISTORY.md`` as a page), so RESULTS.md's relative links (``results/h200/x.json``,
  ``results/plots/drift.png``) resolve as they are. ``results/plots/index.md`` is generated: every
  plot on one page. Nothing is copied into ``docs/``; the files are read at build time.
- ``on_page_markdown``: the marker ``<!-- generated: openapi -->`` in api.md becomes the reference of
  every route of the app, built from its OpenAPI schema (the app is constructed, never started: no
  model is loaded); ``<!-- generated: serve-options -->`` in serving.md becomes the table of every
  ``diffusion-rollout serve`` option, from ``ServerConfig``, grouped as ``serve --help`` groups them (``config_options.OPTION_GROUPS``).
- ``on_page_content``: the results page's row ids (``<a id="...">`` inside table cells, raw HTML that
  MkDocs does not see) count as anchors, so ``validation.anchors: warn`` checks links to rows.
- ``on_serve``: ``mkdocs serve`` also watches the benchmark results and the sources read here.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
RESULTS_DIR = ROOT / "benchmarks" / "results"
CONFIG_PY = ROOT / "diffusion_rollout" / "config.py"

OPENAPI_MARKER = "<!-- generated: openapi -->"
OPTIONS_MARKER = "<!-- generated: serve-options -->"

if str(ROOT) not in sys.path:  # a checkout that is not pip-installed still builds
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------- results
def results_markdown(text: str) -> str:
    """RESULTS.md as the site's page. Its links into ``results/`` resolve unchanged (the files are
    mounted there); a link to the plots folder goes to the generated gallery page."""
    return text.replace("](results/plots/)", "](results/plots/index.md)")


def plots_gallery(pngs: list[Path]) -> str:
    lines = [
        "# Plots",
        "",
        "Drawn from the JSON of [the current figures](../../results.md) by `python -m benchmarks.plots`",
        "(the `plot` extra).",
        "",
    ]
    for png in pngs:
        lines += [f"## {png.stem}", "", f"![{png.stem}]({png.name})", ""]
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "results.md", content=results_markdown(RESULTS_MD.read_text())))
    for path in sorted(p for p in RESULTS_DIR.rglob("*") if p.is_file()):
        uri = "results/" + path.relative_to(RESULTS_DIR).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    pngs = sorted((RESULTS_DIR / "plots").glob("*.png"))
    files.append(File.generated(config, "results/plots/index.md", content=plots_gallery(pngs)))
    return files


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri == "results.md":
        page.present_anchor_ids.update(re.findall(r'<a id="([\w-]+)"></a>', html))
    return html


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    for path in (RESULTS_MD, RESULTS_DIR, CONFIG_PY, ROOT / "diffusion_rollout" / "entrypoints"):
        server.watch(str(path))
    return server


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if OPENAPI_MARKER in markdown:
        markdown = markdown.replace(OPENAPI_MARKER, openapi_reference())
    if OPTIONS_MARKER in markdown:
        markdown = markdown.replace(OPTIONS_MARKER, serve_options_reference())
    return markdown


# ----------------------------------------------------------------------------------- shared bits
def _md(text: str) -> str:
    """Docstring text (reST literals, free line breaks) as one markdown paragraph."""
    return " ".join(re.sub(r"``([^`]+)``", r"`\1`", text).split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _docstring_markdown(doc: str | None) -> str:
    """A module docstring as markdown: reST literals as code, its lists and paragraphs kept, the
    project's old page names as links to the site's pages."""
    paragraphs = []
    for block in inspect.cleandoc(doc or "").split("\n\n"):
        # Wrapped lines join their item or paragraph: only "- " at the margin starts a list item (a
        # continuation line that happens to start with "+ " or "1. " must not start one).
        items: list[str] = []
        for line in block.splitlines():
            if line.startswith("- ") or not items:
                items.append(line.strip())
            else:
                items[-1] += " " + line.strip()
        paragraphs.append("\n".join(items))
    text = re.sub(r"``([^`]+)``", r"`\1`", "\n\n".join(paragraphs))
    text = text.replace("(weights.md)", "(see [Weight and LoRA updates](weights.md))")
    return text.replace(" (api.md)", "")


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
            _cell(_schema_type(schema, schemas)),
            _default(schema, name in required),
            _cell(_bounds(schema)),
            _cell(_md(schema.get("description", ""))),
        ]
        for name, schema in model.get("properties", {}).items()
    ]
    header = ["field", "type", "default", "bounds", "description"]
    keep = [i for i in range(len(header)) if i < 3 or any(row[i] for row in rows)]
    lines = ["| " + " | ".join(header[i] for i in keep) + " |", "|" + " --- |" * len(keep)]
    lines += ["| " + " | ".join(row[i] for i in keep) + " |" for row in rows]
    return lines


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
        f"Generated at build time from the OpenAPI schema of `diffusion-rollout` "
        f"{spec['info']['version']}: {sum(len(v) for v in groups.values())} routes.",
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
            out += [_docstring_markdown(getattr(sys.modules.get(module), "__doc__", None)), ""]
        for path, method, op in ops:
            out += [f"#### {method} `{path}` {{#{_route_anchor(method, path)}}}", ""]
            key = levels.get(path)
            needs = f"needs the {KEY_NAMES[key]} when the server has one" if key else "no key"
            out += [f"*{op.get('summary', '')}*: {needs}.", ""]
            if op.get("description"):
                out += [_md(op["description"]), ""]
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
                        f"| `{p['name']}` | {_cell(_schema_type(s, schemas))} "
                        f"| {_default(s, p.get('required', False))} | {_cell(_md(p.get('description', '')))} |"
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
        out += [f"#### {name} {{#{_model_anchor(name)}}}", ""]
        if model.get("description"):
            out += [_md(model["description"]), ""]
        if model.get("additionalProperties") is False:
            out += ["Unknown fields are refused (422).", ""]
        out += [*_fields_table(model, schemas), ""]
        queue += [n for n in re.findall(r"#/components/schemas/(\w+)", json.dumps(model)) if n not in seen]
    return "\n".join(out)


# -------------------------------------------------------------------------------- serve options
def _config_groups() -> list[tuple[str, list[str]]]:
    """``ServerConfig``'s fields by concern: ``config_options.OPTION_GROUPS``, the groups ``serve --help`` shows."""
    from diffusion_rollout.config_options import OPTION_GROUPS

    return [(heading, list(names)) for heading, names in OPTION_GROUPS]


def _binary_size(value: object) -> str:
    """`` (8 Mi)`` after 8388608: the large defaults are powers-of-two multiples."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**20:
        for unit, size in (("Gi", 2**30), ("Mi", 2**20)):
            if value % size == 0:
                return f" ({value // size} {unit})"
    return ""


def serve_options_reference() -> str:
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.config_options import option_env_names

    fields = ServerConfig.model_fields
    groups = _config_groups()
    grouped = {n for _, names in groups for n in names}
    groups.append(("Other", [n for n in fields if n not in grouped]))  # e.g. fields set elsewhere
    out: list[str] = []
    for heading, names in groups:
        names = [n for n in names if n in fields]
        if not names:
            continue
        out += [f"### {heading}", "", "| option | default | description |", "| --- | --- | --- |"]
        for name in names:
            field = fields[name]
            flag = "--" + name.replace("_", "-")
            if field.annotation is bool:
                flag += f"` / `--no-{name.replace('_', '-')}"
            if field.default_factory is not None:
                default = "computed"
            elif field.default is None:
                default = "unset"
            else:
                default = f"`{json.dumps(field.default)}`" + _binary_size(field.default)
            env = "`, `".join(option_env_names(name))
            out.append(f"| `{flag}` (`{env}`) | {default} | {_cell(field.description or '')} |")
        out.append("")
    return "\n".join(out)

"""MkDocs hooks (``hooks:`` in mkdocs.yml), and the generator of the docs' generated sections.

The pages are written to read the same in the repository (as GitHub renders them) and on the site:
links go to the real files, and generated text is committed, not filled in at build time.

- ``on_files``: ``benchmarks/RESULTS.md`` becomes the page ``results.md``, and every file under
  ``benchmarks/results/`` is added under ``results/`` (the plots, the JSON and logs the rows link,
  ``HISTORY.md`` as a page), so RESULTS.md's relative links (``results/h200/x.json``,
  ``results/plots/drift.png``) resolve as they are. ``results/plots/index.md`` is generated: every
  plot on one page. Nothing is copied into ``docs/``; the files are read at build time.
- ``on_page_markdown``: a page's links to those files as the repository has them
  (``../benchmarks/RESULTS.md#row``, ``../benchmarks/results/plots/x.png``) become the site's paths
  (``results.md#row``, ``results/plots/x.png``).
- ``on_page_content``: every page's ``<a id="...">`` anchors (the results rows, the anchors written
  before headings; raw HTML that MkDocs does not see) count as anchors, so ``validation.anchors``
  checks links to them.
- ``on_serve``: ``mkdocs serve`` also watches the benchmark results.

Generated sections sit between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->`` in
a page and are committed. ``python docs/hooks.py`` rewrites them from the code; ``--check`` (and
``tests/docs/test_docs_generated.py``) fails when one is stale. ``openapi`` in api.md is every route
of the app, from its OpenAPI schema (the app is constructed, never started: no model is loaded);
``serve-options`` in serving.md is every ``diffusion-rollout serve`` option, from ``ServerConfig``,
grouped as ``serve --help`` groups them (``config_options.OPTION_GROUPS``); ``client-reference`` in
client.md is the signature and docstring of each public name of the trainer client.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mkdocs.structure.files import Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
RESULTS_DIR = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"

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
    # Imported here: regenerating the docs' sections (``python docs/hooks.py``) needs no MkDocs.
    from mkdocs.structure.files import File

    files.append(File.generated(config, "results.md", content=results_markdown(RESULTS_MD.read_text())))
    for path in sorted(p for p in RESULTS_DIR.rglob("*") if p.is_file()):
        uri = "results/" + path.relative_to(RESULTS_DIR).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    pngs = sorted((RESULTS_DIR / "plots").glob("*.png"))
    files.append(File.generated(config, "results/plots/index.md", content=plots_gallery(pngs)))
    return files


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    page.present_anchor_ids.update(re.findall(r'<a id="([\w-]+)"></a>', html))
    return html


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    for path in (RESULTS_MD, RESULTS_DIR):
        server.watch(str(path))
    return server


# A docs page (they all sit at the top of docs/) links the results as the repository has them, which
# is where a reader of the repository finds them; the site mounts the same files elsewhere (on_files).
_REPO_RESULTS_LINK = re.compile(r"\]\(\.\./benchmarks/(RESULTS\.md|results/)")


def site_links(markdown: str) -> str:
    """``](../benchmarks/RESULTS.md#row)`` as ``](results.md#row)``, ``](../benchmarks/results/x)`` as
    ``](results/x)``."""
    return _REPO_RESULTS_LINK.sub(lambda m: "](" + m.group(1).replace("RESULTS.md", "results.md"), markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return site_links(markdown)


# ----------------------------------------------------------------------------------- shared bits
def _md(text: str) -> str:
    """Docstring text (reST literals, free line breaks) as one markdown paragraph."""
    return " ".join(re.sub(r"``([^`]+)``", r"`\1`", text).split())


def _cell(text: str) -> str:
    """Text for a table cell; a ``<`` that starts a word outside code (``<cache_dir>/compile``) would
    read as an HTML tag and vanish."""
    text = re.sub(r"(`[^`]*`)|<(?=[A-Za-z/!?])", lambda m: m.group(1) or "&lt;", text)
    return text.replace("|", "\\|").replace("\n", " ")


# Google-style docstring sections: their indented ``name: text`` lines become a list.
_SECTION = re.compile(r"(Args|Arguments|Attributes|Returns|Yields|Raises):$")


def _section_markdown(lines: list[str]) -> str:
    """``Args:`` and its indented items as a list; an item's deeper lines continue it."""
    indent = len(lines[1]) - len(lines[1].lstrip())
    items: list[str] = []
    for line in lines[1:]:
        if len(line) - len(line.lstrip()) <= indent or not items:
            names, sep, rest = line.strip().partition(": ")
            if sep and re.fullmatch(r"\*{0,2}\w+(, \*{0,2}\w+)*", names):
                line = ", ".join(f"`{n}`" for n in names.split(", ")) + ": " + rest
            items.append("- " + line.strip())
        else:
            items[-1] += " " + line.strip()
    return lines[0] + "\n\n" + "\n".join(items)


def _docstring_markdown(doc: str | None) -> str:
    """A docstring as markdown: reST literals and roles as code, its lists, Google-style sections and
    paragraphs kept, the project's old page names as links to the site's pages."""
    paragraphs = []
    for block in inspect.cleandoc(doc or "").split("\n\n"):
        lines = block.splitlines()
        if len(lines) > 1 and _SECTION.match(lines[0]) and lines[1].startswith(" "):
            paragraphs.append(_section_markdown(lines))
            continue
        # Wrapped lines join their item or paragraph: only "- " at the margin starts a list item (a
        # continuation line that happens to start with "+ " or "1. " must not start one).
        items: list[str] = []
        for line in lines:
            if line.startswith("- ") or not items:
                items.append(line.strip())
            else:
                items[-1] += " " + line.strip()
        paragraphs.append("\n".join(items))
    text = re.sub(
        r":(?:class|func|meth|attr|data|mod|exc|obj):`~?([^`]+)`", r"``\1``", "\n\n".join(paragraphs)
    )
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
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
        f"Generated from the app's OpenAPI schema by `python docs/hooks.py`: "
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
            out += [_docstring_markdown(getattr(sys.modules.get(module), "__doc__", None)), ""]
        for path, method, op in ops:
            out += [*_anchor(_route_anchor(method, path)), f"#### {method} `{path}`", ""]
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
        out += [*_anchor(_model_anchor(name)), f"#### {name}", ""]
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


# ---------------------------------------------------------------------------- the client reference
# The public names client.md documents, by section, as ``module.name`` under ``diffusion_rollout``.
CLIENT_REFERENCE = (
    ("Clients", ("client.RolloutClient", "client.AsyncRolloutClient", "client.RetryPolicy")),
    (
        "Results",
        (
            "client.RolloutOutput",
            "client.DitTrajectory",
            "client.UpdateResult",
            "client.group_by_server_batch",
        ),
    ),
    (
        "Replay and losses",
        (
            "client.ReplayBatch",
            "client.ReplayedStep",
            "client.replay_steps",
            "client.group_advantages",
            "client.clipped_policy_loss",
            "client.tis_policy_loss",
            "client.ratio_stats_by_staleness",
            "client.gaussian_kl",
            "scheduler_mixins.transition",
        ),
    ),
    ("Streams", ("client.RolloutStream", "client.StreamBatch")),
    (
        "Weights",
        (
            "client.push_weights",
            "client.push_lora",
            "client.verify_lora",
            "client.push_weights_ipc",
            "client.WeightBroadcaster",
        ),
    ),
    ("Errors", ("client.RolloutHTTPError", "client.ChecksumMismatchError", "client.RequestValidationError")),
    (
        "flow_grpo drop-in",
        (
            "client.served_pipeline.ServedPipeline",
            "client.flow_grpo.pipeline_with_logprob",
            "client.flow_grpo_flux.pipeline_with_logprob",
        ),
    ),
)
# Its methods are RolloutClient's, awaitable: listing them twice would only double the page.
CLIENT_WITHOUT_MEMBERS = {"client.AsyncRolloutClient"}
_SIGNATURE_WIDTH = 100


class _Bare(str):
    """Text that a signature prints as it is (its repr would quote it)."""

    def __repr__(self) -> str:
        return str(self)


def _annotation(annotation: Any) -> Any:
    if annotation is inspect.Parameter.empty:
        return annotation
    # The modules use ``from __future__ import annotations``: most annotations are their source text.
    return _Bare(annotation if isinstance(annotation, str) else inspect.formatannotation(annotation))


def _signature(title: str, obj: Any, drop_first: bool = False) -> str:
    """``title(params) -> ret``, one parameter a line when it would be wider than the page."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a class with no Python __init__ of its own
        return title
    params = list(sig.parameters.values())[1 if drop_first else 0 :]
    shown = []
    for p in params:
        text = repr(p.default)
        # An object's default repr holds its memory address, which changes every run.
        default = _Bare("..." if " at 0x" in text else text)
        shown.append(
            p.replace(
                annotation=_annotation(p.annotation), default=p.empty if p.default is p.empty else default
            )
        )
    # A class shows its constructor's parameters; its ``-> None`` says nothing.
    ret = sig.empty if inspect.isclass(obj) else _annotation(sig.return_annotation)
    sig = sig.replace(parameters=shown, return_annotation=ret)
    one_line = f"{title}{sig}"
    if len(one_line) <= _SIGNATURE_WIDTH:
        return one_line
    # str() adds the "*" and "/" markers; its parameter list splits at the top-level commas.
    inner = str(sig.replace(return_annotation=sig.empty))[1:-1]
    tail = "" if ret is sig.empty else f" -> {ret}"
    return f"{title}(\n" + "".join(f"    {part.strip()},\n" for part in _top_level_split(inner)) + f"){tail}"


def _top_level_split(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties of ``cls`` and of its bases in this package, in source
    order (the class's own first)."""
    seen: dict[str, Any] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("diffusion_rollout"):
            continue
        for name, raw in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            if inspect.isfunction(raw) or isinstance(raw, (classmethod, staticmethod, property)):
                seen[name] = raw
    return list(seen.items())


def _reference_entry(path: str, with_members: bool) -> list[str]:
    module, _, name = ("diffusion_rollout." + path).rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    title = path.removeprefix("client.")
    if not inspect.isclass(obj):
        kind = "async def" if inspect.iscoroutinefunction(obj) else "def"
        out = [f"#### `{title}`", "", "```python", _signature(f"{kind} {name}", obj), "```", ""]
        return [*out, _docstring_markdown(inspect.getdoc(obj)), ""]
    # The class's own docstring: inspect.getdoc would give an undocumented one its base's.
    out = [f"#### `{title}`", "", "```python", _signature(f"class {name}", obj), "```", ""]
    out += [_docstring_markdown(obj.__doc__), ""]
    for member, raw in _members(obj) if with_members else []:
        func = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
        if isinstance(raw, property):
            ret = _annotation(inspect.signature(func).return_annotation)
            shown = f"property {member}" + ("" if ret is inspect.Signature.empty else f": {ret}")
        else:
            kind = "async def" if inspect.iscoroutinefunction(func) else "def"
            prefix = {classmethod: "@classmethod\n", staticmethod: "@staticmethod\n"}.get(type(raw), "")
            shown = prefix + _signature(
                f"{kind} {member}", func, drop_first=not isinstance(raw, staticmethod)
            )
        out += [f"##### `{name}.{member}`", "", "```python", shown, "```", ""]
        doc = inspect.getdoc(getattr(obj, member))
        out += [_docstring_markdown(doc), ""] if doc else []
    return out


def client_reference() -> str:
    """Each name of ``CLIENT_REFERENCE``: its signature and docstring, and a class's methods."""
    out = ["Generated from the code by `python docs/hooks.py`.", ""]
    for heading, paths in CLIENT_REFERENCE:
        out += [f"### {heading}", ""]
        for path in paths:
            out += _reference_entry(path, path not in CLIENT_WITHOUT_MEMBERS)
    return "\n".join(out)


# ------------------------------------------------------------------------- the generated sections
# name -> (page under docs/, what fills it)
GENERATED = {
    "openapi": ("api.md", openapi_reference),
    "serve-options": ("serving.md", serve_options_reference),
    "client-reference": ("client.md", client_reference),
}
REGENERATE = "python docs/hooks.py"


# What shapes the generated text besides the code: the schema and signatures come out a little
# differently from other versions of these. The versions are recorded in each section, and the text
# is compared exactly only under the same ones (tests/docs/test_docs_generated.py).
VERSIONED = ("fastapi", "pydantic", "starlette", "httpx")
_VERSIONS = re.compile(r"<!-- generated with (.*?) -->")


def generator_versions() -> str:
    from importlib.metadata import version

    libs = ", ".join(f"{name} {version(name)}" for name in VERSIONED)
    return f"{libs}, python {sys.version_info.major}.{sys.version_info.minor}"


def recorded_versions(text: str) -> set[str]:
    """The versions recorded in ``text``'s generated sections."""
    return set(_VERSIONS.findall(text))


def skeleton(text: str) -> list[str]:
    """What a generated page documents, without how it reads: its headings, anchors and the first
    cell of each table row (an option, a field)."""
    keep = []
    for line in text.splitlines():
        if line.startswith(("#", "<a id=")):
            keep.append(line)
        elif line.startswith("| ") and not line.startswith("| ---"):
            keep.append(line.split(" | ")[0])
    return keep


def fill(text: str, name: str, content: str) -> str:
    """``text`` with the section ``name`` (between its two markers) holding ``content``."""
    start, end = f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"expected one {start!r} and, after it, one {end!r}")
    before, rest = text.split(start)
    # Blank lines around the content, so that no renderer reads its first or last line as part of
    # the markers' HTML.
    stamp = f"<!-- generated with {generator_versions()} -->"
    return f"{before}{start}\n{stamp}\n\n{content.strip()}\n\n{end}{rest.split(end)[1]}"


def regenerated() -> dict[str, tuple[str, str]]:
    """``{page: (committed text, text with every section regenerated)}`` for the pages that have
    generated sections."""
    pages: dict[str, tuple[str, str]] = {}
    for name, (page, render) in GENERATED.items():
        old, new = pages.get(page) or ((DOCS / page).read_text(),) * 2
        pages[page] = (old, fill(new, name, render()))
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rewrite the generated sections of docs/*.md from the code.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a section is stale")
    args = parser.parse_args(argv)
    stale = {page: new for page, (old, new) in regenerated().items() if old != new}
    for page, new in stale.items():
        if args.check:
            print(f"docs/{page}: a generated section is stale; run `{REGENERATE}`")
        else:
            (DOCS / page).write_text(new)
            print(f"rewrote docs/{page}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())

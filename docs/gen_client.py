"""The serve options table (serving.md's ``serve-options``: every option, from ``ServerConfig``, grouped
as ``serve --help`` groups them) and the trainer client's reference (client.md's
``client-reference``: the signature and docstring of each public name).
"""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any

from gen_markdown import cell, docstring_markdown


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
            out.append(f"| `{flag}` (`{env}`) | {default} | {cell(field.description or '')} |")
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
        return [*out, docstring_markdown(inspect.getdoc(obj)), ""]
    # The class's own docstring: inspect.getdoc would give an undocumented one its base's.
    out = [f"#### `{title}`", "", "```python", _signature(f"class {name}", obj), "```", ""]
    out += [docstring_markdown(obj.__doc__), ""]
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
        out += [docstring_markdown(doc), ""] if doc else []
    return out


def client_reference() -> str:
    """Each name of ``CLIENT_REFERENCE``: its signature and docstring, and a class's methods."""
    out = ["Generated from the code by `python docs/generate.py`.", ""]
    for heading, paths in CLIENT_REFERENCE:
        out += [f"### {heading}", ""]
        for path in paths:
            out += _reference_entry(path, path not in CLIENT_WITHOUT_MEMBERS)
    return "\n".join(out)

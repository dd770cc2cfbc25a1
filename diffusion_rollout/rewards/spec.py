"""``--reward SPEC``: a built-in name or ``module:callable`` / ``file.py:callable``, with ``?key=value`` options.

A spec is code. Anything but a built-in name imports a module and calls what it names, in this
process and as its user, so only ``module:callable`` or ``file.py:callable`` spelled out is taken (a
bare unknown name is an error, never a guess), and :func:`load_reward` logs once what it imported,
from where, with which arguments."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qsl, urldefrag

from diffusion_rollout.rewards.clip_score import clip_score
from diffusion_rollout.rewards.http_reward import HttpReward
from diffusion_rollout.rewards.simple import Reward, brightness, jpeg_compressibility, jpeg_incompressibility
from diffusion_rollout.rewards.vlm_judge import vlm_judge, vlm_ocr_judge

logger = logging.getLogger("diffusion_rollout.rewards")

BUILTIN_REWARDS: dict[str, Callable[..., Reward]] = {
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "brightness": brightness,
    "vlm_ocr_judge": vlm_ocr_judge,
    "vlm_judge": vlm_judge,
    "clip_score": clip_score,
}


def _coerce(value: str) -> object:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _import_object(target: str) -> tuple[object, str]:
    """The object ``module:attr`` or ``file.py:attr`` names, and the file it came from."""
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise ValueError(
            f"reward {target!r}: expected a built-in name {sorted(BUILTIN_REWARDS)} or 'module:callable'"
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"reward {target!r}: no file {path}")
        spec = importlib.util.spec_from_file_location(f"user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, attr), str(getattr(module, "__file__", None) or module.__name__)
    except AttributeError:
        raise ValueError(f"reward {target!r}: {where} has no attribute {attr!r}") from None


def load_reward(spec: str, *, device: str | None = None) -> Reward:
    """The reward a ``--reward`` spec names (see the module docstring). ``device`` (the server's
    placement) is passed to a factory that takes one, unless the spec sets ``device`` itself."""
    if spec.startswith(("http://", "https://")):
        # The whole spec is the service's URL; the reward's options ride in its fragment.
        url, fragment = urldefrag(spec)
        options = {k: _coerce(v) for k, v in parse_qsl(fragment, strict_parsing=bool(fragment))}
        logger.info("reward %r: scored by the service at %s with %s", spec, url, options or "the defaults")
        return HttpReward(url, **options)
    name, _, query = spec.partition("?")
    kwargs = {k: _coerce(v) for k, v in parse_qsl(query, strict_parsing=bool(query))}
    if name.startswith("clip:"):  # clip:FOLDER[?options]
        name, kwargs = "clip_score", {"model": name[len("clip:") :], **kwargs}
    if name in BUILTIN_REWARDS:
        factory = BUILTIN_REWARDS[name]
        if device is not None and "device" not in kwargs and _accepts(factory, "device"):
            kwargs["device"] = device
        return factory(**kwargs)
    obj, origin = _import_object(name)
    logger.info(
        "reward %r: imported %s from %s%s; it runs in this process as this user (a reward spec is code)",
        spec, name, origin,
        f" and called with {kwargs}" if kwargs else "",
    )  # fmt: skip
    # A class or a factory (no positional parameters) is instantiated; a reward function is used as is.
    if inspect.isclass(obj) or kwargs or _takes_no_arguments(obj):
        obj = obj(**kwargs)
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is not callable")
    return obj


def _accepts(obj: object, name: str) -> bool:
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _takes_no_arguments(obj: object) -> bool:
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD,) for p in params)


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def parse_named_reward(arg: str) -> tuple[str, str]:
    """``NAME=SPEC`` as ``(NAME, SPEC)``; a bare built-in (``jpeg_compressibility?quality=80``) is
    named after itself. The ``=`` that names must come before any ``:``, ``?`` or ``/`` of the spec,
    whose own query may hold ``=`` too."""
    arg = arg.strip()
    cut = min((i for i in (arg.find(c) for c in ":?/") if i >= 0), default=len(arg))
    eq = arg.find("=")
    if 0 <= eq < cut:
        name, spec = arg[:eq], arg[eq + 1 :]
    else:
        name, spec = arg.partition("?")[0], arg
        if name not in BUILTIN_REWARDS:
            raise ValueError(f"reward {arg!r}: name it, NAME=SPEC (only a built-in name stands alone)")
    if not _NAME.fullmatch(name):
        raise ValueError(f"reward {arg!r}: the name {name!r} must be 1-64 of letters, digits, '_', '.', '-'")
    if not spec:
        raise ValueError(f"reward {arg!r}: no spec after '{name}='")
    return name, spec

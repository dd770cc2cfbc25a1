"""The ``diffusion-rollout`` command line.

``serve`` options are generated from the fields of ``ServerConfig`` (one source of truth for names,
defaults, help texts, groups and environment variables); ``make-tiny-model`` writes a tiny random
pipeline folder of a family. Help texts are plain text: no reST markup reaches ``--help``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence

from pydantic import ValidationError

from diffusion_rollout.config import ENV_PREFIX, ServerConfig
from diffusion_rollout.config_options import OPTION_GROUPS, option_default_text, option_env_names
from diffusion_rollout.logging_utils import configure_logging
from diffusion_rollout.models.family_names import FAMILIES, IMAGE_FAMILIES

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

DESCRIPTION = "A GPU rollout server for RL training of flow-matching diffusion models."
SERVE_DESCRIPTION = (
    "Start the rollout server. Every option can also be set by an environment variable, "
    f"{ENV_PREFIX}<OPTION> (--max-batch-size 8 is {ENV_PREFIX}MAX_BATCH_SIZE=8); a flag wins over "
    "the environment. A boolean option has a negative form too (--no-compile). docs/serving.md describes each option in full."
)
TINY_FAMILIES_HELP = (
    f"text-to-image/video: {', '.join(FAMILIES)}; image-conditioned: {', '.join(IMAGE_FAMILIES)}"
)


def plain(text: str | None) -> str:
    """Help text without reST inline markup (double backticks) and with argparse's % escaped."""
    return (text or "").replace("``", "").replace("%", "%%")


def _arg_type(annotation: object):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(typing.get_args(annotation))
    if annotation in (int, float, str):
        return annotation, None
    return str, None


_FOLDERS = ("model", "cache_dir", "compile_cache", "warmup_profile", "image_path_root")


def _metavar(name: str, typ: type) -> str:
    if name in _FOLDERS:
        return "FOLDER"
    if name.endswith("_s"):
        return "SECONDS"
    if name.endswith("_ms"):
        return "MS"
    if name.endswith("_bytes"):
        return "BYTES"
    return {int: "N", float: "X"}.get(typ, name.rsplit("_", 1)[-1].upper())


def option_summary(name: str) -> str:
    """The option's one-line help: the field's ``title`` where its description is long, else the
    description (docs/serving.md's table shows the full description)."""
    field = ServerConfig.model_fields[name]
    return field.title or field.description or ""


def _option_help(name: str) -> str:
    """One option's help: its summary, its default, and any environment variable beyond the
    DIFFUSION_ROLLOUT_<OPTION> one the parser's description names."""
    summary, default = option_summary(name), option_default_text(name)
    notes = [] if default == "unset" and "unset" in summary else [f"default: {default}"]
    notes += [f"env {e}" for e in option_env_names(name)[1:]]
    return plain(f"{summary} [{'; '.join(notes)}]" if notes else summary)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ServerConfig`` field, in argument groups by concern (``OPTION_GROUPS``). The
    parser's defaults are None: an option not given is left to the environment and the field."""
    fields = ServerConfig.model_fields
    grouped = [n for _, names in OPTION_GROUPS for n in names]
    groups = [*OPTION_GROUPS, ("Other", tuple(n for n in fields if n not in grouped))]
    for title, names in groups:
        if not names:
            continue
        group = parser.add_argument_group(title)
        for name in names:
            field = fields[name]
            flag = "--" + name.replace("_", "-")
            help_text = _option_help(name)
            if field.annotation is bool:
                group.add_argument(
                    flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
                )
                continue
            if typing.get_origin(field.annotation) is list:  # repeatable (--reward A=... --reward B=...)
                group.add_argument(
                    flag, dest=name, action="append", default=None, metavar="NAME=SPEC", help=help_text
                )
                continue
            typ, choices = _arg_type(field.annotation)
            group.add_argument(
                flag,
                dest=name,
                type=typ,
                choices=choices,
                default=None,
                metavar=None if choices else _metavar(name, typ),
                help=help_text,
            )


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=_help_width())


def _help_width() -> int:
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    return max(columns, 120) if columns else 120


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffusion-rollout", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="start the rollout server",
        description=SERVE_DESCRIPTION,
        usage="%(prog)s [--model FOLDER] [options]",
        formatter_class=_HelpFormatter,
    )
    add_config_arguments(serve)
    tiny = sub.add_parser(
        "make-tiny-model",
        help="write a tiny random pipeline folder of a family (tests, demos)",
        description=(
            "Write a tiny, randomly initialised diffusers pipeline folder of one family. Served "
            "without sizes, a request gets the tiny model's own small sizes (32x32, 5 video frames)."
        ),
        formatter_class=_HelpFormatter,
    )
    tiny.add_argument(
        "--family", required=True, choices=(*FAMILIES, *IMAGE_FAMILIES), metavar="FAMILY",
        help=f"the family to build: {TINY_FAMILIES_HELP}",
    )  # fmt: skip
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (same family and seed, same files) [default: 0]")
    tiny.add_argument("out_dir", help="folder to write (created)")
    return parser


def missing_bytecode(package: str = "torch") -> str | None:
    """Why every start compiles ``package``'s Python sources again, or None. Where byte code is not
    written (``PYTHONDONTWRITEBYTECODE``) and the install shipped none, each process recompiles what
    it imports: on the GPU machine's image (an H100 host) the server's imports took 12.4 + 8.6 s
    without byte code and 6.3 + 4.5 s with it (benchmarks/RESULTS.md#fast-start-bytecode). Checked
    before anything heavy is imported (``find_spec`` of a top-level package imports nothing)."""
    if not sys.dont_write_bytecode:
        return None
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    return (
        f"Python byte code is neither installed nor written for {package} (PYTHONDONTWRITEBYTECODE is "
        "set): every start compiles its sources again, about 10 s on an H100 host. Set "
        "PYTHONPYCACHEPREFIX to a folder of this user's own that no one else can write (Python imports "
        "the byte code it finds there) and unset PYTHONDONTWRITEBYTECODE, or byte-compile the environment "
        "once (python -m compileall)"
    )


def untrusted_pycache_prefix() -> str | None:
    """Why ``PYTHONPYCACHEPREFIX`` is not this user's own folder, or None. Python imports the byte code
    it finds there without checking its owner: a ``.pyc`` another user planted runs as the server."""
    prefix = sys.pycache_prefix
    if not prefix or not os.path.isdir(prefix):
        return None  # unset, or the first import makes it (with the umask's mode)
    from diffusion_rollout.own_files import why_not_own_folder

    why = why_not_own_folder(prefix)
    return (
        None
        if why is None
        else f"PYTHONPYCACHEPREFIX={prefix}: {why}; another user could plant byte code there"
    )


def serve(config: ServerConfig) -> None:
    configure_logging(config.log_level)
    if (why := missing_bytecode()) is not None:
        logger.warning("slow start-up: %s", why)
    if (why := untrusted_pycache_prefix()) is not None:
        logger.warning(
            "unsafe byte-code folder: %s (docs/operations.md#security-what-the-server-trusts-on-disk)", why
        )
    from diffusion_rollout.entrypoints.app import create_app
    from diffusion_rollout.entrypoints.http_server import make_server

    if config.admin_key is None and config.host not in LOOPBACK_HOSTS:
        if not config.allow_insecure_admin:
            logger.error(
                "refusing to bind to %s WITHOUT an admin key: anyone who can reach this port could replace "
                "the weights. Set --admin-key, bind to 127.0.0.1, or pass --allow-insecure-admin",
                config.host,
            )
            sys.exit(2)
        logger.warning(
            "binding to %s WITHOUT an admin key (--allow-insecure-admin): anyone who can reach this port "
            "can replace the weights",
            config.host,
        )
    if config.model is None:
        from diffusion_rollout.models import ensure_demo_model

        path = ensure_demo_model(config.cache_dir)
        logger.warning("no --model given: serving the built-in RANDOM demo model (tiny SD3) from %s", path)
        config = config.model_copy(update={"model": str(path)})
    with contextlib.ExitStack() as stack:
        if config.replicas is not None:
            # Replicas: Ray starts (or is joined) here, in the main thread, and stops after the server.
            from diffusion_rollout.cluster import ray_session

            stack.enter_context(ray_session(config))
        app = create_app(config)
        # Drains on SIGINT/SIGTERM: new rollouts get 503, in-flight ones finish within shutdown_grace_s.
        server = make_server(app, config)

        def stop_on_load_failure() -> None:
            # A model that cannot load never will: end the process rather than serve 503 forever.
            server.should_exit = True

        app.state.on_load_failure = stop_on_load_failure
        # uvicorn re-raises a captured SIGINT once it has shut down; uvicorn.run swallows it too.
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
    if app.state.load_error is not None:
        sys.exit(f"diffusion-rollout serve: the model failed to load: {app.state.load_error}")
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE: the port was taken, or the app failed to start


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        values = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
        try:
            config = ServerConfig.from_env(**values)
        except ValidationError as exc:  # a start-up error in one line per problem, not a traceback
            problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            sys.exit(f"diffusion-rollout serve: {problems}")
        serve(config)
        return 0
    if args.command == "make-tiny-model":
        from diffusion_rollout.models import save_tiny_model

        configure_logging("info")
        path = save_tiny_model(args.family, args.out_dir, seed=args.seed)
        print(path)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``diffusion-rollout`` command line.

``serve`` options are generated from the fields of ``ServerConfig`` (one source of truth for names,
defaults and help texts); ``make-tiny-model`` writes a tiny random pipeline folder of a family.
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

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.logging_utils import configure_logging

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _arg_type(annotation: object):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(typing.get_args(annotation))
    if annotation in (int, float, str):
        return annotation, None
    return str, None


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    for name, field in ServerConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=field.description
            )
            continue
        if typing.get_origin(field.annotation) is list:  # repeatable (serve --reward A=... --reward B=...)
            parser.add_argument(flag, dest=name, action="append", default=None, help=field.description)
            continue
        typ, choices = _arg_type(field.annotation)
        parser.add_argument(flag, dest=name, type=typ, choices=choices, default=None, help=field.description)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusion-rollout", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the rollout server")
    add_config_arguments(serve)
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random pipeline folder (tests, demos)")
    tiny.add_argument(
        "--family", required=True, type=_tiny_family, help="a tiny family (a wrong one lists them)"
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("out_dir")
    return parser


def _tiny_family(name: str) -> str:
    # Imported only when make-tiny-model runs: the tiny builders import every family's diffusers
    # classes, seconds that `serve` would otherwise pay before it starts (issue #43).
    from diffusion_rollout.models.tiny import FAMILIES, IMAGE_FAMILIES

    known = (*FAMILIES, *IMAGE_FAMILIES)
    if name not in known:
        raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(known)}")
    return name


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

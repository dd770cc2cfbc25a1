"""``--config run.yaml`` for the recipes: every option from a file, the command line winning."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def parse_with_config(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``--config FILE``'s options underneath the command line's.

    The file is a YAML mapping whose keys are the parser's option names (the ``dest``, ``group_size``,
    or a long option without its dashes, ``group-size``) and whose values go through the option's
    own conversion and checks (``lr: 1e-2``, ``server_gpus: [0, 1]``, ``cpu: true``,
    ``log_to: [tensorboard]``); ``null`` leaves the default. An option given on the command line
    wins over the file (a list option is replaced, not extended); an unknown key is an error that
    names it.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not getattr(args, "config", None):
        return args
    from_file = _config_values(parser, args.config)
    given = _given_on_command_line(parser, argv)
    for dest, value in from_file.items():
        if dest not in given:
            setattr(args, dest, value)
    return args


def _config_values(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """``path``'s options as the parser's ``dest -> value`` (converted and checked by the parser)."""
    import yaml

    where = f"--config {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        parser.error(f"{where}: {e.strerror or e}")
    except yaml.YAMLError as e:
        parser.error(f"{where}: not valid YAML: {e}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        parser.error(f"{where}: expected a mapping of option names to values, not a {type(data).__name__}")
    by_name: dict[str, argparse.Action] = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest in ("help", "config", argparse.SUPPRESS):
            continue
        by_name[action.dest] = action
        for s in longs:
            by_name[s[2:]] = by_name[s[2:].replace("-", "_")] = action
    values: dict[str, Any] = {}
    for key, value in data.items():
        action = by_name.get(str(key))
        if action is None:
            near = difflib.get_close_matches(str(key), list(by_name), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            parser.error(f"{where}: unknown option {key!r}{hint}")
        if value is None:
            continue
        if action.nargs == 0:  # a flag: true or false
            if not isinstance(value, bool):
                parser.error(f"{where}: {key!r} is a flag: true or false, not {value!r}")
            values[action.dest] = value
            continue
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, (dict, list)) for v in items):
            parser.error(f"{where}: {key!r} takes a value or a list of values, not {value!r}")
        option = next(s for s in action.option_strings if s.startswith("--"))
        texts = [str(v).lower() if isinstance(v, bool) else str(v) for v in items]
        if isinstance(action, argparse._AppendAction):  # append, extend: the option once per item
            tokens = [t for text in texts for t in (option, text)]
        elif action.nargs in ("*", "+") or isinstance(action.nargs, int):
            tokens = [option, *texts]
        else:  # one value; a list is comma-joined (--server-gpus 0,1)
            tokens = [option, ",".join(texts)]
        exit_on_error, parser.exit_on_error = parser.exit_on_error, False
        try:
            parsed = parser.parse_args(tokens)
        except argparse.ArgumentError as e:
            parser.error(f"{where}: {key!r}: {e}")
        finally:
            parser.exit_on_error = exit_on_error
        values[action.dest] = getattr(parsed, action.dest)
    return values


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests that ``argv`` sets: parsed into a namespace pre-filled with markers, which argparse
    leaves alone (it writes defaults only where an attribute is missing)."""
    unset = object()
    ns = argparse.Namespace()
    for action in parser._actions:
        if action.dest != argparse.SUPPRESS:
            # append/extend copy and grow the present value: start them from None.
            setattr(ns, action.dest, None if isinstance(action, argparse._AppendAction) else unset)
    parser.parse_args(argv, namespace=ns)
    return {dest for dest, v in vars(ns).items() if v is not unset and v is not None}

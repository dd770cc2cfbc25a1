"""Docs that cannot lie about the command line: every command shown in the README and the docs names
only flags its program has, and the serve options the docs list are the ones `serve --help` has.

Commands are read from fenced code blocks (continuation lines joined): `diffusion-rollout serve` /
`make-tiny-model`, `python examples/NAME.py`, `torchrun ... examples/NAME.py`, `python -m
benchmarks.NAME`. Each program's own ``--help`` text (argparse, in this process; nothing runs a model)
is the truth its flags are checked against.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
_FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def _commands(text: str) -> list[str]:
    out = []
    for block in _FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()  # a trailing comment is prose
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _program(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(program key, its arguments) of a command line, or None for lines that are not ours."""
    for i, tok in enumerate(tokens):
        if tok == "diffusion-rollout" and i + 1 < len(tokens):
            return f"cli:{tokens[i + 1]}", tokens[i + 2 :]
        if tok.startswith("examples/") and tok.endswith(".py"):
            return f"example:{Path(tok).stem}", tokens[i + 1 :]
        if tok == "-m" and i + 1 < len(tokens):
            module = tokens[i + 1]
            if module.startswith("benchmarks."):
                return f"bench:{module}", tokens[i + 2 :]
            if module == "diffusion_rollout.entrypoints.cli" and i + 2 < len(tokens):
                return f"cli:{tokens[i + 2]}", tokens[i + 3 :]
    return None


def _help_of_parse(call) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        call(["--help"])
    return out.getvalue()


@cache
def _help(program: str) -> str:
    kind, _, name = program.partition(":")
    if kind == "cli":
        from diffusion_rollout.entrypoints.cli import build_parser

        parser = build_parser()
        sub = next(a for a in parser._actions if a.dest == "command").choices
        return sub[name].format_help() if name in sub else ""
    if kind == "example":
        # A script, loaded from its file: examples import only the package, never each other.
        spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return (
            _help_of_parse(module.parse_args)
            if hasattr(module, "parse_args")
            else _help_of_parse(module.main)
        )
    module = importlib.import_module(name)
    return _help_of_parse(module.main)


def _shown_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for doc in DOCS:
        if not doc.exists():
            continue
        for line in _commands(doc.read_text()):
            try:
                tokens = shlex.split(line)
            except ValueError:
                continue
            prog = _program(tokens)
            if prog is not None:
                found.append((f"{doc.relative_to(ROOT)}: {line}", prog[0], prog[1]))
    return found


COMMANDS = _shown_commands()


def test_the_docs_show_commands_of_every_kind():
    kinds = {prog.partition(":")[0] for _, prog, _ in COMMANDS}
    assert {"cli", "example"} <= kinds, kinds  # so the check below checks something


@pytest.mark.parametrize(("where", "program", "args"), COMMANDS, ids=[c[0][:90] for c in COMMANDS])
def test_every_flag_shown_exists(where, program, args):
    known = set(_FLAG.findall(_help(program)))
    assert known, f"{program} has no --help text"
    shown = {a.split("=", 1)[0] for a in args if _FLAG.fullmatch(a.split("=", 1)[0])}
    assert shown <= known, f"{where}: {sorted(shown - known)} not in {program} --help"


def test_a_made_up_flag_is_caught():
    known = set(_FLAG.findall(_help("example:flow_grpo")))
    assert "--server-gpus" in known and "--full-finetune" in known
    assert "--no-such-flag" not in known


def test_the_docs_list_exactly_the_serve_options():
    """The serving page names every `serve` option, and no option serve does not have."""
    page = ROOT / "docs" / "serving.md"
    if not page.exists():
        pytest.skip("no docs/serving.md in this tree")
    serve = set(_FLAG.findall(_help("cli:serve"))) - {"--help"}
    documented = set(_FLAG.findall(page.read_text()))
    assert serve - documented == set(), (
        f"serve options the serving page does not list: {sorted(serve - documented)}"
    )
    assert documented - serve == set(), (
        f"options on the serving page that serve lacks: {sorted(documented - serve)}"
    )

"""The command line's help: plain text (no reST markup), make-tiny-model naming its families without
importing the builders, and serve's options grouped by concern with their defaults and environment
variables, in summaries that speak of options rather than source files."""

from __future__ import annotations

import re
import subprocess
import sys

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.config_options import OPTION_GROUPS, option_default_text, option_env_names
from diffusion_rollout.entrypoints.cli import build_parser
from diffusion_rollout.models.family_names import FAMILIES, IMAGE_FAMILIES


def _sub(name: str):
    return next(a for a in build_parser()._actions if a.dest == "command").choices[name]


def test_top_level_help_is_plain_text():
    text = build_parser().format_help()
    assert "``" not in text and "serve" in text and "make-tiny-model" in text
    for name in ("serve", "make-tiny-model"):
        assert "``" not in _sub(name).format_help(), name


def test_make_tiny_model_help_lists_every_family_without_importing_the_builders():
    code = (
        "import sys\n"
        "from diffusion_rollout.entrypoints.cli import main\n"
        "try:\n"
        "    main(['make-tiny-model', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('IMPORTED', 'diffusion_rollout.models.tiny' in sys.modules, 'diffusers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert out.stdout.strip().endswith("IMPORTED False False"), out.stdout + out.stderr
    listed = out.stdout.replace("\n", " ")
    for family in (*FAMILIES, *IMAGE_FAMILIES):
        assert re.search(rf"(?<![\w.-]){re.escape(family)}(?![\w.-])", listed), family


def test_option_groups_hold_every_field_once():
    names = [n for _, group in OPTION_GROUPS for n in group]
    assert len(names) == len(set(names)), "a field in two groups"
    assert set(names) == set(ServerConfig.model_fields)


def test_serve_help_groups_options_with_defaults_and_environment():
    text = _sub("serve").format_help()
    positions = [text.index(f"\n{title}:\n") for title, _ in OPTION_GROUPS]
    assert positions == sorted(positions)
    assert "DIFFUSION_ROLLOUT_<OPTION>" in text and "DIFFUSION_ROLLOUT_CACHE" in text
    assert "[default: 30000]" in text and "[default: 16]" in text and "[default: off]" in text
    assert "8388608 = 8 Mi" in text
    assert option_env_names("cache_dir") == ("DIFFUSION_ROLLOUT_CACHE_DIR", "DIFFUSION_ROLLOUT_CACHE")
    assert option_default_text("model") == "unset"
    # Options, not source files; and no reST markup.
    assert not re.search(r"\b[\w/]+\.py\b", text.replace("docs/serving.md", "")), text
    assert "``" not in text


def test_serve_help_is_short_per_option():
    """A summary, not the full description (docs/serving.md has that): at most two lines of help text
    per option at 120 columns, most of them one."""
    entries: dict[str, int] = {}
    for line in _sub("serve").format_help().splitlines():
        if line.startswith("  --"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = int(len(line) > 40 and "  " in line.strip())
        elif line.startswith(" " * 20) and entries:
            entries[flag] += 1
    assert len(entries) == len(ServerConfig.model_fields)
    assert max(entries.values()) <= 2, {f: n for f, n in entries.items() if n > 2}
    assert sum(n == 1 for n in entries.values()) > len(entries) / 2, entries


def test_an_option_set_by_its_environment_variable_is_left_to_it(monkeypatch):
    monkeypatch.setenv("DIFFUSION_ROLLOUT_MAX_BATCH_SIZE", "5")
    args = build_parser().parse_args(["serve"])
    values = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    assert ServerConfig.from_env(**values).max_batch_size == 5
    args = build_parser().parse_args(["serve", "--max-batch-size", "7"])
    values = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    assert ServerConfig.from_env(**values).max_batch_size == 7

"""The docs' generated sections: written from the code into the committed pages.

Generated sections sit between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->`` in
a page and are committed, so the repository shows them as the site does. ``python docs/generate.py``
rewrites them; ``--check`` (and ``tests/docs/test_docs_generated.py``) fails when one is stale.

- ``openapi`` in api.md: every route of the app, from its OpenAPI schema (the app is constructed,
  never started: no model is loaded).
- ``serve-options`` in serving.md: every ``diffusion-rollout serve`` option, from ``ServerConfig``,
  grouped as ``serve --help`` groups them (``config_options.OPTION_GROUPS``).
- ``client-reference`` in client.md: the signature and docstring of each public name of the trainer
  client.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# The package (a checkout that is not pip-installed still generates) and this folder's gen_* modules.
for _path in (ROOT, DOCS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gen_api import openapi_reference  # noqa: E402
from gen_client import client_reference, serve_options_reference  # noqa: E402

# ------------------------------------------------------------------------- the generated sections
# name -> (page under docs/, what fills it)
GENERATED = {
    "openapi": ("api.md", openapi_reference),
    "serve-options": ("serving.md", serve_options_reference),
    "client-reference": ("client.md", client_reference),
}
REGENERATE = "python docs/generate.py"


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

"""Docstring text as markdown, for the generated docs sections (docs/generate.py)."""

from __future__ import annotations

import inspect
import re


# ----------------------------------------------------------------------------------- shared bits
def md(text: str) -> str:
    """Docstring text (reST literals, free line breaks) as one markdown paragraph."""
    return " ".join(re.sub(r"``([^`]+)``", r"`\1`", text).split())


def cell(text: str) -> str:
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


def docstring_markdown(doc: str | None) -> str:
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

"""Every relative link and image of the README and `docs/*.md` resolves in the repository itself, as
GitHub shows the files (the site's side is `mkdocs build --strict`, in test_docs_site.py).

A target is a file or folder relative to the page, inside the repository. Its `#fragment`, when the
target is a markdown file (or the page itself), must be an anchor of that file: an `<a id="...">`
(RESULTS.md's rows, the anchors written before headings) or a heading's GitHub slug. Text in code
(fenced blocks, inline code) holds no links. A heading with an attribute list (`{#id}`) is refused
too: GitHub shows it as text.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    ROOT / "examples" / "README.md",
    ROOT / "benchmarks" / "RESULTS.md",
    ROOT / "benchmarks" / "results" / "HISTORY.md",
    *sorted((ROOT / "docs").glob("*.md")),
]

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.S | re.M)
_CODE = re.compile(r"`+[^`\n]*`+")
_TARGETS = (
    re.compile(r"!?\[[^\]]*\]\(<?([^)\s>]+)>?[^)]*\)"),  # [text](target "title"), ![alt](target)
    re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)", re.M),  # [label]: target
    re.compile(r"<(?:a|img)\b[^>]*\b(?:href|src)=\"([^\"]+)\""),
)
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)
_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """``text`` without its code: a fenced block or an inline span shows brackets, not links."""
    return _CODE.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The id GitHub gives a heading: its text as shown (markup dropped), lower case, punctuation
    dropped, spaces as hyphens."""
    shown = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    shown = re.sub(r"<[^>]+>|[`*]", "", shown)
    return re.sub(r"[^\w\- ]", "", shown.strip().lower()).replace(" ", "-")


def anchors_of(text: str) -> frozenset[str]:
    found = set(_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = github_slug(heading)
        # A repeated heading gets -1, -2, ... as GitHub numbers them.
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(found)


@cache
def anchors(path: Path) -> frozenset[str]:
    return anchors_of(path.read_text())


def link_targets(text: str) -> list[str]:
    """The relative targets of ``text``'s links and images (``https:``, ``mailto:`` left out)."""
    prose = _prose(text)
    found = [target for pattern in _TARGETS for target in pattern.findall(prose)]
    return [t for t in found if not re.match(r"[a-zA-Z][\w+.-]*:", t)]


def broken_links(name: str, text: str, folder: Path, root: Path = ROOT) -> list[str]:
    """Each target of ``text`` (the page ``name`` in ``folder``) that the repository lacks, and each
    heading GitHub would show with its attribute list."""
    problems: list[str] = []
    for target in link_targets(text):
        path, _, fragment = target.partition("#")
        file = (folder / path).resolve() if path else None
        if file is not None and (not file.is_relative_to(root) or not file.exists()):
            problems.append(f"{name}: {target}: no such file in the repository")
            continue
        if not fragment or (file is not None and file.suffix != ".md"):  # a .py#L10 fragment is GitHub's
            continue
        if fragment not in (anchors(file) if file else anchors_of(text)):
            problems.append(f"{name}: {target}: no such anchor")
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        if re.search(r"\{[#.:][^}]*\}$", heading):
            problems.append(f"{name}: heading {heading!r}: GitHub shows the attribute list as text")
    return problems


def test_every_link_and_image_resolves_in_the_repository():
    targets = [t for page in PAGES for t in link_targets(page.read_text())]
    assert len(targets) > 500 and sum("RESULTS.md#" in t for t in targets) > 400  # it checks something
    problems = [
        p
        for page in PAGES
        for p in broken_links(page.relative_to(ROOT).as_posix(), page.read_text(), page.parent)
    ]
    assert problems == []


def test_the_docs_link_results_rows_and_plots_where_the_repository_has_them():
    training = (ROOT / "docs" / "training.md").read_text()
    assert "](../benchmarks/RESULTS.md#train-colocated)" in training
    assert "](../benchmarks/results/plots/reward_sd35.png)" in training


def test_planted_broken_links_are_reported():
    page = """# A page

## Local part

[fine](speed.md) [row](../benchmarks/RESULTS.md#grpo-lanes2) [here](#local-part)
![plot](../benchmarks/results/plots/reward_sd35.png) [site](https://example.com/x.md)
[gone](nope.md) [no row](../benchmarks/RESULTS.md#no-such-row) [site only](results.md#grpo-lanes2)
![no plot](results/plots/reward_sd35.png) [nowhere](#nowhere) [heading](speed.md#no-such-heading)
[outside](../../elsewhere.md) <img src="missing.png">

`[in code](gone.md)`

```python
x = d["k"](gone.md)
```

### `--speed exact|fast` {#speed-presets}
"""
    assert broken_links("docs/x.md", page, ROOT / "docs") == [
        "docs/x.md: nope.md: no such file in the repository",
        "docs/x.md: ../benchmarks/RESULTS.md#no-such-row: no such anchor",
        "docs/x.md: results.md#grpo-lanes2: no such file in the repository",
        "docs/x.md: results/plots/reward_sd35.png: no such file in the repository",
        "docs/x.md: #nowhere: no such anchor",
        "docs/x.md: speed.md#no-such-heading: no such anchor",
        "docs/x.md: ../../elsewhere.md: no such file in the repository",
        "docs/x.md: missing.png: no such file in the repository",
        "docs/x.md: heading '`--speed exact|fast` {#speed-presets}': GitHub shows the attribute list as text",
    ]


def test_anchors_are_ids_and_github_heading_slugs():
    speed = anchors(ROOT / "docs" / "speed.md")
    assert {"speed-presets", "--speed-exactfast", "where-the-cold-start-went"} <= speed
    assert "grpo-lanes2" in anchors(ROOT / "benchmarks" / "RESULTS.md")
    assert github_slug("`RolloutClient.generate`") == "rolloutclientgenerate"
    assert github_slug("[Results](results.md) and *more*") == "results-and-more"

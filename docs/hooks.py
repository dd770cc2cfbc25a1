"""MkDocs hooks (``hooks:`` in mkdocs.yml): what the site adds to the pages of ``docs/``.

The pages are written to read the same in the repository (as GitHub renders them) and on the site:
links go to the real files, and generated text is committed, not filled in at build time.

- ``on_files``: ``benchmarks/RESULTS.md`` becomes the page ``results.md``, and every file under
  ``benchmarks/results/`` is added under ``results/`` (the plots, the JSON and logs the rows link,
  ``HISTORY.md`` as a page), so RESULTS.md's relative links (``results/h200/x.json``,
  ``results/plots/drift.png``) resolve as they are. ``results/plots/index.md`` is generated: every
  plot on one page. Nothing is copied into ``docs/``; the files are read at build time.
- ``on_page_markdown``: a page's links to those files as the repository has them
  (``../benchmarks/RESULTS.md#row``, ``../benchmarks/results/plots/x.png``) become the site's paths
  (``results.md#row``, ``results/plots/x.png``).
- ``on_page_content``: every page's ``<a id="...">`` anchors (the results rows, the anchors written
  before headings; raw HTML that MkDocs does not see) count as anchors, so ``validation.anchors``
  checks links to them.
- ``on_serve``: ``mkdocs serve`` also watches the benchmark results.

The generated sections of api.md, serving.md and client.md are committed text; ``docs/generate.py``
writes them (``python docs/generate.py``). Nothing here fills them at build time.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mkdocs.structure.files import Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
RESULTS_DIR = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"

if str(ROOT) not in sys.path:  # a checkout that is not pip-installed still builds
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------- results
def results_markdown(text: str) -> str:
    """RESULTS.md as the site's page. Its links into ``results/`` resolve unchanged (the files are
    mounted there); a link to the plots folder goes to the generated gallery page."""
    return text.replace("](results/plots/)", "](results/plots/index.md)")


def plots_gallery(pngs: list[Path]) -> str:
    lines = [
        "# Plots",
        "",
        "Drawn from the JSON of [the current figures](../../results.md) by `python -m benchmarks.plots`",
        "(the `plot` extra).",
        "",
    ]
    for png in pngs:
        lines += [f"## {png.stem}", "", f"![{png.stem}]({png.name})", ""]
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    # Imported here: regenerating the docs' sections (``python docs/generate.py``) needs no MkDocs.
    from mkdocs.structure.files import File

    files.append(File.generated(config, "results.md", content=results_markdown(RESULTS_MD.read_text())))
    for path in sorted(p for p in RESULTS_DIR.rglob("*") if p.is_file()):
        uri = "results/" + path.relative_to(RESULTS_DIR).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    pngs = sorted((RESULTS_DIR / "plots").glob("*.png"))
    files.append(File.generated(config, "results/plots/index.md", content=plots_gallery(pngs)))
    return files


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    page.present_anchor_ids.update(re.findall(r'<a id="([\w-]+)"></a>', html))
    return html


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    for path in (RESULTS_MD, RESULTS_DIR):
        server.watch(str(path))
    return server


# A docs page (they all sit at the top of docs/) links the results as the repository has them, which
# is where a reader of the repository finds them; the site mounts the same files elsewhere (on_files).
_REPO_RESULTS_LINK = re.compile(r"\]\(\.\./benchmarks/(RESULTS\.md|results/)")


def site_links(markdown: str) -> str:
    """``](../benchmarks/RESULTS.md#row)`` as ``](results.md#row)``, ``](../benchmarks/results/x)`` as
    ``](results/x)``."""
    return _REPO_RESULTS_LINK.sub(lambda m: "](" + m.group(1).replace("RESULTS.md", "results.md"), markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return site_links(markdown)

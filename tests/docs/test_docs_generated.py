"""The generated sections of the docs (api.md's routes, serving.md's options, client.md's reference) are
committed, so the repository shows them; they must be what `docs/gen.py` generates from the code
now. A new route, option or client docstring without `python docs/generate.py` fails here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generate():
    # docs/ is no package: load the file MkDocs loads.
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


gen = _generate()


def test_generated_sections_are_current():
    """Exactly, under the library versions the sections were generated with; under others (a fresh
    install may resolve newer ones), every route, model, option and client name is still there and
    nothing else is: what a reader looks up, not the wording the libraries give it."""
    stale, same = [], {gen.generator_versions()}
    for page, (old, new) in gen.regenerated().items():
        exact = gen.recorded_versions(old) == same
        if (old != new) if exact else (gen.skeleton(old) != gen.skeleton(new)):
            stale.append(page)
    assert stale == [], f"stale generated sections in {stale}: run `{gen.REGENERATE}` and commit the result"


def test_under_other_versions_a_new_option_still_makes_the_page_stale(monkeypatch):
    page = (ROOT / "docs" / "serving.md").read_text()
    monkeypatch.setattr(gen, "generator_versions", lambda: "fastapi 0.0.1, python 3.99")
    _, new = gen.regenerated()["serving.md"]
    assert gen.recorded_versions(new) == {"fastapi 0.0.1, python 3.99"} != gen.recorded_versions(page)
    assert gen.skeleton(new) == gen.skeleton(page)  # only the wording could differ
    row = "| `--max-batch-size` ("
    dropped = "\n".join(line for line in page.splitlines() if not line.startswith(row))
    assert gen.skeleton(dropped) != gen.skeleton(new)  # an option the page lacks


def test_each_section_is_in_its_page_with_what_it_documents():
    api, serving, client = ((ROOT / "docs" / n).read_text() for n in ("api.md", "serving.md", "client.md"))
    assert "#### POST `/rollout/generate`" in api and '<a id="post-rollout-generate"></a>' in api
    assert "| `--max-batch-size` (`DIFFUSION_ROLLOUT_MAX_BATCH_SIZE`) |" in serving
    assert "#### `RolloutClient`" in client and "##### `RolloutClient.generate_many`" in client
    assert "\n::: " not in client  # no mkdocstrings directive is left


def test_a_changed_docstring_makes_the_client_reference_stale(monkeypatch):
    from diffusion_rollout.client import results

    page = (ROOT / "docs" / "client.md").read_text()
    assert "Regrouped, documented anew." not in page
    monkeypatch.setattr(results.group_by_server_batch, "__doc__", "Regrouped, documented anew.")
    old, new = gen.regenerated()["client.md"]
    assert old == page and new != page and "Regrouped, documented anew." in new


def test_fill_replaces_only_between_the_markers():
    text = "before\n<!-- generated: x -->\nold\n<!-- end generated: x -->\nafter\n"
    stamp = f"<!-- generated with {gen.generator_versions()} -->"
    assert gen.fill(text, "x", "new\n") == (
        f"before\n<!-- generated: x -->\n{stamp}\n\nnew\n\n<!-- end generated: x -->\nafter\n"
    )
    for broken in ("<!-- generated: x -->\n", "<!-- end generated: x --><!-- generated: x -->"):
        with pytest.raises(ValueError, match="expected one"):
            gen.fill(broken, "x", "new")


def test_check_reports_a_stale_page_and_names_the_command(tmp_path, monkeypatch, capsys):
    # The pages as this install generates them (the committed ones may carry other versions' text).
    for page, (_, current) in gen.regenerated().items():
        (tmp_path / page).write_text(current)
    serving = tmp_path / "serving.md"
    row = "| `--max-batch-size` ("
    assert row in serving.read_text()
    serving.write_text(serving.read_text().replace(row, "| `--max-batch-sizes` ("))
    monkeypatch.setattr(gen, "DOCS", tmp_path)
    assert gen.main(["--check"]) == 1
    assert (
        capsys.readouterr().out
        == "docs/serving.md: a generated section is stale; run `python docs/generate.py`\n"
    )
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    # Rewritten as the committed page (exactly, under the versions it was generated with).
    assert gen.skeleton(serving.read_text()) == gen.skeleton((ROOT / "docs" / "serving.md").read_text())

"""The documentation site builds with ``mkdocs build --strict`` and holds what it is generated from.

`docs/hooks.py` adds `benchmarks/RESULTS.md` (as `results.md`) with the files it links and points the
pages' links to them (`../benchmarks/RESULTS.md#row` in the repository) at those copies; the HTTP API
reference, the `serve` options and the client reference are committed in the pages (kept current by
test_docs_generated.py). Strict mode fails on any broken link or anchor. One build serves every test
here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def test_api_page_lists_every_route_of_the_app(site):
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app

    html = _page(site, "api")
    for path in [
        "/rollout/generate",
        "/update_weights",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/update_weights_from_tensor_checker",
    ]:
        assert f"<code>{path}</code>" in html, path
    # Generated, not written by hand: every route of the app and every rollout field is there.
    spec = create_app(ServerConfig()).openapi()
    missing = [p for p in spec["paths"] if f"<code>{p}</code>" not in html]
    assert missing == []
    fields = spec["components"]["schemas"]["GenerateRequest"]["properties"]
    assert [f for f in fields if f"<code>{f}</code>" not in html] == []
    assert 'id="post-rollout-generate"' in html and 'id="model-generaterequest"' in html


def test_results_page_is_benchmarks_results_with_its_files(site):
    html = _page(site, "results")
    assert "Benchmark results: the current figures" in html
    for row in ("scale-colocated-fast", "grpo-lanes2", "train-sd35-grpo"):
        assert f'id="{row}"' in html, row
    # The plots and the JSON the rows link are part of the site, not copies under docs/.
    assert (site / "results" / "plots" / "reward_sd35.png").is_file()
    assert (site / "results" / "h200" / "ode_regression_sd3.5-medium.json").is_file()
    assert 'href="h200/ode_regression_sd3.5-medium.json"' in html  # the page is results/index.html
    assert (site / "results" / "HISTORY" / "index.html").is_file()
    assert "reward_sd35.png" in _page(site, "results/plots")
    assert not (ROOT / "docs" / "results.md").exists()
    assert not list((ROOT / "docs").rglob("*.png"))


def test_docs_pages_link_figures_to_result_rows(site):
    # The page links ../benchmarks/RESULTS.md#scale-colocated-fast and ../benchmarks/results/plots/...
    html = _page(site, "training")
    assert 'href="../results/#scale-colocated-fast"' in html
    assert 'src="../results/plots/reward_sd35.png"' in html
    assert 'href="../benchmarks/' not in html and 'src="../benchmarks/' not in html


def test_client_reference_and_serve_options_are_generated(site):
    client = _page(site, "client")
    for name in ("RolloutClient", "generate_many", "push_weights", "replay_steps", "RolloutOutput"):
        assert name in client, name
    from diffusion_rollout.config import ServerConfig

    serving = _page(site, "serving")
    flags = ["--" + name.replace("_", "-") for name in ServerConfig.model_fields]
    assert [f for f in flags if f"<code>{f}</code>" not in serving] == []


def test_screenshots_of_the_landing_and_api_pages(site):
    """`scripts/docs_screenshots.py` on this build, where a Chromium is installed (`.ci/run` installs
    Debian's): the PNGs are the suite's artifacts, in `$DIFFUSION_ROLLOUT_ARTIFACTS/docs` (default
    `.artifacts/docs`, ignored by git), for a person to look at."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_screenshots
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    if docs_screenshots.chromium() is None:
        pytest.skip("no Chromium on PATH")
    artifacts = Path(os.environ.get("DIFFUSION_ROLLOUT_ARTIFACTS", ROOT / ".artifacts")) / "docs"
    shots = docs_screenshots.screenshots(site, artifacts)
    assert set(shots) == {"landing", "api"}
    for png in shots.values():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

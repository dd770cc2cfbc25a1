"""Screenshots of the built documentation site in headless Chromium (Debian's ``chromium`` package).

    python scripts/docs_screenshots.py SITE_DIR OUT_DIR        # SITE_DIR from `mkdocs build -d SITE_DIR`

Writes ``OUT_DIR/landing.png`` and ``OUT_DIR/api.png`` (1280x1600) and prints their paths. The
suite runs it on its own build (``tests/docs/test_docs_site.py``) when a Chromium is installed;
``.ci/run`` installs one. Chromium runs with ``--no-sandbox``: the suite may run as root, where its
sandbox refuses to start.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

PAGES = {"landing": "index.html", "api": "api/index.html"}


def chromium() -> str | None:
    """The Chromium binary on PATH, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def screenshots(site: Path, out: Path, timeout_s: float = 120.0) -> dict[str, Path]:
    binary = chromium()
    if binary is None:
        raise RuntimeError("no Chromium on PATH (Debian: apt-get install chromium)")
    out.mkdir(parents=True, exist_ok=True)
    shots = {}
    for name, page in PAGES.items():
        target = (site / page).resolve()
        if not target.exists():
            raise FileNotFoundError(target)
        png = out / f"{name}.png"
        cmd = [
            binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--window-size=1280,1600", f"--screenshot={png}", target.as_uri(),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=timeout_s)
        shots[name] = png
    return shots


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    for png in screenshots(Path(args[0]), Path(args[1])).values():
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

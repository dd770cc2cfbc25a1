"""Every figure the README and the docs state as measured is traced to a RESULTS.md row, and every row
to its JSON.

The chain is README or `docs/*.md` -> `benchmarks/RESULTS.md` row -> `benchmarks/results/**.json` key:

- A RESULTS row is a table row whose first cell holds `<a id="ID"></a>`; its value cell lists
  numbers, and its last cell links the JSON file and gives one key path (in backticks) per number,
  in the same order. Each JSON value, rounded as the row prints it, must equal the printed number.
  A row that says "journal only" has no JSON (its figure is in `results/HISTORY.md`).
- README text links a figure to its row: `[1.018x](benchmarks/RESULTS.md#grpo-lanes2)`; every
  number in the link text must equal, at the precision the README prints, one of the row's JSON
  values. In a README table row whose first cell links a RESULTS row, every number in the other
  cells must.
- The docs pages (`docs/*.md`) link the same way, relative to `docs/`,
  `[7.51](../benchmarks/RESULTS.md#scale-colocated-fast)`, under the same two rules (the MkDocs site,
  where RESULTS.md is the page `results.md`, gets `results.md#row`: `docs/hooks.py` rewrites the
  link). A docs link written as `results.md#row` is refused: it resolves only on the site, not in
  the repository.

So a README figure changed alone, or a JSON value changed alone, fails (see the negative tests).
Key paths: `a.b[3]`, `list[key=value,key2=value2]` (a filter), `list[*]`, a `max:`/`min:`/
`median:` prefix over the values a path yields, `other.json:path` for another file of the row
JSON's folder, and `x / y`, `x - y`, `x + y`, `x * 1000` (operators with spaces, left to right).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?")
_ROW_ID = re.compile(r'<a id="([\w-]+)"></a>')
_README_LINK = re.compile(r"\[([^\]]*)\]\((?:\./)?benchmarks/RESULTS\.md#([\w-]+)\)")
_DOCS_LINK = re.compile(r"\[([^\]]*)\]\((?:\./)?\.\./benchmarks/RESULTS\.md#([\w-]+)\)")
_SITE_ONLY_LINK = re.compile(r"\]\((?:\./)?results\.md#([\w-]+)\)")
_FUNCS = {"max": max, "min": min, "median": statistics.median}


def _numbers(text: str) -> list[tuple[float, float]]:
    """Each number in `text` with half a unit of its last printed digit (its rounding)."""
    out = []
    for m in _NUMBER.finditer(text.replace("−", "-")):
        s = m.group(0)
        mantissa, _, exp = s.partition("e")
        decimals = len(mantissa.partition(".")[2])
        out.append((float(s), 0.5 * 10.0 ** (int(exp or 0) - decimals)))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _split_outside_brackets(expr: str, seps: tuple[str, ...]) -> list[str]:
    parts, depth, start, i = [], 0, 0, 0
    while i < len(expr):
        ch = expr[i]
        depth += ch == "["
        depth -= ch == "]"
        sep = next((s for s in seps if depth == 0 and expr.startswith(s, i)), None)
        if sep:
            parts += [expr[start:i], sep.strip()]
            i += len(sep)
            start = i
        else:
            i += 1
    return [*parts, expr[start:]]


def _resolve(doc: Any, path: str) -> list[Any]:
    nodes = [doc]
    for name, selector in re.findall(r"\.?([^.\[\]]+)|\[([^\]]*)\]", path):
        if name:
            nodes = [n[name] for n in nodes]
        elif selector == "*":
            nodes = [x for n in nodes for x in n]
        elif re.fullmatch(r"-?\d+", selector):
            nodes = [n[int(selector)] for n in nodes]
        else:
            conds = [c.split("=", 1) for c in re.split(r",(?=\s*[\w.]+=)", selector)]
            want = {k.strip(): v.strip() for k, v in conds}

            nodes = [x for n in nodes for x in n if all(_text(x.get(k)) == v for k, v in want.items())]
    return nodes


def _text(v: Any) -> str:
    return json.dumps(v) if isinstance(v, bool) or v is None else str(v)


def _operand(term: str, json_path: Path) -> float:
    term = term.strip()
    if re.fullmatch(r"-?\d+(?:\.\d+)?", term):
        return float(term)
    file_part, sep, rest = term.partition(".json:")
    path, doc_path = (rest, json_path.parent / f"{file_part}.json") if sep else (term, json_path)
    func, _, path = path.rpartition(":") if re.match(r"^(max|min|median):", path) else ("", "", path)
    values = _resolve(json.loads(doc_path.read_text()), path)
    if func:
        return float(_FUNCS[func](values))
    if len(values) != 1:
        raise ValueError(f"{term!r} gives {len(values)} values, not one")
    return float(values[0])


def evaluate(expr: str, json_path: Path) -> float:
    """A row's key expression against its JSON file (operators left to right)."""
    parts = _split_outside_brackets(expr, (" + ", " - ", " * ", " / "))
    value = _operand(parts[0], json_path)
    for op, term in zip(parts[1::2], parts[2::2], strict=True):
        x = _operand(term, json_path)
        value = value + x if op == "+" else value - x if op == "-" else value * x if op == "*" else value / x
    return value


def parse_results(results_text: str) -> dict[str, dict[str, Any]]:
    """id -> {"printed": [(number, half unit)], "keys": [...], "json": path or None, "line": str}."""
    rows: dict[str, dict[str, Any]] = {}
    for line in results_text.splitlines():
        cells = _cells(line) if line.startswith("|") else []
        m = _ROW_ID.search(cells[0]) if cells else None
        if not m:
            continue
        source = cells[-1]
        link = re.search(r"\]\((results/[^)]+\.json)\)", source)
        rows[m.group(1)] = {
            "printed": _numbers(cells[2]),
            "keys": re.findall(r"`([^`]+)`", source),
            "json": link.group(1) if link else None,
            "journal_only": "journal only" in source,
            "date": cells[5],
            "line": line,
        }
    return rows


def docs_pages(docs: Path = DOCS) -> dict[str, str]:
    """``{"docs/name.md": text}`` for every page of the site's sources."""
    return {f"docs/{p.relative_to(docs).as_posix()}": p.read_text() for p in sorted(docs.rglob("*.md"))}


def check(
    readme_text: str, results_text: str, root: Path = ROOT, docs: dict[str, str] | None = None
) -> list[str]:
    """Every mismatch between the README (and the ``docs`` pages, ``{name: text}``), RESULTS.md and the
    JSON, as readable lines."""
    problems: list[str] = []
    rows = parse_results(results_text)
    values: dict[str, list[float]] = {}
    for rid, row in rows.items():
        if row["json"] is None:
            if not row["journal_only"]:
                problems.append(f"{rid}: no JSON link and not marked 'journal only'")
            continue
        json_path = root / "benchmarks" / row["json"]
        if not json_path.is_file():
            problems.append(f"{rid}: {row['json']} does not exist")
            continue
        doc = json.loads(json_path.read_text())
        written = str(doc.get("written_at", ""))[:10]
        if written and written != row["date"]:
            problems.append(f"{rid}: date {row['date']} but the JSON was written {written}")
        if len(row["keys"]) != len(row["printed"]):
            problems.append(f"{rid}: {len(row['printed'])} numbers but {len(row['keys'])} key paths")
            continue
        got = []
        for key, (number, half) in zip(row["keys"], row["printed"], strict=True):
            try:
                v = evaluate(key, json_path)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                problems.append(f"{rid}: key {key!r}: {type(e).__name__} {e}")
                continue
            got.append(v)
            if abs(v - number) > half * (1 + 1e-9):
                problems.append(f"{rid}: prints {number} but {row['json']} {key} = {v!r}")
        values[rid] = got
    headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", results_text, flags=re.M)}
    sources = [("README", readme_text, _README_LINK)]
    sources += [(name, text, _DOCS_LINK) for name, text in (docs or {}).items()]
    for name, text, link in sources:
        problems += _check_links(name, text, link, rows, values, headings)
    for name, text in (docs or {}).items():
        problems += [
            f"{name} links results.md#{rid}, which only the site has: link ../benchmarks/RESULTS.md#{rid}"
            for rid in _SITE_ONLY_LINK.findall(text)
        ]
    return problems


def _check_links(
    name: str,
    text: str,
    link: re.Pattern[str],
    rows: dict[str, dict[str, Any]],
    values: dict[str, list[float]],
    headings: set[str],
) -> list[str]:
    """Every number ``name`` links to a RESULTS row (``link``) that is none of the row's values."""
    problems: list[str] = []
    for line in text.splitlines():
        links = list(link.finditer(line))
        targets = [(m.group(1), m.group(2)) for m in links]
        cells = _cells(line) if line.lstrip().startswith("|") else []
        if cells and links and link.search(cells[0]):
            targets.append((" | ".join(cells[1:]), link.search(cells[0]).group(2)))
        for linked, rid in targets:
            if rid in headings and not _numbers(linked):
                continue
            if rid not in rows:
                problems.append(f"{name} links #{rid}, which RESULTS.md does not have")
                continue
            journal = rows[rid]["journal_only"]
            pool = [n for n, _ in rows[rid]["printed"]] if journal else values.get(rid, [])
            for number, half in _numbers(linked):
                if not any(abs(v - number) <= half * (1 + 1e-9) for v in pool):
                    problems.append(f"{name} {number} (linked to #{rid}) is none of the row's values {pool}")
    return problems


def test_readme_figures_trace_to_results_rows_and_json():
    problems = check(README.read_text(), RESULTS.read_text())
    assert problems == []


def test_docs_figures_trace_to_results_rows_and_json():
    docs = docs_pages()
    assert "docs/training.md" in docs and "docs/speed.md" in docs
    problems = check(README.read_text(), RESULTS.read_text(), docs=docs)
    assert problems == []
    # Written the README's way, a link from docs/ would miss (docs/benchmarks/ does not exist).
    assert not [n for n, t in docs.items() if _README_LINK.search(t)]


def test_every_results_row_names_its_json_and_the_readme_links_rows():
    rows = parse_results(RESULTS.read_text())
    assert len(rows) >= 30
    assert all(r["json"] or r["journal_only"] for r in rows.values())
    linked = {m.group(2) for m in _README_LINK.finditer(README.read_text())}
    assert {"grpo-lanes2", "sync-upload-port", "cp-wan21", "train-sd35-grpo"} <= linked
    docs_linked = {m.group(2) for text in docs_pages().values() for m in _DOCS_LINK.finditer(text)}
    assert {"scale-colocated-fast", "train-colocated", "video-grpo-same-host", "sync-verified"} <= docs_linked
    assert len(docs_linked) >= 60
    assert len(RESULTS.read_text().splitlines()) <= 250


def test_a_readme_figure_changed_alone_is_reported():
    readme = README.read_text()
    assert "[1.018x](benchmarks/RESULTS.md#grpo-lanes2)" in readme
    changed = readme.replace(
        "[1.018x](benchmarks/RESULTS.md#grpo-lanes2)", "[1.028x](benchmarks/RESULTS.md#grpo-lanes2)"
    )
    problems = check(changed, RESULTS.read_text())
    assert any("1.028" in p and "#grpo-lanes2" in p for p in problems)


def test_a_readme_table_cell_changed_alone_is_reported():
    # The table lives in docs/training.md now; the same row written the README's way.
    row = next(line for line in docs_pages()["docs/training.md"].splitlines() if "| 11.95 s |" in line)
    readme = (
        README.read_text()
        + "\n"
        + row.replace("(../benchmarks/RESULTS.md#", "(benchmarks/RESULTS.md#")
        + "\n"
    )
    assert check(readme, RESULTS.read_text()) == []
    problems = check(readme.replace("| 11.95 s |", "| 11.59 s |"), RESULTS.read_text())
    assert any("README 11.59" in p and "#train-colocated" in p for p in problems)


def test_a_docs_table_cell_changed_alone_is_reported():
    docs = docs_pages()
    assert "| 11.95 s |" in docs["docs/training.md"]
    docs["docs/training.md"] = docs["docs/training.md"].replace("| 11.95 s |", "| 11.59 s |")
    problems = check(README.read_text(), RESULTS.read_text(), docs=docs)
    assert any(p.startswith("docs/training.md 11.59") and "#train-colocated" in p for p in problems)


def test_a_docs_figure_changed_alone_is_reported():
    docs = docs_pages()
    assert "[0.724](../benchmarks/RESULTS.md#scale-vs-in-process)" in docs["docs/training.md"]
    docs["docs/training.md"] = docs["docs/training.md"].replace(
        "[0.724](../benchmarks/RESULTS.md#scale-vs-in-process)",
        "[0.742](../benchmarks/RESULTS.md#scale-vs-in-process)",
    )
    problems = check(README.read_text(), RESULTS.read_text(), docs=docs)
    assert any(p.startswith("docs/training.md 0.742") and "#scale-vs-in-process" in p for p in problems)


def test_a_docs_link_to_a_missing_row_is_reported():
    docs = {"docs/x.md": "took [7.51](../benchmarks/RESULTS.md#scale-colocated-fastest)"}
    problems = check(README.read_text(), RESULTS.read_text(), docs=docs)
    assert problems == ["docs/x.md links #scale-colocated-fastest, which RESULTS.md does not have"]


def test_a_docs_link_only_the_site_resolves_is_reported():
    docs = {"docs/x.md": "took [7.51](results.md#scale-colocated-fast)"}
    problems = check(README.read_text(), RESULTS.read_text(), docs=docs)
    assert problems == [
        "docs/x.md links results.md#scale-colocated-fast, which only the site has: "
        "link ../benchmarks/RESULTS.md#scale-colocated-fast"
    ]


def test_a_json_value_changed_alone_is_reported(tmp_path):
    for f in (ROOT / "benchmarks" / "results").rglob("*.json"):
        dest = tmp_path / f.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.read_bytes())
    changed = tmp_path / "benchmarks" / "results" / "h100" / "training" / "sd35-flow-grpo.json"
    doc = json.loads(changed.read_text())
    doc["summary"]["learning"]["reward_last_k"] = -168.46
    changed.write_text(json.dumps(doc))
    assert check(README.read_text(), RESULTS.read_text(), root=tmp_path) != []
    problems = check(README.read_text(), RESULTS.read_text(), root=tmp_path)
    assert any(p.startswith("train-sd35-grpo: prints -158.46") for p in problems)


def test_a_results_row_changed_alone_is_reported():
    results = RESULTS.read_text().replace("| 1.018x stock |", "| 1.081x stock |")
    problems = check(README.read_text(), results)
    assert any(p.startswith("grpo-lanes2: prints 1.081") for p in problems)


_CODE_REF = re.compile(r"RESULTS\.md#([a-z0-9-]+)")


def test_results_rows_named_in_code_exist():
    """Comments and docstrings cite their evidence as ``benchmarks/RESULTS.md#row``: every such row
    exists (one comment named a row that was never written)."""
    rows = set(parse_results(RESULTS.read_text()))
    cited = {
        (path.relative_to(ROOT).as_posix(), m.group(1))
        for folder in ("diffusion_rollout", "benchmarks", "examples")
        for path in (ROOT / folder).rglob("*.py")
        for m in _CODE_REF.finditer(path.read_text())
    }
    assert len(cited) >= 10
    assert sorted((path, row) for path, row in cited if row not in rows) == []

"""The README and docs say what the tool does: the main command prints the table the README quotes, the
headline figures come from it, links resolve, and no user-facing text points at this project's internals."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeplace.cli import cli

REPO = Path(__file__).parents[1]
README = (REPO / "README.md").read_text()
USER_DOCS = [REPO / "README.md", REPO / "traces" / "FORMAT.md", *sorted((REPO / "docs").glob("*.md"))]


def main_command() -> list[str]:
    """The README's main job: the ``moeplace optimize ...`` after ``pip install . &&``."""
    line = next(x for x in README.splitlines() if "pip install . && moeplace " in x)
    return shlex.split(line.split("&& moeplace ", 1)[1])


def quoted_output() -> list[str]:
    """The ```text block right after the main command: what the README says it prints."""
    block = README.split("It prints", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def table(lines: list[str]) -> dict[str, dict[str, str]]:
    """{placement: {column header: cell}} from an aligned table (headers are split on 2+ spaces)."""
    start = next(i for i, x in enumerate(lines) if x.startswith("placement "))
    heads = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 2:]:
        cells = re.split(r"\s{2,}", line.strip())   # a placement's name may hold single spaces
        if len(cells) != len(heads):
            break
        rows[cells[0]] = dict(zip(heads, cells))
    return rows


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, list[str]]:
    """stdout of the README's main command, and of the same with --redundant 8, run in a scratch folder."""
    out = {}
    for label, extra in (("main", []), ("redundant", ["--redundant", "8"])):
        work = tmp_path_factory.mktemp(label)
        args = [str(REPO / a) if a.startswith("traces/") else str(work / a) if a in (
            "placement.json", "init_expert_location.json", "plots") else a for a in main_command()]
        result = CliRunner().invoke(cli, args + extra)
        assert result.exit_code == 0, result.output
        out[label] = [line.strip() for line in result.stdout.splitlines()]
    return out


def test_readme_quotes_what_the_main_command_prints(printed):
    quoted, actual = quoted_output(), printed["main"]
    assert quoted[0] == actual[0]                                  # what was fitted and reported
    assert table(quoted) and {name: row for name, row in table(quoted).items()} == {
        name: {h: table(actual)[name][h] for h in row} for name, row in table(quoted).items()}
    for prefix in ("baseline: ", "cost model (MoE µs/step): "):
        assert [x for x in quoted if x.startswith(prefix)] == [x for x in actual if x.startswith(prefix)]


def test_headline_figures_come_from_the_main_command(printed):
    results = README.split("## Results", 1)[1]
    sample = results.split("**The shipped sample**", 1)[1].split("\n* ", 1)[0]
    rows, red = table(printed["main"]), table(printed["redundant"])
    for figure in (rows["stepaware"]["E[max distinct]"], rows["deepseek"]["E[max distinct]"],
                   rows["contiguous"]["E[max distinct]"], rows["stepaware"]["vs baseline"],
                   red["deepseek"]["E[max distinct]"], red["stepaware"]["E[max distinct]"]):
        assert figure.lstrip("+") in sample, figure
    held_out = printed["main"][0].split("table on the last ")[1].split(",")[0]
    assert f"{held_out} held-out steps" in sample


def test_every_figure_in_results_names_its_data():
    results = README.split("## Results", 1)[1]
    for bullet in results.split("\n* ")[1:]:
        if re.search(r"\d\.\d{3}|\d ms", bullet):
            assert "shipped sample" in bullet or "BENCHMARKS.md" in bullet or "scripts/" in bullet, bullet


def anchors(doc: Path) -> set[str]:
    """The GitHub anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to '-')."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in doc.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.name)
def test_links_resolve(doc):
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)]*))?\)", doc.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path = doc.parent / target if target else doc
        assert path.exists(), f"{doc.name} links to {target}"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{doc.name} links to {target}#{anchor}, a heading {path.name} lacks"


def test_code_points_at_sections_that_exist():
    """A design choice in the code names the BENCHMARKS or docs/ section that decided it; that section must be there."""
    cited = {(p.name, doc, a) for p in repository_texts() if p.suffix in (".py", ".cu", ".inc")
             for doc, a in re.findall(r"(BENCHMARKS\.md|docs/[\w-]+\.md)#([\w-]+)", p.read_text())}
    assert {doc for _, doc, _ in cited} >= {"BENCHMARKS.md", "docs/verify-kernel-log.md"}
    assert [c for c in cited if not (REPO / c[1]).exists() or c[2] not in anchors(REPO / c[1])] == []


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.name)
def test_no_internal_references(doc):
    text = doc.read_text()
    for pattern in (r"\bissue\s*#?\d", r"\.\./shared", r"/work/", r"shared/traces-real"):
        assert not re.search(pattern, text, re.IGNORECASE), (doc.name, pattern)


def test_help_and_provenance_have_no_internal_references():
    from moeplace.cost.derive import packaged_measurements
    from moeplace.cost.model import CostModel

    texts = [CliRunner().invoke(cli, [name, "--help"]).output
             for name in ("report", "optimize", "compare", "advise", "launch", "capture")]
    texts += [str(m.cost.provenance) for m in packaged_measurements()] + [CostModel().describe()]
    for text in texts:
        assert not re.search(r"\bissue\s*#?\d|\.\./shared", text, re.IGNORECASE), text[:200]


def test_readme_keeps_kernel_and_kv_detail_on_their_own_pages():
    assert "docs/kv-sort.md" in README and "docs/verify-kernel.md" in README and "docs/walkthrough.md" in README
    assert "release_pages" not in README and "need_sort" not in README    # allocator internals: docs/kv-sort.md
    assert "TB/s" not in README                                           # kernel figures: docs/verify-kernel.md


# How the work was organised (issue numbers, work periods, calls to a GPU machine) is no part of the product.
WORK_WORDS = re.compile(r"\bissues?[ -]?#?\d+|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
                        r"eleventh|twelfth|this|last|next|previous|earlier|later) session\b|\bdevice calls?\b",
                        re.IGNORECASE)
SOURCE_SUFFIXES = {".py", ".md", ".sh", ".cfg", ".toml", ".cu", ".inc", ".txt"}


def repository_texts() -> list[Path]:
    """Every source, script and document of the repository: git's tracked and not-ignored files where the
    checkout has git (ignored folders hold environments and copies), else every file but the usual build output."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode().split("\0")
        files = [REPO / name for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "build", "dist", "__pycache__"}
        files = [p for p in REPO.rglob("*") if not any(
            part in skip or part.startswith(".") or part.endswith(".egg-info") for part in p.relative_to(REPO).parts)]
    venvs = [cfg.parent for cfg in REPO.glob("*/pyvenv.cfg")]  # a virtual environment made in the checkout
    return [p for p in sorted(files) if p.is_file() and p.suffix in SOURCE_SUFFIXES
            and not any(v in p.parents for v in venvs)]


def test_no_words_about_how_the_work_was_organised():
    own = Path(__file__).resolve()        # this file names the words it looks for
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()[:120]}"
             for p in repository_texts() if p.resolve() != own
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if WORK_WORDS.search(line)]
    assert found == []


def test_the_work_words_pattern_catches_what_it_must():
    for text in ("as in issue 19's layout", "the third session measured", "issue-22 rows", "one device call"):
        assert WORK_WORDS.search(text), text
    for text in ("every load issued up front", "start_new_session=True", "a request's session of steps"):
        assert not WORK_WORDS.search(text), text

"""The docs hold together: every relative link and `#anchor` resolves, README.md stays a short
door (at most 10 KB, no test count), the docs name code rather than its line numbers, and the
one table of exit statuses is main.py's.

The checker is tested on documents written here, so that a checker which finds nothing cannot
pass for docs without broken links.
"""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # make test-fast

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
README_MAX_BYTES = 10_240
# docs/concepts.md quotes code lines on purpose; tests/test_concepts.py checks them.
LINE_REFERENCES_ALLOWED = {REPO / "docs" / "concepts.md"}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
TEST_COUNT = re.compile(r"\b\d[\d,]*\s+(?:tests?|passed|failed|skipped|errors?)\b", re.I)
LINE_REFERENCE = re.compile(r"\b[\w./-]+\.(?:py|sh):\d+\b")


def documents() -> list[Path]:
    return [
        README,
        REPO / "CONTRIBUTING.md",
        REPO / "tests" / "README.md",
        *sorted((REPO / "docs").rglob("*.md")),
    ]


def prose(text: str) -> str:
    """The text without code blocks and code spans: links and headings live outside them."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each relative link of one document, named from `root`."""
    bad = []
    name = path.relative_to(root)
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            bad.append(f"{name}: {target}: no such file")
        elif anchor and (where.is_dir() or where.suffix != ".md"):
            bad.append(f"{name}: {target}: an anchor into a non-Markdown file")
        elif anchor and anchor not in anchors(where):
            bad.append(f"{name}: {target}: no heading with that anchor")
    return bad


def test_every_relative_link_and_anchor_resolves():
    bad = [problem for doc in documents() for problem in broken_links(doc)]
    assert not bad, "\n".join(bad)


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Checkpoints, resume and `--resume`\n\n## On SLURM\n")
    (tmp_path / "a.md").write_text(
        "# A\n\n"
        "[ok](docs/b.md) [ok](docs/b.md#checkpoints-resume-and---resume) [ok](#a)\n"
        "[ok](docs/b.md#on-slurm) [ok](https://example.org/nowhere.md)\n"
        "`[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n"
        "[bad](docs/c.md) [bad](docs/b.md#on-slurm-1) [bad](#b)\n"
    )
    bad = broken_links(tmp_path / "a.md", tmp_path)
    assert [problem.split(": ")[1] for problem in bad] == [
        "docs/c.md",
        "docs/b.md#on-slurm-1",
        "#b",
    ]


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Strategies, models and training options", "strategies-models-and-training-options"),
        ("`run.sh`, the job script", "runsh-the-job-script"),
        ("Containers (CSCS Alps)", "containers-cscs-alps"),
        ("A scaling sweep: `run_benchmarks.py`", "a-scaling-sweep-run_benchmarkspy"),
        ("Why `x.shape[1:]` rather than a fixed shape?", "why-xshape1-rather-than-a-fixed-shape"),
    ],
)
def test_anchors_follow_githubs_rules(heading, anchor):
    assert slug(heading) == anchor


def test_readme_is_a_short_door():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"
    counts = TEST_COUNT.findall(README.read_text())
    assert not counts, f"README.md names a test count: {counts}; it changes with every test"


def test_docs_name_code_rather_than_line_numbers():
    bad = [
        f"{doc.relative_to(REPO)}: {reference}"
        for doc in documents()
        if doc not in LINE_REFERENCES_ALLOWED
        for reference in LINE_REFERENCE.findall(doc.read_text())
    ]
    assert not bad, "refer to code by file and name: " + ", ".join(bad)


def test_the_exit_status_table_is_main_pys():
    """docs/troubleshooting.md's table, the one every doc links to, lists each status main.py
    ends with (`main.EXIT_STATUS`) and no other."""
    from main import EXIT_STATUS

    text = (REPO / "docs" / "troubleshooting.md").read_text()
    table = text.split("## Exit statuses", 1)[1].split("\n## ", 1)[0]
    listed = [int(status) for status in re.findall(r"^\| (\d+) \|", table, re.M)]
    assert sorted(listed) == sorted(EXIT_STATUS.values())

"""The docs hold together: every relative link and `#anchor` resolves, README.md stays a short
door (at most 10 KB, no test count), the docs name code rather than its line numbers, their
copy-paste blocks work as written (no sudo, no bare python outside the activated .venv), and
the one table of exit statuses is main.py's.

Each checker is tested on documents written here, so that a checker which finds nothing cannot
pass for docs without faults.
"""

import re
from pathlib import Path

import pytest

import layout
from utils import EXIT_STATUS, METRIC, METRIC_FIELDS, parse_metric

pytestmark = pytest.mark.fast  # make test-fast

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
README_MAX_BYTES = 10_240

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
TEST_COUNT = re.compile(r"\b\d[\d,]*\s+(?:tests?|passed|failed|skipped|errors?)\b", re.I)
# Where a command of a code block starts: a line's start or after ;, &, |, (, past variable
# assignments (LOGS=x python ...). Comments are left out: they may say "prefix sudo".
COMMAND_START = r"(?:^|[;&|(])\s*(?:\w+=\S*\s+)*"
SUDO = re.compile(COMMAND_START + r"sudo\b")
# Making the virtual environment needs none of the project's packages.
BARE_PYTHON = re.compile(COMMAND_START + r"python3?\b(?! -m venv\b)")
COMMENT = re.compile(r"(?:^|\s)#.*")
ACTIVATE = "source .venv/bin/activate"
DURATION = re.compile(r"\b\d[\d.]*\s*(?:s|secs?|seconds?|min|minutes?|h|hours?)\b", re.I)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
# The quickstart, within the README's first lines: install, a run that needs no
# internet, then one job, the sweep and the plots on a cluster.
QUICKSTART = (
    "make install",
    "--dataset synthetic",
    "sbatch -A ACCOUNT run.sh",
    "python run_benchmarks.py --account ACCOUNT",
    "./plot_results.sh",
)
QUICKSTART_LINES = 60
# A range quoted from measured runs (FSDP 2,861-3,532 images/s): dated measurements live in
# docs/performance.md (the product's) and docs/development.md (the test suite's), so a range
# another page quotes must be one that they record.
QUOTED_RANGE = re.compile(r"\b\d{1,3}(?:,\d{3})+-\d{1,3}(?:,\d{3})+\b")
RECORDS = [REPO / "docs" / "performance.md", REPO / "docs" / "development.md"]
# tests/README.md's table of the tests of each module: | `data.py` | `test_data.py`, ... |
MODULE_ROW = re.compile(r"^\| `([\w.]+\.(?:py|sh))` \| (.+) \|$", re.M)
# What a file reaches: a module it imports (anywhere in it), a file it names (`run.sh`).
IMPORTED = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.M)
NAMED_FILE = re.compile(r"(?<![\w.])(\w+\.(?:py|sh))(?!\w)")
# `train.py:531`, "line 531", "lines 40-60", a GitHub `#L531` anchor.
LINE_REFERENCE = re.compile(r"\b[\w./-]+\.(?:py|sh):\d+\b|\blines?\s+\d+|#L\d+\b", re.I)


def documents() -> list[Path]:
    return [
        README,
        REPO / "CONTRIBUTING.md",
        REPO / "EXERCISES.md",
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


def test_anchors_follow_githubs_rules():
    assert slug("Strategies, models and options") == "strategies-models-and-options"
    assert slug("`run.sh`, the job script") == "runsh-the-job-script"
    assert slug("Containers (CSCS Alps)") == "containers-cscs-alps"
    assert slug("A scaling sweep: `run_benchmarks.py`") == "a-scaling-sweep-run_benchmarkspy"
    assert slug("Why `x.shape[1:]` rather a shape?") == "why-xshape1-rather-a-shape"


def test_readme_is_a_short_door_that_opens_with_the_quickstart():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"
    counts = TEST_COUNT.findall(README.read_text())
    assert not counts, f"README.md names a test count: {counts}; it changes with every test"
    durations = DURATION.findall(README.read_text())
    assert not durations, f"README.md names a duration: {durations}; it goes in performance.md"
    head = "\n".join(README.read_text().splitlines()[:QUICKSTART_LINES])
    missing = [command for command in QUICKSTART if command not in head]
    assert not missing, f"not in README.md's first {QUICKSTART_LINES} lines: {missing}"


def test_readme_shows_the_small_sweep_that_plot_results_asks_for():
    """A fresh clone's ./plot_results.sh has no logs and names the sweep to run first: the one
    the README's path from the quickstart to a study runs (its lines joined)."""
    import collect_results

    text = README.read_text().replace("\\\n    ", "")
    assert collect_results.SMALL_LOCAL_SWEEP in text
    assert "From the quickstart to a study" in collect_results.HOW_TO_GET_LOGS
    assert "from-the-quickstart-to-a-study" in anchors(README)


def test_readme_shows_one_metric_line_in_the_format_and_one_figure_from_docs():
    text = README.read_text()
    metrics = [line for line in text.splitlines() if line.startswith("[METRIC]")]
    assert len(metrics) == 1, metrics
    assert list(parse_metric(metrics[0])) == list(METRIC_FIELDS)  # utils.py's fields, in order
    (figure,) = IMAGE.findall(text)
    assert figure.startswith("docs/") and figure.endswith(".png"), figure


def test_docs_name_code_rather_than_line_numbers():
    bad = [
        f"{doc.relative_to(REPO)}: {reference}"
        for doc in documents()
        for reference in LINE_REFERENCE.findall(doc.read_text())
    ]
    assert not bad, "refer to code by file and name: " + ", ".join(bad)


def copy_paste_problems(path: Path, root: Path = REPO) -> list[str]:
    """The commands of a document's code blocks that fail as written: sudo (a root container
    may have none: exit 127), and a bare python (perhaps one without the project's packages)
    unless the same block activated the .venv first; a reader may copy one block alone."""
    bad = []
    name = path.relative_to(root)
    for block in FENCE.finditer(path.read_text()):
        lines = [COMMENT.sub("", line) for line in block.group(0).splitlines()]
        for number, command in enumerate(lines):
            activated = any(ACTIVATE in line for line in lines[:number])
            if SUDO.search(command) or (BARE_PYTHON.search(command) and not activated):
                bad.append(f"{name}: {command.strip()}")
    return bad


def test_copy_paste_blocks_work_as_written():
    bad = [problem for doc in documents() for problem in copy_paste_problems(doc)]
    assert not bad, (
        'say "as root (prefix sudo if you are not root)", and run .venv/bin/python or '
        "source .venv/bin/activate first (CONTRIBUTING.md):\n" + "\n".join(bad)
    )


def test_the_checker_finds_commands_that_fail_as_written(tmp_path):
    (tmp_path / "a.md").write_text(
        "As root (prefix `sudo` if you are not root), `python main.py`:\n\n"
        "```bash\n"
        "sudo .ci/slurm/start.sh\n"
        ".ci/slurm/start.sh    # as root: prefix sudo if you are not\n"
        "make install && sudo make run\n"
        "python3 -m venv .venv\n"
        "python run_benchmarks.py --gpus 1\n"
        "LOGS=logs python3 collect_results.py\n"
        ".venv/bin/python main.py --check 1 2\n"
        "source .venv/bin/activate\n"
        "python main.py --check 1 2\n"
        "```\n\n"
        "```bash\n"
        "PYTHON=python ./plot_results.sh\n"
        "python main.py\n"
        "```\n"
    )
    assert [
        problem.split(": ", 1)[1] for problem in copy_paste_problems(tmp_path / "a.md", tmp_path)
    ] == [
        "sudo .ci/slurm/start.sh",
        "make install && sudo make run",
        "python run_benchmarks.py --gpus 1",
        "LOGS=logs python3 collect_results.py",
        "python main.py",
    ]


@pytest.mark.parametrize(
    "text, found",
    [
        ("see `train.py:531` (code: `x`)", ["train.py:531"]),
        ("in tests/test_cli.py:12 and run.sh:40", ["tests/test_cli.py:12", "run.sh:40"]),
        ("at line 531 of train.py, lines 40-60", ["line 531", "lines 40"]),
        ("[here](../train.py#L531)", ["#L531"]),
        ("`train.py`'s `Trainer.fit`, `train.py:Trainer.step`, 10 lines, 3 s", []),
    ],
)
def test_the_line_reference_checker(text, found):
    assert LINE_REFERENCE.findall(text) == found


def test_the_exit_statuses_are_utils():
    """docs/troubleshooting.md's table, the one every doc links to, lists each status main.py
    ends with (`utils.EXIT_STATUS`) and no other; run.sh's `stopped` is that status."""
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    table = text.split("## Exit statuses", 1)[1].split("\n## ", 1)[0]
    listed = [int(status) for status in re.findall(r"^\| (\d+) \|", table, re.M)]
    assert sorted(listed) == sorted(EXIT_STATUS.values())
    run_sh = (REPO / "run.sh").read_text()
    (block,) = re.findall(r"-eq \d+ \]; then +# main.py's own: .*?\n +fi", run_sh, re.S)
    statuses = re.findall(r"(?<!&)\b\d+\b", block)  # not >&2, the stream
    assert set(statuses) == {str(EXIT_STATUS["stopped"])}, block


def test_run_sh_logs_folder_is_layouts():
    """run.sh writes its torchrun logs and samples under layout.LOGS_DIR, named once."""
    (folder,) = re.findall(r"^LOGS=(\S+)", (REPO / "run.sh").read_text(), re.M)
    assert folder == layout.relative(layout.LOGS_DIR)


def test_the_metric_fields_units_are_utils():
    """docs/metrics.md's table names every `[METRIC]` field once, in the unit utils.METRIC gives
    it (a note in brackets may follow: `MB (2^20 B)`)."""
    text = (REPO / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| ([a-z_, ]+) \|([^|]*)\|", text, re.M)[1:]  # past the header
    documented = {
        name: unit.split(" (")[0].strip() for names, unit in rows for name in names.split(", ")
    }
    assert documented == {field.name: field.unit for field in METRIC}


def unrecorded_ranges(text: str, record: str) -> list[str]:
    """The ranges a page quotes that the record does not hold (lines joined: a range or its
    record may be wrapped)."""
    recorded = " ".join(record.split())
    return [r for r in QUOTED_RANGE.findall(" ".join(text.split())) if r not in recorded]


def test_ranges_quoted_from_measurements_are_those_the_records_hold():
    record = "\n".join(path.read_text() for path in RECORDS)
    found = {doc.name: unrecorded_ranges(doc.read_text(), record) for doc in documents()}
    assert not {name: ranges for name, ranges in found.items() if ranges}


def test_the_range_checker_finds_ranges_the_record_lacks():
    page = "DDP 3,007-3,185 and FSDP\n2,861-3,532 images/s; ports 32768-60999, 2026-11-22"
    assert unrecorded_ranges(page, "FSDP 2,861-3,532 and\nDDP 3,007-3,158") == ["3,007-3,185"]


def module_table(root: Path = REPO) -> dict[str, list[str]]:
    """tests/README.md's table: module -> the test files listed for it."""
    rows = MODULE_ROW.findall((root / "tests" / "README.md").read_text())
    return {module: re.findall(r"`(test_\w+\.py)`", tests) for module, tests in rows}


def names_in(path: Path, files: set[str]) -> set[str]:
    """The project's files that one file imports (anywhere in it) or names (`data.py`)."""
    text = path.read_text()
    imported = {f"{module}.py" for module in IMPORTED.findall(text)}
    return (imported | set(NAMED_FILE.findall(text))) & files


def reached(path: Path, graph: dict[str, set[str]]) -> set[str]:
    """What a test file imports, names or runs: its own names, then theirs, and so on."""
    seen, todo = set(), list(names_in(path, set(graph)))
    while todo:
        if (name := todo.pop()) not in seen:
            seen.add(name)
            todo += graph[name]
    return seen


def module_table_problems(root: Path = REPO) -> list[str]:
    """What is wrong with tests/README.md's table of the tests of each module."""
    tests, table = root / "tests", module_table(root)
    modules = {p.name for p in root.glob("*.py")}
    # The tests' helpers are nodes too: a test that runs main.py through conftest runs it.
    where = {p.name: p for p in tests.glob("*.py") if not p.name.startswith("test_")}
    where |= {name: root / name for name in modules | set(table) if (root / name).is_file()}
    graph = {f: names_in(path, set(where) - {f}) for f, path in where.items()}
    bad = [
        f"tests/README.md: {m} has no row in its table of the tests of each module"
        for m in sorted(modules - set(table))
    ]
    for module, test_files in table.items():
        if module not in where:
            bad.append(f"tests/README.md: {module}: no such module")
        for test in test_files if module in where else []:
            if not (tests / test).is_file():
                bad.append(f"tests/README.md: {module}: {test}: no such test file")
            elif module not in reached(tests / test, graph):
                bad.append(f"tests/README.md: {module}: {test} neither imports, names nor runs it")
    return bad


def test_every_module_has_its_tests_in_tests_readme():
    bad = module_table_problems()
    assert not bad, "\n".join(bad)


def test_the_module_table_checker_finds_what_is_wrong(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "main.py").write_text("def main():\n    import lib\n")
    (tmp_path / "lib.py").write_text("X = 1\n")
    (tmp_path / "new.py").write_text("Y = 2\n")
    (tmp_path / "tests" / "conftest.py").write_text("MAIN = 'main.py'\n")
    (tmp_path / "tests" / "test_lib.py").write_text("from conftest import MAIN\n")
    (tmp_path / "tests" / "test_other.py").write_text("import os\n")
    (tmp_path / "tests" / "README.md").write_text(
        "| module | tests |\n| --- | --- |\n"
        "| `main.py` | `test_lib.py` |\n"
        "| `lib.py` | `test_lib.py`, `test_other.py`, `test_gone.py` |\n"
        "| `old.py` | `test_lib.py` |\n"
    )
    assert module_table_problems(tmp_path) == [
        "tests/README.md: new.py has no row in its table of the tests of each module",
        "tests/README.md: lib.py: test_other.py neither imports, names nor runs it",
        "tests/README.md: lib.py: test_gone.py: no such test file",
        "tests/README.md: old.py: no such module",
    ]

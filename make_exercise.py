"""The student's copy of the repository (`make exercise DIR=path`): the solution with the parts
a student completes cut out, each replaced by a stub that names its exercise on the sheet.

The sheet, EXERCISES.md, owns the exercises: a heading `### 2.1 Complete the set-up` gives an
exercise its number, title and anchor; those whose title starts with "Complete" have code to
write. The code owns where that code is, between comment lines (several regions an exercise):

    # exercise 2.1 begin
    ...the lines a student writes...
    # exercise 2.1 end

The copy keeps the marks and puts `raise NotImplementedError("exercise 2.1: ...; see
EXERCISES.md#21-...")` in each region's place: every module still imports, and the stub says
where to read. Code not the student's to write that would show an answer (FSDP2's twin of the
FSDP wrapper) is marked `# exercise 4.2 twin begin` ... `end` and cut with a stub that says
why. Left out: the solution's own tests and, unless `--key` (`make exercise KEY=1`), the
instructors' key, docs/concepts.md. tests/exercise_checks.py grades a completed part: `make check
EX=2.1` (docs/exercise.md).
"""

import argparse
import fnmatch
import io
import re
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

from layout import REPO

SHEET = "EXERCISES.md"
DEFAULT_DIR = REPO / "exercise"  # git-ignored
# Written into every copy: the only folder besides an empty one that a build may replace.
STAMP = ".student-copy"
# Not in the copy (fnmatch patterns): the solution's own tests, which test its code, name the
# answers and fail on the stubs (the student's are tests/exercise_checks.py), and a GPU run's
# log that quotes the DDP wrapper's line.
LEFT_OUT = ("tests/test_*.py", "docs/gpu-runs/2026-11-23-h100/5_ddp_bucket_views_and_sync_bn.log")
# The instructors' key: the answers to the sheet's questions, in the copy only if asked for
# (--key); else a note in its place, so that the links to it still lead somewhere.
KEY = "docs/concepts.md"
KEY_NOTE = (
    "# The course's questions, answered\n\n"
    "The instructors' key: left out of the student's copy (`make exercise KEY=1` keeps it).\n"
)
COMPLETE = "Complete"  # how the sheet's title of an exercise with code to write begins

MARK = re.compile(r"^# exercise (?P<number>\d+\.\d+)(?P<twin> twin)? (?P<side>begin|end)$")
HEADING = re.compile(r"^#{2,4} (?P<number>\d+\.\d+) (?P<title>.+)$", re.M)


class ExerciseError(Exception):
    """A mark or the sheet is not as this tool needs it: one line saying where."""


@dataclass(frozen=True)
class Region:
    path: str  # relative to the repository
    number: str
    begin: int  # the index of the begin mark's line
    end: int  # the index of the end mark's line
    indent: str
    twin: bool = False  # code that shows the exercise's answer, not the student's to write


def sheet_exercises(repo: Path = REPO) -> dict[str, str]:
    """The sheet's exercises: number -> title, in the sheet's order."""
    return {m["number"]: m["title"].strip() for m in HEADING.finditer((repo / SHEET).read_text())}


def to_complete(exercises: dict[str, str]) -> set[str]:
    return {number for number, title in exercises.items() if title.startswith(COMPLETE)}


def anchor(number: str, title: str) -> str:
    """GitHub's anchor of the sheet's heading `number title`."""
    text = re.sub(r"[^\w\- ]", "", f"{number} {title}".lower())
    return text.replace(" ", "-")


def stub(number: str, title: str, indent: str, twin: bool = False) -> str:
    """What takes a region's place: a NotImplementedError naming the exercise and the sheet."""
    where = f"{SHEET}#{anchor(number, title)}"
    message = (
        f"cut from the student's copy: it would show exercise {number}'s answer ({where})"
        if twin
        else f"exercise {number}: {title}; see {where}"
    )
    return f'{indent}raise NotImplementedError(\n{indent}    "{message}"\n{indent})\n'


def regions_of(path: str, text: str) -> list[Region]:
    """The marked regions of one file, its marks read as comments (not text that looks like one
    in a string: this module's docstring); an unmatched or nested mark is an ExerciseError."""
    found, open_mark = [], None
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type != tokenize.COMMENT or not (mark := MARK.match(token.string)):
            continue
        index, indent = token.start[0] - 1, token.line[: token.start[1]]
        number, where = mark["number"] + (mark["twin"] or ""), f"{path}:{index + 1}"
        if indent.strip():
            raise ExerciseError(f"{where}: a mark must be a line of its own")
        if mark["side"] == "begin":
            if open_mark:
                raise ExerciseError(f"{where}: exercise {open_mark[0]}'s region is still open")
            open_mark = (number, index, indent)
            continue
        if not open_mark or open_mark[0] != number:
            raise ExerciseError(f"{where}: an end of exercise {number} without a begin")
        _, begin, begin_indent = open_mark
        if index == begin + 1:
            raise ExerciseError(f"{where}: exercise {number}'s region is empty")
        found.append(Region(path, mark["number"], begin, index, begin_indent, bool(mark["twin"])))
        open_mark = None
    if open_mark:
        raise ExerciseError(f"{path}:{open_mark[1] + 1}: exercise {open_mark[0]} never ends")
    return found


def repository_files(repo: Path = REPO, outside: Path | None = None) -> list[str]:
    """The repository's files as git knows them (tracked, and new ones it does not ignore)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    files = sorted({name for name in listed if name and (repo / name).is_file()})
    if outside is not None and outside.resolve().is_relative_to(repo.resolve()):
        inner = outside.resolve().relative_to(repo.resolve()).as_posix() + "/"
        files = [name for name in files if not name.startswith(inner)]
    return files


def all_regions(repo: Path = REPO) -> list[Region]:
    """Every marked region of the repository's Python files."""
    return [
        region
        for name in repository_files(repo)
        if name.endswith(".py")
        for region in regions_of(name, (repo / name).read_text())
    ]


def cut(text: str, regions: list[Region], exercises: dict[str, str]) -> str:
    """The text with each region's lines replaced by its exercise's stub (marks kept)."""
    lines = text.splitlines(keepends=True)
    for region in sorted(regions, key=lambda r: r.begin, reverse=True):
        lines[region.begin + 1 : region.end] = [
            stub(region.number, exercises[region.number], region.indent, region.twin)
        ]
    return "".join(lines)


def check_marks(regions: list[Region], exercises: dict[str, str]) -> None:
    """Every region belongs to an exercise with code to write, and every such one has one."""
    complete = to_complete(exercises)
    for region in regions:
        if region.number not in complete:
            raise ExerciseError(
                f"{region.path}:{region.begin + 1}: exercise {region.number} is not an "
                f"exercise of {SHEET} whose title begins with {COMPLETE!r}"
            )
    missing = sorted(complete - {r.number for r in regions if not r.twin})
    if missing:
        raise ExerciseError(f"{SHEET}'s exercise {', '.join(missing)} has no marked region")


def prepare(dest: Path, repo: Path) -> None:
    """An empty dest: a new folder, an empty one, or a copy made before (replaced)."""
    dest, repo = dest.resolve(), repo.resolve()
    if dest == repo or repo.is_relative_to(dest):
        raise ExerciseError(f"{dest} holds the repository itself: give another DIR")
    if dest.exists() and any(dest.iterdir()):
        if not (dest / STAMP).is_file():
            raise ExerciseError(f"{dest} is not empty and not a student's copy: give another DIR")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)


def left_out(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in LEFT_OUT)


def build(
    dest: Path, repo: Path = REPO, keep: frozenset[str] = frozenset(), key: bool = False
) -> list[Region]:
    """Write the student's copy into dest, with the instructors' key if `key`. The exercises in
    `keep` keep their solution (for the tests of the cut); their twins are cut all the same, as
    in a copy the student has completed. Returns the regions cut."""
    exercises = sheet_exercises(repo)
    regions = all_regions(repo)
    check_marks(regions, exercises)
    prepare(dest, repo)
    cut_here = [region for region in regions if region.twin or region.number not in keep]
    for name in repository_files(repo, outside=dest):
        if left_out(name):
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        mine = [region for region in cut_here if region.path == name]
        if name == KEY and not key:
            target.write_text(KEY_NOTE)
        elif mine:
            target.write_text(cut((repo / name).read_text(), mine, exercises))
            shutil.copymode(repo / name, target)
        else:
            shutil.copy2(repo / name, target)
    (dest / STAMP).write_text("a student's copy, made by make exercise (make_exercise.py)\n")
    return cut_here


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "dir", nargs="?", default=DEFAULT_DIR, type=Path, help="where (default: exercise/)"
    )
    parser.add_argument(
        "--key", action="store_true", help=f"keep the instructors' key, {KEY} (else left out)"
    )
    args = parser.parse_args(argv)
    try:
        regions = build(args.dir, key=args.key)
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    own = [region for region in regions if not region.twin]
    numbers = sorted({region.number for region in own})
    key = "kept (--key)" if args.key else "left out (KEY=1 keeps it)"
    print(
        f"student's copy in {args.dir}: {len(own)} regions cut for exercises "
        f"{', '.join(numbers)}, and {len(regions) - len(own)} twins that would show their "
        f"answers; the sheet is {SHEET}, make check EX=N.M grades one; the instructors' key, "
        f"{KEY}, {key}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

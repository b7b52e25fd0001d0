"""The student's copy (make_exercise.py, `make exercise`) and its checks (`make check EX=N.M`,
tests/exercise_checks.py): the marks and the sheet agree, the marks are comments, the copy is
the solution with the regions and their twins cut, the same at every build, without the
solution's tests, and with the instructors' key only when asked; each exercise's check fails on
the stub and passes once that exercise alone is restored."""

import ast
import filecmp
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import make_exercise as mx
from conftest import REPO, run

CHECK_TIMEOUT_S = 300
# The course's parts to complete (its sheet's numbering): the sheet must keep every one.
COURSE = {"2.1", "3.1", "4.1", "4.2", "5.1", "6.1"}


def check_tests() -> dict[str, list[str]]:
    """The tests of tests/exercise_checks.py by exercise, from their names (test_ex2_1_...)."""
    tree = ast.parse((REPO / "tests" / "exercise_checks.py").read_text())
    found: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and (m := re.match(r"test_ex(\d+)_(\d+)_", node.name)):
            found.setdefault(f"{m[1]}.{m[2]}", []).append(node.name)
    return found


def make_check(copy: Path, exercise: str | None = None):
    """`make check [EX=N.M]` in copy, with this Python (the copy has no .venv of its own)."""
    command = ["make", "-s", "-C", copy, "-o", ".venv/.installed", "check", f"PY={sys.executable}"]
    return run([*command, *([f"EX={exercise}"] if exercise else [])], timeout=CHECK_TIMEOUT_S)


def failures(output: str) -> dict[str, list[str]]:
    """The one-line failures of make check, by exercise."""
    found: dict[str, list[str]] = {}
    for m in re.finditer(r"^FAILED exercise (\d+\.\d+): (.*)$", output, re.M):
        found.setdefault(m[1], []).append(m[2])
    return found


def passed(output: str) -> int:
    m = re.search(r"(\d+) passed", output)
    return int(m[1]) if m else 0


# ----------------------------------------------------------------------------- marks and sheet


def test_every_region_is_a_sheet_exercise_to_complete_and_each_has_a_region_and_checks():
    exercises, regions = mx.sheet_exercises(), mx.all_regions()
    mx.check_marks(regions, exercises)
    assert {r.number for r in regions} == mx.to_complete(exercises) == COURSE
    assert set(check_tests()) == COURSE, check_tests()


@pytest.mark.parametrize(
    "text, error",
    [
        ("# exercise 2.1 begin\nx = 1\n", "exercise 2.1 never ends"),
        ("x = 1\n# exercise 2.1 end\n", "an end of exercise 2.1 without a begin"),
        ("# exercise 2.1 begin\n# exercise 2.1 end\n", "region is empty"),
        ("# exercise 2.1 begin\n# exercise 3.1 begin\n", "2.1's region is still open"),
        ("x = 1  # exercise 2.1 begin\n", "a mark must be a line of its own"),
        ("# exercise 2.1 begin\nx = 1\n# exercise 2.1 twin end\n", "2.1 twin without a begin"),
    ],
)
def test_a_bad_mark_is_named_with_its_line(text, error):
    with pytest.raises(mx.ExerciseError, match=error):
        mx.regions_of("f.py", text)


def test_a_region_off_the_sheet_or_a_part_without_one_is_refused():
    exercises = {"2.1": "Complete the set-up", "2.2": "Run it"}
    with pytest.raises(mx.ExerciseError, match="f.py:1: exercise 2.2 is not an exercise"):
        mx.check_marks([mx.Region("f.py", "2.2", 0, 2, "")], exercises)
    with pytest.raises(mx.ExerciseError, match="exercise 2.1 has no marked region"):
        mx.check_marks([], exercises)
    with pytest.raises(mx.ExerciseError, match="exercise 2.1 has no marked region"):  # a twin's
        mx.check_marks([mx.Region("f.py", "2.1", 0, 2, "", twin=True)], exercises)


def test_the_stubs_point_at_the_sheets_headings():
    """The anchor of each stub is one of the sheet's headings, as GitHub makes them."""
    sheet = (REPO / mx.SHEET).read_text()
    headings = re.findall(r"^#{2,4} (.+)$", sheet, re.M)
    github = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    for number, title in mx.sheet_exercises().items():
        assert mx.anchor(number, title) in github
    assert mx.anchor("2.1", "Complete the set-up") == "21-complete-the-set-up"


def test_only_comments_are_marks():
    """Text that reads as a mark in a string (a docstring's example) cuts nothing."""
    text = 'def f():\n    """\n    # exercise 2.1 begin\n    x\n    # exercise 2.1 end\n    """\n'
    assert mx.regions_of("f.py", text) == []
    text = "def f():\n    # exercise 2.1 begin\n    x = 1\n    # exercise 2.1 end\n"
    assert mx.regions_of("f.py", text) == [mx.Region("f.py", "2.1", 1, 3, "    ")]
    twin = text.replace(" begin", " twin begin").replace(" end", " twin end")
    assert mx.regions_of("f.py", twin) == [mx.Region("f.py", "2.1", 1, 3, "    ", twin=True)]


# ----------------------------------------------------------------------------- the copy


def test_the_copy_is_the_solution_with_the_regions_cut_and_the_same_every_time(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    regions = mx.build(first)
    cut = {r.path for r in regions}
    assert {r.path for r in regions if r.twin}, "no twin cut"
    for name in mx.repository_files():
        copied = first / name
        if mx.left_out(name):
            assert not copied.exists(), name
        elif name == mx.KEY:
            assert copied.read_text() == mx.KEY_NOTE
        elif name not in cut:
            assert filecmp.cmp(REPO / name, copied, shallow=False), name
    assert (first / mx.SHEET).is_file()
    # The student's checks and what they import stay; the solution's own tests go.
    assert (first / "tests" / "exercise_checks.py").is_file()
    assert not list((first / "tests").glob("test_*.py"))
    for path in cut:
        text = (first / path).read_text()
        compile(text, path, "exec")  # every module still imports
        mine = [r for r in regions if r.path == path]
        assert mx.regions_of(path, text) and len(mx.regions_of(path, text)) == len(mine)
        for region in mx.regions_of(path, text):
            lines = text.splitlines()[region.begin + 1 : region.end]
            assert lines[0].strip() == "raise NotImplementedError(", (path, lines)
            says = "cut from the student's copy" if region.twin else f"exercise {region.number}: "
            assert says in lines[1] and mx.SHEET in lines[1], (path, lines)
    mx.build(second)
    (first / "stray").write_text("")
    mx.build(first)  # over the copy made before: replaced
    compared = filecmp.dircmp(first, second)
    assert not compared.left_only and not compared.right_only and not compared.diff_files
    names = [p.relative_to(first) for p in sorted(first.rglob("*"))]
    assert names == [p.relative_to(second) for p in sorted(second.rglob("*"))]
    assert all(
        filecmp.cmp(first / n, second / n, shallow=False) for n in names if (first / n).is_file()
    )


def test_the_key_is_in_the_copy_only_when_asked_for(tmp_path):
    for key, says in ((False, "left out (KEY=1 keeps it)"), (True, "kept")):
        folder = tmp_path / f"key-{key}"
        done = run(
            ["make", "-s", "exercise", f"DIR={folder}", f"PYTHON={sys.executable}"]
            + (["KEY=1"] if key else [])
        )
        assert done.returncode == 0, done.stderr
        assert f"the instructors' key, {mx.KEY}, {says}" in done.stdout, done.stdout
        copied = (folder / mx.KEY).read_text()
        assert (copied == (REPO / mx.KEY).read_text()) == key
        assert (copied == mx.KEY_NOTE) != key


def test_make_exercise_refuses_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    done = run([sys.executable, "make_exercise.py", tmp_path])
    assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr
    assert "not a student's copy" in done.stderr and len(done.stderr.splitlines()) == 1
    assert (tmp_path / "notes.txt").read_text() == "mine"
    done = run([sys.executable, "make_exercise.py", REPO])
    assert done.returncode == 2 and "holds the repository itself" in done.stderr


# ----------------------------------------------------------------------------- the checks


@pytest.mark.slow
def test_each_check_fails_on_its_stub_and_passes_with_its_region_alone_restored(tmp_path):
    stubbed = tmp_path / "stubbed"
    mx.build(stubbed)
    done = make_check(stubbed)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and passed(output) == 0, output[-3000:]
    failed = failures(output)
    assert set(failed) == COURSE, output[-3000:]
    for exercise, lines in failed.items():
        assert all(f"NotImplementedError: exercise {exercise}: " in line for line in lines), lines

    def restored(exercise: str):
        copy = tmp_path / f"restored-{exercise}"
        mx.build(copy, keep=frozenset({exercise}))
        return make_check(copy, exercise)

    # Two at a time: each run spends much of its time starting interpreters and ranks.
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(sorted(COURSE), pool.map(restored, sorted(COURSE))))
    for exercise, done in runs.items():
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"exercise {exercise} restored: {output[-3000:]}"
        assert passed(output) == len(failed[exercise]), (exercise, output[-3000:])

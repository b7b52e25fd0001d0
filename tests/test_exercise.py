"""The student's copy (make_exercise.py, `make exercise`) and its checks (`make check EX=N.M`,
tests/exercise_checks.py): the marks and the sheet agree, the marks are comments, the copy is
the solution with the regions and their twins cut, the same at every build, and holds no
answer outside the cut nor the instructors' key unless asked; each exercise's check fails on
the stub and passes once that exercise alone is restored; and mistakes a student makes,
planted in a solved copy, each fail their check with a line that says what is wrong without
the answer, while correct alternatives pass."""

import ast
import filecmp
import itertools
import os
import re
import shlex
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import make_exercise as mx
from conftest import REPO, clean_environment, run
from dist_harness import in_fresh_process

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


def make_check_command(copy: Path, *settings: str) -> list[str]:
    """`make check` in copy with this Python (the copy has no .venv of its own) and make's
    `settings` (EX=2.1, PYTEST_ARGS=...)."""
    command = ["make", "-s", "--no-print-directory", "-C", copy, "-o", ".venv/.installed", "check"]
    return [*command, f"PY={sys.executable}", *settings]


def checks_here(copy: Path, arguments: list[str]) -> tuple[int, str]:
    """What pytest with `make check`'s arguments prints in copy, run in this process: a fresh one
    forked from dist_harness's server (torch imported), where the repository's modules make way
    for the copy's (as make check's PYTHONPATH=.:tests puts them first). The checks' ranks fork
    from here: a server of the copy's own would import torch again, seconds a run."""
    ours = {REPO, REPO / "tests"}
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").resolve().parent in ours:
            del sys.modules[name]
    sys.path[:] = [str(copy), str(copy / "tests")] + [
        p for p in sys.path if Path(p).resolve() not in ours
    ]
    os.environ.clear()
    os.environ.update(clean_environment())
    os.chdir(copy)
    with open(copy / "check-output.txt", "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    import dist_harness  # the copy's

    dist_harness.START_METHOD = "fork"
    status = pytest.main(arguments)
    sys.stdout.flush()
    sys.stderr.flush()
    return int(status), (copy / "check-output.txt").read_text()


def check_in_process(copy: Path, setting: str) -> tuple[int, str]:
    """`make check setting`'s exit status and output in copy, its pytest run in a process forked
    from this one's server rather than by make (the Makefile's arguments, as make -n prints
    them)."""
    printed = run(["make", "-n", *make_check_command(copy, setting)[1:]]).stdout
    words = shlex.split(printed.replace("\\\n", " "))
    arguments = words[words.index("pytest") + 1 :]
    return in_fresh_process(checks_here, copy, arguments, timeout=CHECK_TIMEOUT_S)


def two_at_a_time(job, items: list) -> list:
    """job(item) for each item, two at a time: each spends much of its time starting ranks."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(job, items))


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


@pytest.fixture(scope="module")
def regions() -> list[mx.Region]:
    """The repository's marked regions, read once (seconds: every Python file tokenized)."""
    return mx.all_regions()


def test_every_region_is_a_sheet_exercise_to_complete_and_each_has_a_region_and_checks(regions):
    exercises = mx.sheet_exercises()
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


@pytest.fixture(scope="module")
def stubbed(tmp_path_factory) -> tuple[Path, list[mx.Region]]:
    """The student's copy, built once for the tests that read it, and the regions it cut."""
    folder = tmp_path_factory.mktemp("stubbed")
    return folder, mx.build(folder)


def test_the_copy_is_the_solution_with_the_regions_cut_and_the_same_every_time(stubbed, tmp_path):
    first, regions = stubbed
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
    second = tmp_path / "second"
    mx.build(second)
    (second / "stray").write_text("")
    mx.build(second)  # over the copy made before: replaced
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


# ----------------------------------------------------------------------------- no answers

# The calls that answer each exercise, as its regions or their twins write them: the student's
# copy holds none outside the cut, the sheet aside (it names what to use). A definition answers
# nothing: `def cleanup(failed: bool = False)` is not `cleanup(failed`.
ANSWERS = {
    "2.1": ("init_process_group(", "set_device(", "turn_on_flight_recorder(", "pick_device(local"),
    "3.1": ("on_rank0(prepare", "set_epoch(", "ShardSampler("),
    "4.1": ("DDP(",),
    "4.2": (
        "FSDP(",
        "MixedPrecision(",
        "MixedPrecisionPolicy(",
        "CPUOffload(",
        "CPUOffloadPolicy(",
        "CustomPolicy(",
        "reduce_dtype=torch.float32",
        "hybrid_mesh(device, ranks_per_node)",
    ),
    "5.1": (
        "distributed_utils.setup(cfg",
        "cleanup(failed",
        "= get_ddp_model(",
        "= get_fsdp_model(",
    ),
    "6.1": ("zero_grad(", "scaler.scale(", "scaler.step(", "scaler.update(", ".train()", ".eval()"),
}


def answer(call: str) -> re.Pattern:
    """The call where it is made, not where it is defined (and DDP( is not StandInDDP()."""
    word = r"\b" if re.match(r"\w", call) else ""
    return re.compile(rf"(?<!def )(?<!class ){word}{re.escape(call)}")


def region_text(region: mx.Region, repo: Path = REPO) -> str:
    return "\n".join((repo / region.path).read_text().splitlines()[region.begin + 1 : region.end])


def test_each_answer_is_its_exercises_code(regions):
    """Each call of ANSWERS is written in its exercise's regions or their twins: the list names
    the answers, not words that happen to be near them."""
    assert set(ANSWERS) == COURSE
    for exercise, calls in ANSWERS.items():
        code = "\n".join(region_text(r) for r in regions if r.number == exercise)
        assert [c for c in calls if not answer(c).search(code)] == [], exercise


def answers_in(text: str, exercise: str | None = None) -> list[str]:
    """The calls of ANSWERS (of `exercise`, or of all) that text makes."""
    chosen = [exercise] if exercise else ANSWERS
    return [call for e in chosen for call in ANSWERS[e] if answer(call).search(text)]


def test_the_copy_holds_no_answer_outside_the_cut(stubbed):
    copy, _ = stubbed
    found = []
    for path in sorted(copy.rglob("*")):
        name = path.relative_to(copy).as_posix()
        if not path.is_file() or name == mx.SHEET:
            continue
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError:  # an image, a compressed trace
            continue
        found += [f"{name}:{i}: {c}" for i, line in enumerate(lines, 1) for c in answers_in(line)]
    assert found == []


# ----------------------------------------------------------------------------- the checks


@pytest.mark.slow
def test_each_check_fails_on_its_stub_and_passes_with_its_region_alone_restored(stubbed, tmp_path):
    """The stubbed copy through make check itself, as a student runs it (writing no byte code
    there: the tests that read the copy share it); the restored copies through check_in_process,
    beside it."""

    def checked(exercise: str | None) -> tuple[int, str]:
        if exercise is None:
            command = make_check_command(stubbed[0])
            done = run(command, timeout=CHECK_TIMEOUT_S, PYTHONDONTWRITEBYTECODE="1")
            return done.returncode, done.stdout + done.stderr
        copy = tmp_path / f"restored-{exercise}"
        mx.build(copy, keep=frozenset({exercise}))
        return check_in_process(copy, f"EX={exercise}")

    (status, output), *restored = two_at_a_time(checked, [None, *sorted(COURSE)])
    assert status != 0 and passed(output) == 0, output[-3000:]
    failed = failures(output)
    assert set(failed) == COURSE, output[-3000:]
    for exercise, lines in failed.items():
        assert all(f"NotImplementedError: exercise {exercise}: " in line for line in lines), lines
    for exercise, (status, output) in zip(sorted(COURSE), restored):
        assert status == 0, f"exercise {exercise} restored: {output[-3000:]}"
        assert passed(output) == len(failed[exercise]), (exercise, output[-3000:])


# ----------------------------------------------------------------------------- planted mistakes


@dataclass(eq=False)  # each plant its own: a key of the grades
class Plant:
    """An exercise's code as a student might write it, in the solution's file `path`. A mistake
    when `fails` names the check that must fail, with a line that holds `says`; else a correct
    alternative, which every check of the exercise passes. Its hunks are a unified diff's
    without line numbers: " " and "-" lines, whole and consecutive, found once in the solution,
    become the " " and "+" lines."""

    exercise: str
    path: str
    fails: str | None
    name: str
    says: str = ""
    hunks: list[list[str]] = field(default_factory=lambda: [[]])

    def places(self, lines: list[str]) -> list[tuple[int, int, list[str]]]:
        """Where each hunk goes in the solution's lines: (first, end, the lines in their place)."""
        found = []
        for hunk in self.hunks:
            old = [line[1:] for line in hunk if line[0] in " -"]
            starts = [i for i in range(len(lines)) if lines[i : i + len(old)] == old]
            assert len(starts) == 1, (self.name, old, starts)
            new = [line[1:] for line in hunk if line[0] in " +"]
            found.append((starts[0], starts[0] + len(old), new))
        return found

    def planted(self, text: str) -> str:
        lines = text.splitlines()
        for first, end, new in sorted(self.places(lines), reverse=True):
            lines[first:end] = new
        return "\n".join(lines) + "\n"


def parse_plants(table: str) -> list[Plant]:
    """PLANTS' plants: "== exercise file fails check" (or "passes") heads the plants that
    follow, each "name: says" (an alternative's: its name), then its hunks, "@@" between two."""
    plants = []
    for line in table.strip().splitlines():
        if line.startswith("== "):
            exercise, path, verdict = line[3:].split(" ", 2)
            fails = None if verdict == "passes" else verdict.removeprefix("fails ")
        elif line == "@@":
            plants[-1].hunks.append([])
        elif line[0] in " -+":
            plants[-1].hunks[-1].append(line)
        else:
            name, _, says = line.partition(": ") if fails else (line, "", "")
            plants.append(Plant(exercise, path, fails, name, says))
    return plants


PLANTS = parse_plants("""
== 2.1 distributed_utils.py fails test_ex2_1_a_rank_on_a_node_of_gpus
the GPU chosen by the rank: makes cuda:0 its own
-    device, backend = pick_device(local_rank, wanted=device)
+    device, backend = pick_device(rank, wanted=device)
the rank and the local rank swapped: makes cuda:0 its own
-    rank, local_rank, world_size = read_ranks()
+    local_rank, rank, world_size = read_ranks()
torchrun's variables read by hand: KeyError: 'RANK'
-    rank, local_rank, world_size = read_ranks()
+    rank, local_rank, world_size = map(
+        int, (os.environ[v] for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
+    )
no set_device: does not make its GPU this process's own
-        torch.cuda.set_device(device)
no flight recorder: flight recorder
-        turn_on_flight_recorder()
the backend of one device: the backend 'nccl'
-        groups_backend,
+        backend,
rank=local_rank: joins the group as rank 1 of 4
-        rank=rank,
+        rank=local_rank,
no store: no store
-        store=group_store,
the store before its prefix: another store
-        store=group_store,
+        store=store,
no timeout: the timeout None
-        timeout=timeout,
the timeout in seconds: the timeout 37,
-        timeout=timeout,
+        timeout=timeout_s,
no device_id: its device is None
-        device_id=device if device.type == "cuda" else None,
device_id=local_rank: its device is cuda:1, not cuda:0
-        device_id=device if device.type == "cuda" else None,
+        device_id=local_rank,
== 2.1 distributed_utils.py fails test_ex2_1_the_device_asked_for
the device asked for ignored: takes cuda:0
-    device, backend = pick_device(local_rank, wanted=device)
+    device, backend = pick_device(local_rank)
== 2.1 distributed_utils.py fails test_ex2_1_each_rank_joins_as_the_launcher_says
set_device on the CPU too: Expected a cuda device
-    if device.type == "cuda":
-        torch.cuda.set_device(device)
+    torch.cuda.set_device(device)
+    if device.type == "cuda":
device_id on the CPU too: device_id
-        device_id=device if device.type == "cuda" else None,
+        device_id=device,
== 2.1 distributed_utils.py fails test_ex2_1_alone_a_world_of_one
no group for a world of one: no process group of one
-    dist.init_process_group(
+    if world_size > 1:
+        dist.init_process_group(
== 2.1 distributed_utils.py passes
the group's arguments by keyword, device_id only on a GPU, set_device by index
-        torch.cuda.set_device(device)
+        torch.cuda.set_device(device.index)
@@
+    on_gpu = {"device_id": device} if device.type == "cuda" else {}
     dist.init_process_group(
-        groups_backend,
-        store=group_store,
-        rank=rank,
-        world_size=world_size,
-        timeout=timeout,
-        device_id=device if device.type == "cuda" else None,
+        backend=groups_backend,
+        init_method=None,
+        timeout=timeout,
+        world_size=world_size,
+        rank=rank,
+        store=group_store,
+        **on_gpu,
== 3.1 data.py fails test_ex3_1_rank_0_alone_downloads_and_the_others_wait
every rank downloads: downloaded_by_rank_0, downloaded_by_rank_1 downloaded
-    cache = on_rank0(prepare, dataset, data_dir, download, fetch_hint)
+    cache = prepare(dataset, data_dir, download, fetch_hint)
the others do not wait: do not wait for rank 0
-    cache = on_rank0(prepare, dataset, data_dir, download, fetch_hint)
+    from dataset_files import cache_path
+    from utils import is_rank_zero
+
+    cache = (
+        prepare(dataset, data_dir, download, fetch_hint)
+        if is_rank_zero()
+        else str(cache_path(dataset, data_dir))
+    )
== 3.1 data.py fails test_ex3_1_a_new_order_every_epoch
no shuffle: come in order
-    train_sampler = ShardSampler(len(train), world_size, rank, shuffle=True, seed=seed)
+    train_sampler = ShardSampler(len(train), world_size, rank, shuffle=False, seed=seed)
no seed: --seed 1
-    train_sampler = ShardSampler(len(train), world_size, rank, shuffle=True, seed=seed)
+    train_sampler = ShardSampler(len(train), world_size, rank, shuffle=True)
no set_epoch: same order
-        self.train_sampler.set_epoch(epoch)
+        pass
set_epoch of the step: same order
-        self.train_sampler.set_epoch(epoch)
+        self.train_sampler.set_epoch(step)
== 3.1 data.py fails test_ex3_1_every_image_once_per_epoch_over_the_ranks
a seed of each rank's: overlapping
-    train_sampler = ShardSampler(len(train), world_size, rank, shuffle=True, seed=seed)
+    train_sampler = ShardSampler(len(train), world_size, rank, shuffle=True, seed=seed + rank)
the world size and the rank swapped: Invalid rank
-    train_sampler = ShardSampler(len(train), world_size, rank, shuffle=True, seed=seed)
+    train_sampler = ShardSampler(len(train), rank, world_size, shuffle=True, seed=seed)
the validation set whole on every rank: validation shards
-    val_sampler = ShardSampler(len(val), world_size, rank, shuffle=False)
+    val_sampler = ShardSampler(len(val), 1, 0, shuffle=False)
== 3.1 data.py passes
a barrier instead of on_rank0
-    cache = on_rank0(prepare, dataset, data_dir, download, fetch_hint)
+    from distributed_utils import barrier
+    from utils import is_rank_zero
+
+    if is_rank_zero():
+        prepare(dataset, data_dir, download, fetch_hint)
+    barrier()
+    cache = prepare(dataset, data_dir, download, fetch_hint)
a shuffled validation, samplers by keyword
-    val_sampler = ShardSampler(len(val), world_size, rank, shuffle=False)
+    val_sampler = ShardSampler(len(val), rank=rank, world_size=world_size, shuffle=True)
== 4.1 ddp_utils.py fails test_ex4_1_ddp_on_a_gpu
the model left on the CPU: parameters are on the CPU
-    model = model.to(device)
     # On a GPU, name it: DDP then places inputs and its buckets there. On CPU, device_ids=None.
the model moved after wrapping: after DDP wrapped it
-    model = model.to(device)
     # On a GPU, name it: DDP then places inputs and its buckets there. On CPU, device_ids=None.
@@
-    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
+    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True).to(device)
device_ids=[0]: the model is on cuda:0
-    device_ids = [device.index] if device.type == "cuda" else None
+    device_ids = [0] if device.type == "cuda" else None
the model returned unwrapped: returns a BoundForAGpu
-    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
+    DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
+    return model
output_device=0: outputs on cuda:0
-    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
+    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True, output_device=0)
== 4.1 ddp_utils.py fails test_ex4_1_ddp_replicates_and_averages_gradients
device_ids on the CPU too: device_ids
-    device_ids = [device.index] if device.type == "cuda" else None
+    device_ids = [device.index]
== 4.1 ddp_utils.py passes
moved in place, the device itself in device_ids
-    model = model.to(device)
+    model.to(device)
     # On a GPU, name it: DDP then places inputs and its buckets there. On CPU, device_ids=None.
@@
-    device_ids = [device.index] if device.type == "cuda" else None
+    device_ids = [device] if device.type == "cuda" else None
no device_ids on a GPU
-    device_ids = [device.index] if device.type == "cuda" else None
+    device_ids = None
== 4.2 fsdp_utils.py fails test_ex4_2_fsdp_units_sharding_and_precision
no wrap policy: 0 FSDP units inside the root
-            auto_wrap_policy=CustomPolicy(lambda module: id(module) in units),
every module a unit: FSDP units inside the root, not one for each
-            auto_wrap_policy=CustomPolicy(lambda module: id(module) in units),
+            auto_wrap_policy=CustomPolicy(lambda module: True),
full sharding whatever asked: --sharding grad_op runs
-            sharding_strategy=SHARDING[sharding],
+            sharding_strategy=SHARDING["full"],
no mixed precision: bf16 computes in None
-            if dtype
+            if None
gradients reduced in bf16: reduces the gradients in torch.bfloat16
-                param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype
+                param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype
buffers left in fp32: keeps the buffers in None
-                param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype
+                param_dtype=dtype, reduce_dtype=torch.float32
bf16 whatever asked: fp16 computes in torch.bfloat16
-                param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype
+                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=dtype
no CPU offload: --cpu-offload keeps the parameters
-            cpu_offload=CPUOffload(offload_params=cpu_offload),
+            cpu_offload=CPUOffload(offload_params=False),
no device_id: the rank's device
-            device_id=device,
no mesh for hybrid: two-dimensional mesh
-            device_mesh=hybrid_mesh(device, ranks_per_node) if sharding == "hybrid" else None,
+            device_mesh=None,
FSDP's flat parameters: flat parameters
-            use_orig_params=True,
+            use_orig_params=False,
== 4.2 fsdp_utils.py passes
a lambda wrap policy
+        from functools import partial
+
+        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
+
         return FSDP(
             model,
-            auto_wrap_policy=CustomPolicy(lambda module: id(module) in units),
+            auto_wrap_policy=partial(
+                lambda_auto_wrap_policy, lambda_fn=lambda module: id(module) in units
+            ),
== 5.1 main.py fails test_ex5_1_main_sets_up_trains_and_cleans_up
setup without the options: do not reach it
-    env = distributed_utils.setup(cfg.pg_timeout, cfg.device)
+    env = distributed_utils.setup()
setup without the device: do not reach it
-    env = distributed_utils.setup(cfg.pg_timeout, cfg.device)
+    env = distributed_utils.setup(cfg.pg_timeout)
no cleanup: set up, train, clean up
-        distributed_utils.cleanup(failed)
+        pass
cleanup always told of a failure: told that it failed
-        distributed_utils.cleanup(failed)
+        distributed_utils.cleanup(True)
== 5.1 main.py fails test_ex5_1_cleanup_also_after_a_failure
cleanup not told of the failure: told that the run failed
-        distributed_utils.cleanup(failed)
+        distributed_utils.cleanup()
cleanup only after a success: cleanup must run then too
-        distributed_utils.cleanup(failed)
+        if not failed:
+            distributed_utils.cleanup(failed)
== 5.1 main.py passes
setup and cleanup by keyword
-    env = distributed_utils.setup(cfg.pg_timeout, cfg.device)
+    env = distributed_utils.setup(timeout_s=cfg.pg_timeout, device=cfg.device)
@@
-        distributed_utils.cleanup(failed)
+        distributed_utils.cleanup(failed=failed)
== 5.1 strategies.py fails test_ex5_1_the_strategy_chooses_the_wrapper
DDP's model dropped: trains the model unwrapped
-            model = get_ddp_model(model, device)
+            get_ddp_model(model, device)
FSDP's model dropped: trains the model unwrapped
-        model = get_fsdp_model(model, device, **shard)
+        get_fsdp_model(model, device, **shard)
FSDP without its options: the run's options do not reach it
-        model = get_fsdp_model(model, device, **shard)
+        model = get_fsdp_model(model, device)
FSDP with the sharding alone: the run's options do not reach it
-        model = get_fsdp_model(model, device, **shard)
+        model = get_fsdp_model(model, device, cfg.sharding)
the wrappers swapped: wraps the model with
-            model = get_ddp_model(model, device)
+            model = get_fsdp_model(model, device, **shard)
@@
-        model = get_fsdp_model(model, device, **shard)
+        model = get_ddp_model(model, device)
== 5.1 strategies.py passes
options by position and keyword
-        model = get_fsdp_model(model, device, **shard)
+        model = get_fsdp_model(
+            model, device, cfg.sharding, cfg.precision, cfg.cpu_offload, world_size // nodes
+        )
== 6.1 train.py fails test_ex6_1_a_step_is_one_optimizer_step_on_the_batchs_gradients
no zero_grad: step 1's are still in them
-        self.optimizer.zero_grad(set_to_none=True)
+        pass
two steps: takes 2 optimizer steps
         scaler.update()
+        self.optimizer.step()
== 6.1 train.py fails test_ex6_1_micro_batches_add_up_to_the_batch
zero_grad before each micro-batch's backward: the last micro-batch's alone
-        self.optimizer.zero_grad(set_to_none=True)
+        pass
@@
+                self.optimizer.zero_grad()
                 scaler.scale(weighted).backward()
backward of the unweighted loss: counts as much as the batch's
-                scaler.scale(weighted).backward()
+                scaler.scale(loss).backward()
a step per micro-batch: takes 2 optimizer steps
                 scaler.scale(weighted).backward()
+                scaler.step(self.optimizer)
+                scaler.update()
@@
-        scaler.step(self.optimizer)
-        scaler.update()
+        pass
== 6.1 train.py fails test_ex6_1_the_loss_scaler_scales_steps_and_updates
backward of the unscaled loss: scales no loss
-                scaler.scale(weighted).backward()
+                weighted.backward()
the optimizer steps past the scaler: steps past the scaler
-        scaler.step(self.optimizer)
+        self.optimizer.step()
no update: never updated
-        scaler.update()
update before step: updated before it steps
-        scaler.step(self.optimizer)
         scaler.update()
+        scaler.step(self.optimizer)
== 6.1 train.py fails test_ex6_1_validation_in_eval_mode_then_back_to_training
no eval: validates in training mode
-        self.model.eval()
+        pass
no train: back in training mode
-        self.model.train()
+        pass
== 6.1 train.py fails test_ex6_1_validation_counts_every_image_once_over_the_ranks
no all-reduce: its own share
-        loss_sum, correct, count = all_reduce([loss_sum, correct, count], device)
+        pass
the all-reduce's result dropped: its own share
-        loss_sum, correct, count = all_reduce([loss_sum, correct, count], device)
+        all_reduce([loss_sum, correct, count], device)
the maximum, not the sum: its own share
-        loss_sum, correct, count = all_reduce([loss_sum, correct, count], device)
+        loss_sum, correct, count = all_reduce(
+            [loss_sum, correct, count], device, dist.ReduceOp.MAX
+        )
the count not reduced: its own share
-        loss_sum, correct, count = all_reduce([loss_sum, correct, count], device)
+        loss_sum, correct = all_reduce([loss_sum, correct], device)
== 6.1 train.py passes
zero_grad after the step
-        self.optimizer.zero_grad(set_to_none=True)
+        pass
@@
         scaler.update()
+        self.optimizer.zero_grad()
the sums reduced one by one, modes by train(flag)
-        self.model.train()
+        self.model.train(True)
@@
-        self.model.eval()
+        self.model.train(False)
@@
-        loss_sum, correct, count = all_reduce([loss_sum, correct, count], device)
+        for total in (loss_sum, correct, count):
+            dist.all_reduce(total)
""")
MISTAKES = [plant for plant in PLANTS if plant.fails]
ALTERNATIVES = [plant for plant in PLANTS if not plant.fails]


def test_each_plant_changes_its_exercises_code_alone(regions):
    """A plant edits only lines of its exercise's regions (as a student's copy would differ from
    the solution), each hunk found once; the mistakes name checks that exist."""
    names = {name for names in check_tests().values() for name in names}
    for plant in PLANTS:
        lines = (REPO / plant.path).read_text().splitlines()
        mine = [r for r in regions if (r.path, r.number) == (plant.path, plant.exercise)]
        for first, end, new in plant.places(lines):
            assert any(r.begin < first and end <= r.end for r in mine), (plant.name, new)
        assert plant.fails is None or plant.fails in names, plant.name


def grade_round(solved: Path, folder: Path, plants: list[Plant]) -> dict[Plant, list[str]]:
    """The checks in a copy of the solved copy with these plants (one per exercise), of each
    mistake's check and every check of each alternative's exercise: each plant's failure lines."""
    shutil.copytree(solved, folder)
    for plant in plants:
        target = folder / plant.path
        target.write_text(plant.planted(target.read_text()))
    tests = [plant.fails or f"ex{plant.exercise.replace('.', '_')}_" for plant in plants]
    _, output = check_in_process(folder, f'PYTEST_ARGS=-k "{" or ".join(tests)}"')
    # Every check ran: a failure of its own or a pass, no collection error.
    assert re.search(r"^\d+ (passed|failed)", output, re.M), output[-3000:]
    assert not re.search(r"\d+ errors?\b", output), output[-3000:]
    failed = failures(output)

    def lines(plant: Plant) -> list[str]:
        mine = failed.get(plant.exercise, [])
        return [line for line in mine if not plant.fails or re.match(rf"{plant.fails}\b", line)]

    return {plant: lines(plant) for plant in plants}


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[Plant, list[str]]:
    """Every plant graded: in rounds of one plant per exercise (the exercises' checks are
    independent), two rounds at a time, each in its own copy of one solved copy."""
    folder = tmp_path_factory.mktemp("planted")
    solved = folder / "solved"
    mx.build(solved, keep=frozenset(COURSE))
    by_exercise = {}
    for plant in PLANTS:
        by_exercise.setdefault(plant.exercise, []).append(plant)
    rounds = [
        [plant for plant in row if plant] for row in itertools.zip_longest(*by_exercise.values())
    ]
    grades = two_at_a_time(
        lambda i: grade_round(solved, folder / f"round-{i}", rounds[i]), range(len(rounds))
    )
    return {plant: lines for grade in grades for plant, lines in grade.items()}


@pytest.mark.slow
@pytest.mark.planted
@pytest.mark.parametrize("plant", MISTAKES, ids=lambda p: f"{p.exercise} {p.name}")
def test_a_planted_mistake_fails_its_check_saying_what_is_wrong(graded, plant):
    lines = graded[plant]
    assert lines, f"{plant.name}: {plant.fails} passes"
    assert any(plant.says in line for line in lines), lines
    assert [line for line in lines if answers_in(line, plant.exercise)] == []


@pytest.mark.slow
@pytest.mark.planted
@pytest.mark.parametrize("plant", ALTERNATIVES, ids=lambda p: f"{p.exercise} {p.name}")
def test_a_correct_alternative_passes_its_exercises_checks(graded, plant):
    assert graded[plant] == []

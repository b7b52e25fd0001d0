"""The student's copy (make_exercise.py, `make exercise`) and its checks (`make check EX=N.M`,
tests/exercise_checks.py): the marks and the sheet agree, the marks are comments, the copy is
the solution with the regions and their twins cut, the same at every build, and holds no
answer outside the cut nor the instructors' key unless asked; each exercise's check fails on
the stub and passes once that exercise alone is restored; and mistakes a student makes,
planted one at a time in a solved copy, each fail their check with a line that says what is
wrong without the answer, while correct alternatives pass."""

import ast
import filecmp
import itertools
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


def make_check(copy: Path, exercise: str | None = None, tests: list[str] = ()):
    """`make check [EX=N.M]` in copy, with this Python (the copy has no .venv of its own); only
    the checks named in `tests` where some are."""
    command = ["make", "-s", "-C", copy, "-o", ".venv/.installed", "check", f"PY={sys.executable}"]
    if exercise:
        command.append(f"EX={exercise}")
    if tests:
        command.append(f'PYTEST_ARGS=-k "{" or ".join(tests)}"')
    return run(command, timeout=CHECK_TIMEOUT_S)


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


def test_each_answer_is_its_exercises_code():
    """Each call of ANSWERS is written in its exercise's regions or their twins: the list names
    the answers, not words that happen to be near them."""
    assert set(ANSWERS) == COURSE
    regions = mx.all_regions()
    for exercise, calls in ANSWERS.items():
        code = "\n".join(region_text(r) for r in regions if r.number == exercise)
        assert [c for c in calls if not answer(c).search(code)] == [], exercise


def answers_in(text: str, exercise: str | None = None) -> list[str]:
    """The calls of ANSWERS (of `exercise`, or of all) that text makes."""
    chosen = [exercise] if exercise else ANSWERS
    return [call for e in chosen for call in ANSWERS[e] if answer(call).search(text)]


def test_the_copy_holds_no_answer_outside_the_cut(tmp_path):
    mx.build(tmp_path / "copy")
    found = []
    for path in sorted((tmp_path / "copy").rglob("*")):
        name = path.relative_to(tmp_path / "copy").as_posix()
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


# ----------------------------------------------------------------------------- planted mistakes


@dataclass(frozen=True)
class Plant:
    """An exercise's code as a student might write it: the solution's file `path` with `edits`
    (old, new) made in that exercise's regions. A mistake when `fails` names the check that must
    fail, with a line that holds `says`; else a correct alternative, which every check of the
    exercise passes."""

    exercise: str
    name: str
    path: str
    edits: tuple[tuple[str, str], ...]
    fails: str | None = None
    says: str = ""


def plants(exercise: str, path: str, *rows: tuple) -> list[Plant]:
    """The plants of one exercise in one file, each row (name, edits[, fails, says])."""
    return [Plant(exercise, row[0], path, *row[1:]) for row in rows]


def edited(text: str, plant: Plant) -> str:
    for old, new in plant.edits:
        assert text.count(old) == 1, (plant.name, old)
        text = text.replace(old, new)
    return text


SET_UP, DATA, DDP, FSDP, MAIN, STRATEGIES, TRAIN = (
    "distributed_utils.py",
    "data.py",
    "ddp_utils.py",
    "fsdp_utils.py",
    "main.py",
    "strategies.py",
    "train.py",
)
ON_GPUS = "test_ex2_1_a_rank_on_a_node_of_gpus"
JOINS = "test_ex2_1_each_rank_joins_as_the_launcher_says"


# The process group's start as the solution writes it, planted on.
GROUP = (
    next(
        text
        for region in mx.all_regions()
        if region.path == "distributed_utils.py"
        and "init_process_group(" in (text := region_text(region))
    )
    + "\n"
)
DOWNLOADS = "test_ex3_1_rank_0_alone_downloads_and_the_others_wait"
ONCE = "test_ex3_1_every_image_once_per_epoch_over_the_ranks"
ORDER = "test_ex3_1_a_new_order_every_epoch"
PREPARE = "    cache = on_rank0(prepare, dataset, data_dir, download, fetch_hint)\n"
TRAIN_SAMPLER = "ShardSampler(len(train), world_size, rank, shuffle=True, seed=seed)"
DDP_ON_A_GPU = "test_ex4_1_ddp_on_a_gpu"
MOVE = "    model = model.to(device)\n    # On a GPU, name it"  # get_dp_model moves it too
WRAP = "return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)"
FSDP_MADE = "test_ex4_2_fsdp_units_sharding_and_precision"
MIXED = "param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype"
POLICY = "CustomPolicy(lambda module: id(module) in units)"
SETS_UP = "test_ex5_1_main_sets_up_trains_and_cleans_up"
AFTER_FAILURE = "test_ex5_1_cleanup_also_after_a_failure"
CHOOSES = "test_ex5_1_the_strategy_chooses_the_wrapper"
CLEANUP = "        distributed_utils.cleanup(failed)\n"
WRAP_DDP = "            model = get_ddp_model(model, device)\n"
WRAP_FSDP = "        model = get_fsdp_model(model, device, **shard)\n"
A_STEP = "test_ex6_1_a_step_is_one_optimizer_step_on_the_batchs_gradients"
SCALER = "test_ex6_1_the_loss_scaler_scales_steps_and_updates"
MICRO = "test_ex6_1_micro_batches_add_up_to_the_batch"
MODES = "test_ex6_1_validation_in_eval_mode_then_back_to_training"
SUMS = "test_ex6_1_validation_counts_every_image_once_over_the_ranks"
ZERO = "        self.optimizer.zero_grad(set_to_none=True)\n"
BACKWARD = "                scaler.scale(weighted).backward()\n"
STEP = "        scaler.step(self.optimizer)\n        scaler.update()\n"
REDUCE = "        loss_sum, correct, count = all_reduce([loss_sum, correct, count], device)\n"

MISTAKES = [
    # 2.1: the set-up
    *plants(
        "2.1",
        SET_UP,
        (
            "the GPU chosen by the rank",
            (("pick_device(local_rank,", "pick_device(rank,"),),
            ON_GPUS,
            "makes cuda:0 its own",
        ),
        (
            "the rank and the local rank swapped",
            (("rank, local_rank, world_size = read", "local_rank, rank, world_size = read"),),
            ON_GPUS,
            "makes cuda:0 its own",
        ),
        (
            "torchrun's variables read by hand",
            (
                (
                    "= read_ranks()",
                    '= map(int, (os.environ[v] for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE")))',
                ),
            ),
            ON_GPUS,
            "KeyError: 'RANK'",
        ),
        (
            "the device asked for ignored",
            (("pick_device(local_rank, wanted=device)", "pick_device(local_rank)"),),
            "test_ex2_1_the_device_asked_for",
            "takes cuda:0",
        ),
        (
            "no set_device",
            (("        torch.cuda.set_device(device)\n", ""),),
            ON_GPUS,
            "does not make its GPU this process's own",
        ),
        (
            "set_device on the CPU too",
            (
                (
                    '    if device.type == "cuda":\n        torch.cuda.set_device(device)\n',
                    '    torch.cuda.set_device(device)\n    if device.type == "cuda":\n',
                ),
            ),
            JOINS,
            "Expected a cuda device",
        ),
        (
            "no flight recorder",
            (("        turn_on_flight_recorder()\n", ""),),
            ON_GPUS,
            "flight recorder",
        ),
        (
            "the backend of one device",
            (("        groups_backend,\n        store=", "        backend,\n        store="),),
            ON_GPUS,
            "the backend 'nccl'",
        ),
        (
            "rank=local_rank",
            (("        rank=rank,\n", "        rank=local_rank,\n"),),
            ON_GPUS,
            "joins the group as rank 1 of 4",
        ),
        ("no store", (("        store=group_store,\n", ""),), ON_GPUS, "no store"),
        (
            "the store before its prefix",
            (("store=group_store,", "store=store,"),),
            ON_GPUS,
            "another store",
        ),
        ("no timeout", (("        timeout=timeout,\n", ""),), ON_GPUS, "the timeout None"),
        (
            "the timeout in seconds",
            (("        timeout=timeout,\n", "        timeout=timeout_s,\n"),),
            ON_GPUS,
            "the timeout 37,",
        ),
        (
            "no device_id",
            (('        device_id=device if device.type == "cuda" else None,\n', ""),),
            ON_GPUS,
            "its device is None",
        ),
        (
            "device_id=local_rank",
            (('device_id=device if device.type == "cuda" else None', "device_id=local_rank"),),
            ON_GPUS,
            "its device is cuda:1, not cuda:0",
        ),
        (
            "device_id on the CPU too",
            (('device_id=device if device.type == "cuda" else None', "device_id=device"),),
            JOINS,
            "device_id",
        ),
        (
            "no group for a world of one",
            (
                (
                    GROUP,
                    "    if world_size > 1:\n"
                    + GROUP.replace("\n    ", "\n        ").replace(
                        "    dist.", "        dist.", 1
                    ),
                ),
            ),
            "test_ex2_1_alone_a_world_of_one",
            "no process group of one",
        ),
    ),
    # 3.1: the data
    *plants(
        "3.1",
        DATA,
        (
            "every rank downloads",
            ((PREPARE, "    cache = prepare(dataset, data_dir, download, fetch_hint)\n"),),
            DOWNLOADS,
            "downloaded_by_rank_0, downloaded_by_rank_1 downloaded",
        ),
        (
            "the others do not wait",
            (
                (
                    PREPARE,
                    "    from dataset_files import cache_path\n"
                    "    from utils import is_rank_zero\n\n"
                    "    cache = (\n"
                    "        prepare(dataset, data_dir, download, fetch_hint)\n"
                    "        if is_rank_zero()\n"
                    "        else str(cache_path(dataset, data_dir))\n"
                    "    )\n",
                ),
            ),
            DOWNLOADS,
            "do not wait for rank 0",
        ),
        (
            "no shuffle",
            (("shuffle=True, seed=seed", "shuffle=False, seed=seed"),),
            ORDER,
            "come in order",
        ),
        ("no seed", (("shuffle=True, seed=seed)", "shuffle=True)"),), ORDER, "--seed 1"),
        (
            "a seed of each rank's",
            (("shuffle=True, seed=seed)", "shuffle=True, seed=seed + rank)"),),
            ONCE,
            "overlapping",
        ),
        (
            "the world size and the rank swapped",
            ((TRAIN_SAMPLER, TRAIN_SAMPLER.replace("world_size, rank", "rank, world_size")),),
            ONCE,
            "Invalid rank",
        ),
        (
            "the validation set whole on every rank",
            (("ShardSampler(len(val), world_size, rank,", "ShardSampler(len(val), 1, 0,"),),
            ONCE,
            "validation shards",
        ),
        ("no set_epoch", (("self.train_sampler.set_epoch(epoch)", "pass"),), ORDER, "same order"),
        (
            "set_epoch of the step",
            (("self.train_sampler.set_epoch(epoch)", "self.train_sampler.set_epoch(step)"),),
            ORDER,
            "same order",
        ),
    ),
    # 4.1: DDP
    *plants(
        "4.1",
        DDP,
        (
            "the model left on the CPU",
            ((MOVE, MOVE.removeprefix("    model = model.to(device)\n")),),
            DDP_ON_A_GPU,
            "parameters are on the CPU",
        ),
        (
            "the model moved after wrapping",
            (
                (MOVE, MOVE.removeprefix("    model = model.to(device)\n")),
                (WRAP, WRAP + ".to(device)"),
            ),
            DDP_ON_A_GPU,
            "after DDP wrapped it",
        ),
        (
            "device_ids=[0]",
            (("[device.index] if", "[0] if"),),
            DDP_ON_A_GPU,
            "the model is on cuda:0",
        ),
        (
            "device_ids on the CPU too",
            (('[device.index] if device.type == "cuda" else None', "[device.index]"),),
            "test_ex4_1_ddp_replicates_and_averages_gradients",
            "device_ids",
        ),
        (
            "the model returned unwrapped",
            ((WRAP, WRAP.removeprefix("return ") + "\n    return model"),),
            DDP_ON_A_GPU,
            "returns a BoundForAGpu",
        ),
        (
            "output_device=0",
            (("gradient_as_bucket_view=True)", "gradient_as_bucket_view=True, output_device=0)"),),
            DDP_ON_A_GPU,
            "outputs on cuda:0",
        ),
    ),
    # 4.2: FSDP
    *plants(
        "4.2",
        FSDP,
        (
            "no wrap policy",
            (
                (
                    f"            auto_wrap_policy={POLICY},\n",
                    "",
                ),
            ),
            FSDP_MADE,
            "0 FSDP units inside the root",
        ),
        (
            "every module a unit",
            (("id(module) in units", "True"),),
            FSDP_MADE,
            "FSDP units inside the root, not one for each",
        ),
        (
            "full sharding whatever asked",
            (("SHARDING[sharding]", 'SHARDING["full"]'),),
            FSDP_MADE,
            "--sharding grad_op runs",
        ),
        (
            "no mixed precision",
            (("            if dtype\n", "            if None\n"),),
            FSDP_MADE,
            "bf16 computes in None",
        ),
        (
            "gradients reduced in bf16",
            ((MIXED, MIXED.replace("reduce_dtype=torch.float32", "reduce_dtype=dtype")),),
            FSDP_MADE,
            "reduces the gradients in torch.bfloat16",
        ),
        (
            "buffers left in fp32",
            ((MIXED, MIXED.replace(", buffer_dtype=dtype", "")),),
            FSDP_MADE,
            "keeps the buffers in None",
        ),
        (
            "bf16 whatever asked",
            ((MIXED, MIXED.replace("param_dtype=dtype", "param_dtype=torch.bfloat16")),),
            FSDP_MADE,
            "fp16 computes in torch.bfloat16",
        ),
        (
            "no CPU offload",
            (("CPUOffload(offload_params=cpu_offload)", "CPUOffload(offload_params=False)"),),
            FSDP_MADE,
            "--cpu-offload keeps the parameters",
        ),
        (
            "no device_id",
            (("            device_id=device,\n", ""),),
            FSDP_MADE,
            "the rank's device",
        ),
        (
            "no mesh for hybrid",
            (('hybrid_mesh(device, ranks_per_node) if sharding == "hybrid" else None', "None"),),
            FSDP_MADE,
            "two-dimensional mesh",
        ),
        (
            "FSDP's flat parameters",
            (("use_orig_params=True", "use_orig_params=False"),),
            FSDP_MADE,
            "flat parameters",
        ),
    ),
    # 5.1: the main program
    *plants(
        "5.1",
        MAIN,
        (
            "setup without the options",
            (("setup(cfg.pg_timeout, cfg.device)", "setup()"),),
            SETS_UP,
            "do not reach it",
        ),
        (
            "setup without the device",
            (("setup(cfg.pg_timeout, cfg.device)", "setup(cfg.pg_timeout)"),),
            SETS_UP,
            "do not reach it",
        ),
        ("no cleanup", ((CLEANUP, "        pass\n"),), SETS_UP, "set up, train, clean up"),
        (
            "cleanup not told of the failure",
            (("cleanup(failed)", "cleanup()"),),
            AFTER_FAILURE,
            "told that the run failed",
        ),
        (
            "cleanup always told of a failure",
            (("cleanup(failed)", "cleanup(True)"),),
            SETS_UP,
            "told that it failed",
        ),
        (
            "cleanup only after a success",
            ((CLEANUP, "        if not failed:\n    " + CLEANUP),),
            AFTER_FAILURE,
            "cleanup must run then too",
        ),
    ),
    *plants(
        "5.1",
        STRATEGIES,
        (
            "DDP's model dropped",
            ((WRAP_DDP, WRAP_DDP.replace("model = ", "")),),
            CHOOSES,
            "trains the model unwrapped",
        ),
        (
            "FSDP's model dropped",
            ((WRAP_FSDP, WRAP_FSDP.replace("model = ", "")),),
            CHOOSES,
            "trains the model unwrapped",
        ),
        (
            "FSDP without its options",
            ((WRAP_FSDP, WRAP_FSDP.replace(", **shard", "")),),
            CHOOSES,
            "the run's options do not reach it",
        ),
        (
            "FSDP with the sharding alone",
            ((WRAP_FSDP, WRAP_FSDP.replace("**shard", "cfg.sharding")),),
            CHOOSES,
            "the run's options do not reach it",
        ),
        (
            "the wrappers swapped",
            (
                # The FSDP line first: the DDP line, moved in, is not the FSDP line's text.
                (WRAP_FSDP, WRAP_DDP.replace("            ", "        ", 1)),
                (WRAP_DDP, WRAP_FSDP.replace("        ", "            ", 1)),
            ),
            CHOOSES,
            "wraps the model with",
        ),
    ),
    # 6.1: training
    *plants(
        "6.1",
        TRAIN,
        ("no zero_grad", ((ZERO, "        pass\n"),), A_STEP, "step 1's are still in them"),
        (
            "zero_grad before each micro-batch's backward",
            (
                (ZERO, "        pass\n"),
                (BACKWARD, "                self.optimizer.zero_grad()\n" + BACKWARD),
            ),
            MICRO,
            "the last micro-batch's alone",
        ),
        (
            "backward of the unscaled loss",
            ((BACKWARD, "                weighted.backward()\n"),),
            SCALER,
            "scales no loss",
        ),
        (
            "backward of the unweighted loss",
            (("scaler.scale(weighted)", "scaler.scale(loss)"),),
            MICRO,
            "counts as much as the batch's",
        ),
        (
            "the optimizer steps past the scaler",
            (("scaler.step(self.optimizer)", "self.optimizer.step()"),),
            SCALER,
            "steps past the scaler",
        ),
        ("no update", (("        scaler.update()\n", ""),), SCALER, "never updated"),
        (
            "update before step",
            ((STEP, "        scaler.update()\n        scaler.step(self.optimizer)\n"),),
            SCALER,
            "updated before it steps",
        ),
        (
            "a step per micro-batch",
            (
                (BACKWARD, BACKWARD + STEP.replace("        ", "                ")),
                (STEP, "        pass\n"),
            ),
            MICRO,
            "takes 2 optimizer steps",
        ),
        (
            "two steps",
            ((STEP, STEP + "        self.optimizer.step()\n"),),
            A_STEP,
            "takes 2 optimizer steps",
        ),
        (
            "no eval",
            (("        self.model.eval()\n", "        pass\n"),),
            MODES,
            "validates in training mode",
        ),
        (
            "no train",
            (("        self.model.train()\n", "        pass\n"),),
            MODES,
            "back in training mode",
        ),
        ("no all-reduce", ((REDUCE, "        pass\n"),), SUMS, "its own share"),
        (
            "the all-reduce's result dropped",
            (("loss_sum, correct, count = all_reduce(", "all_reduce("),),
            SUMS,
            "its own share",
        ),
        (
            "the maximum, not the sum",
            (
                (
                    "[loss_sum, correct, count], device)",
                    "[loss_sum, correct, count], device, dist.ReduceOp.MAX)",
                ),
            ),
            SUMS,
            "its own share",
        ),
        (
            "the count not reduced",
            ((REDUCE, "        loss_sum, correct = all_reduce([loss_sum, correct], device)\n"),),
            SUMS,
            "its own share",
        ),
    ),
]

ALTERNATIVES = [
    *plants(
        "2.1",
        SET_UP,
        (
            "the group's arguments by keyword, device_id only on a GPU, set_device by index",
            (
                (
                    GROUP,
                    """    on_gpu = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend=groups_backend,
        init_method=None,
        timeout=timeout,
        world_size=world_size,
        rank=rank,
        store=group_store,
        **on_gpu,
    )
""",
                ),
                ("torch.cuda.set_device(device)", "torch.cuda.set_device(device.index)"),
            ),
        ),
    ),
    *plants(
        "3.1",
        DATA,
        (
            "a barrier instead of on_rank0",
            (
                (
                    PREPARE,
                    "    from distributed_utils import barrier\n"
                    "    from utils import is_rank_zero\n\n"
                    "    if is_rank_zero():\n"
                    "        prepare(dataset, data_dir, download, fetch_hint)\n"
                    "    barrier()\n"
                    "    cache = prepare(dataset, data_dir, download, fetch_hint)\n",
                ),
            ),
        ),
        (
            "a shuffled validation, samplers by keyword",
            (
                (
                    "ShardSampler(len(val), world_size, rank, shuffle=False)",
                    "ShardSampler(len(val), rank=rank, world_size=world_size, shuffle=True)",
                ),
            ),
        ),
    ),
    *plants(
        "4.1",
        DDP,
        (
            "moved in place, the device itself in device_ids",
            (
                (MOVE, MOVE.replace("model = model.to", "model.to")),
                ("[device.index] if", "[device] if"),
            ),
        ),
        (
            "no device_ids on a GPU",
            (('[device.index] if device.type == "cuda" else None', "None"),),
        ),
    ),
    *plants(
        "4.2",
        FSDP,
        (
            "a lambda wrap policy",
            (
                (
                    "        return FSDP(\n",
                    "        from functools import partial\n\n"
                    "        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy\n\n"
                    "        return FSDP(\n",
                ),
                (
                    POLICY,
                    POLICY.replace("CustomPolicy(", "partial(lambda_auto_wrap_policy, lambda_fn="),
                ),
            ),
        ),
    ),
    *plants(
        "5.1",
        STRATEGIES,
        (
            "options by position and keyword",
            (
                (
                    WRAP_FSDP,
                    WRAP_FSDP.replace(
                        "**shard",
                        "cfg.sharding, cfg.precision, cfg.cpu_offload, world_size // nodes",
                    ),
                ),
            ),
        ),
    ),
    *plants(
        "5.1",
        MAIN,
        (
            "setup and cleanup by keyword",
            (
                (
                    "setup(cfg.pg_timeout, cfg.device)",
                    "setup(timeout_s=cfg.pg_timeout, device=cfg.device)",
                ),
                ("cleanup(failed)", "cleanup(failed=failed)"),
            ),
        ),
    ),
    *plants(
        "6.1",
        TRAIN,
        (
            "zero_grad after the step",
            ((ZERO, "        pass\n"), (STEP, STEP + "        self.optimizer.zero_grad()\n")),
        ),
        (
            "the sums reduced one by one, modes by train(flag)",
            (
                (
                    REDUCE,
                    "        for total in (loss_sum, correct, count):\n"
                    "            dist.all_reduce(total)\n",
                ),
                ("        self.model.eval()\n", "        self.model.train(False)\n"),
                ("        self.model.train()\n", "        self.model.train(True)\n"),
            ),
        ),
    ),
]


def test_each_plant_changes_its_exercises_code_alone():
    """A plant edits only lines of its exercise's regions (as a student's copy would differ from
    the solution), each edit found once; the mistakes name checks that exist."""
    regions = mx.all_regions()
    names = {name for names in check_tests().values() for name in names}
    for plant in MISTAKES + ALTERNATIVES:
        text = (REPO / plant.path).read_text()
        mine = [r for r in regions if r.path == plant.path and r.number == plant.exercise]
        for old, _ in plant.edits:
            assert text.count(old) == 1, (plant.name, old)
            first = text[: text.index(old)].count("\n")
            last = first + old.rstrip("\n").count("\n")
            assert any(r.begin < first and last < r.end for r in mine), (plant.name, old)
        assert plant.fails is None or plant.fails in names, plant.name


def grade_round(solved: Path, folder: Path, plants: list[Plant]) -> dict[Plant, list[str]]:
    """make check, in a copy of the solved copy with these plants (one per exercise), of each
    mistake's check and every check of each alternative's exercise: each plant's failure lines."""
    shutil.copytree(solved, folder)
    for plant in plants:
        target = folder / plant.path
        target.write_text(edited(target.read_text(), plant))
    tests = [plant.fails or f"ex{plant.exercise.replace('.', '_')}_" for plant in plants]
    done = make_check(folder, tests=tests)
    output = done.stdout + done.stderr
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
    for plant in MISTAKES + ALTERNATIVES:
        by_exercise.setdefault(plant.exercise, []).append(plant)
    rounds = [
        [plant for plant in row if plant] for row in itertools.zip_longest(*by_exercise.values())
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        grades = pool.map(
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

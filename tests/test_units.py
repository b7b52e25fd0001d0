"""Launcher variables, rendezvous, device choice and model shapes: no processes needed."""

import os
import re
import sys
from dataclasses import asdict

import pytest
import torch

import checkpoint
import distributed_utils as du
import layout
import utils
from conftest import LONG_RUN, REPO, TINY, assert_one_line_error, clean_environment, run
from dist_harness import TEST_PORTS, ForkedMain, free_port
from model import MODELS, build_model, count_parameters
from utils import UsageError

pytestmark = pytest.mark.fast  # make test-fast


SRUN_STEP = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, (0, 0, 1)),  # plain `python main.py`
        ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, (3, 1, 4)),  # torchrun / run.sh
        ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 0, 2)),
        (SRUN_STEP, (5, 1, 8)),  # plain srun
        # The batch script itself (no step): SLURM's task count is not ours to wait for.
        ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}, (0, 0, 1)),
        ({"RANK": "1"}, (0, 0, 1)),  # a RANK without a WORLD_SIZE: no launcher
        # torchrun's variables win over SLURM's (torchrun inside an allocation).
        ({**SRUN_STEP, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, (1, 1, 2)),
        ({**SRUN_STEP, "RANK": "0", "WORLD_SIZE": "2"}, (0, 0, 2)),
    ],
)
def test_ranks_from_torchrun_or_slurm_and_rank_zero_is_their_rank_0(env, expected):
    """One reading of the launchers' variables: who prints and writes alone (is_rank_zero) is
    the rank that joins the process group as rank 0 (read_ranks, distributed_utils.setup)."""
    assert utils.read_ranks(env) == expected
    assert utils.is_rank_zero(env) == (expected[0] == 0)


def test_bad_rank_variables_are_usage_errors_and_make_every_process_speak():
    with pytest.raises(UsageError, match="outside world size"):
        utils.read_ranks({"RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "4"})
    with pytest.raises(UsageError, match="not an integer"):
        utils.read_ranks({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "4"})
    assert utils.is_rank_zero({"RANK": "x", "WORLD_SIZE": "2"})


def test_rendezvous_prefers_environment_then_slurm_job():
    assert du.rendezvous({"MASTER_ADDR": "h1", "MASTER_PORT": "1234"}) == ("h1", 1234)
    # 20000 + job id % 12000: ports 20000..31999, different for jobs sharing a node, and
    # none in Linux's default range for outgoing connections (32768-60999).
    assert du.rendezvous({"MASTER_ADDR": "h1", "SLURM_JOB_ID": "123456"}) == ("h1", 23456)
    assert du.rendezvous({"MASTER_ADDR": "h", "SLURM_JOB_ID": "7"}) == ("h", 20007)
    assert du.rendezvous({"MASTER_ADDR": "h", "SLURM_JOB_ID": "8"}) == ("h", 20008)
    assert du.rendezvous({"MASTER_ADDR": "h", "SLURM_JOB_ID": "11999"}) == ("h", 31999)
    assert du.rendezvous({"MASTER_ADDR": "h", "SLURM_JOB_ID": "12000"}) == ("h", 20000)
    assert du.rendezvous({}) == ("127.0.0.1", 29500)


def test_the_tests_ranks_meet_below_the_ports_the_kernel_hands_out():
    """dist_harness.free_port draws below this machine's range for outgoing connections, apart
    from the job ports: no connection can take the port before the test's rank 0 listens."""
    outgoing = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(p in TEST_PORTS and p not in du.JOB_PORTS and p < outgoing for p in ports), ports
    assert len(ports) > 1, "one fixed port: two workers would meet at it"


def test_rendezvous_inside_srun_is_the_steps_first_node():
    job = {"SLURM_JOB_ID": "40001", "SLURM_JOB_NODELIST": "nid[001234-001237]"}
    assert du.rendezvous(job) == ("nid001234", 24001)
    # A step on part of the allocation: its task 0 runs on the step's first node.
    step = {**job, "SLURM_STEP_NODELIST": "nid[001236-001237]"}
    assert du.rendezvous(step) == ("nid001236", 24001)
    # torchrun's (or the user's) own MASTER_ADDR wins over SLURM's.
    assert du.rendezvous({**job, "MASTER_ADDR": "login1"}) == ("login1", 24001)


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        (
            "nid[001234-001237,001240]",
            ["nid001234", "nid001235", "nid001236", "nid001237", "nid001240"],
        ),
        ("node1,node2", ["node1", "node2"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("nid[001-002]-ib", ["nid001-ib", "nid002-ib"]),  # zero padding kept, a suffix after it
        ("n[8-10]", ["n8", "n9", "n10"]),  # no padding: the width of the first number
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("login", ["login"]),
    ],
)
def test_hostlist_expands_as_scontrol_does(nodelist, hosts):
    assert du.expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "a[1-", "a]b", "n[3-1]", "n[a-b]", "a,,b", "n[]"])
def test_unreadable_hostlist_says_to_set_master_addr(nodelist):
    with pytest.raises(UsageError, match="set MASTER_ADDR"):
        du.expand_hostlist(nodelist)


def test_device_and_backend_follow_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert du.pick_device(3, env={}) == (torch.device("cpu"), "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert du.pick_device(5, env={}) == (torch.device("cuda", 1), "nccl")
    assert du.pick_device(5, "cpu", env={}) == (torch.device("cpu"), "gloo")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # --gpus-per-task=1
    assert du.pick_device(3, env={}) == (torch.device("cuda", 0), "nccl")


@pytest.mark.parametrize(
    "env,given",
    [
        ({}, None),
        ({"CUDA_VISIBLE_DEVICES": ""}, None),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
        ({"SLURM_GPUS_ON_NODE": "0"}, None),
        ({"SLURM_JOB_GPUS": "NoDevFiles"}, None),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, "CUDA_VISIBLE_DEVICES=0,1"),
        ({"SLURM_GPUS_ON_NODE": "4"}, "SLURM_GPUS_ON_NODE=4"),
    ],
)
def test_gpus_given_by_the_launcher(env, given):
    assert du.given_gpus(env) == given


def test_no_silent_cpu_fallback_where_gpus_were_given(monkeypatch):
    """GPUs given to the job but invisible to torch: an error that says why and how to train
    on the CPU on purpose; --device cuda without a GPU likewise."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        UsageError,
        match=r"SLURM_GPUS_ON_NODE=4 gives this process GPUs, but "
        r"torch .* sees none .*--device cpu",
    ):
        du.pick_device(0, env={"SLURM_GPUS_ON_NODE": "4"})
    with pytest.raises(UsageError, match="--device cuda asks for a GPU"):
        du.pick_device(0, "cuda", env={})
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(UsageError, match="CPU-only build of torch"):
        du.pick_device(0, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert du.pick_device(0, "cpu", env={"CUDA_VISIBLE_DEVICES": "0"})[0].type == "cpu"


def test_two_ranks_on_one_gpu_are_named():
    owners = ["n1 GPU a", "n1 GPU b", "n2 GPU a", "n1 GPU a"]  # a GPU uuid is per node here
    assert du.shared_gpus(owners).startswith("ranks 0, 3 would share one GPU (n1 GPU a;")
    assert du.shared_gpus(["n1 GPU a", "n1 GPU b", "n2 GPU a"]) is None


@pytest.mark.parametrize(
    "version, refused",
    [
        ("2.8.0a0+5228986c39", True),  # NGC 25.06's
        ("2.9.1+cu128", True),
        ("2.10.0a0+b4e4ee81d3", False),  # NGC 25.12's: a build on the way to 2.10 is a 2.10
        ("2.14.1+cu130", False),
        ("3.0.0", False),
    ],
)
def test_a_torch_older_than_the_oldest_is_refused(version, refused):
    if refused:
        with pytest.raises(UsageError, match=rf"^torch {re.escape(version)} is older than 2\.10"):
            du.check_torch(version)
    else:
        du.check_torch(version)


def test_main_refuses_an_old_torch_in_one_line():
    """Before it checks or trains: `main.py --check` (run.sh's, before every launch) and a rank
    alike."""
    old_torch = (
        "import runpy, sys, torch; torch.__version__ = '2.9.1'; sys.argv[0] = 'main.py'; "
        "runpy.run_path('main.py', run_name='__main__')"
    )
    for args in (["--check", "1"], []):
        done = run([sys.executable, "-c", old_torch, *TINY, *args], timeout=120)
        assert_one_line_error(done, "torch 2.9.1 is older than 2.10", "make install")


def test_a_missing_torchvision_is_named_with_the_way_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision: not found
    missing = r"^--model resnet18 needs torchvision: run 'make install'$"
    with pytest.raises(UsageError, match=missing):
        build_model("resnet18")


def test_resume_names_a_checkpoint_by_its_folder_or_any_of_its_files(tmp_path):
    """`--resume .../meta.pt` once read as a folder to write checkpoints into ("not writable")."""
    ckpt = tmp_path / "run" / "ckpt_e0002_s000000"
    ckpt.mkdir(parents=True)
    for name in (checkpoint.META_FILE, "state.pt"):
        (ckpt / name).touch()
    for named in (ckpt, ckpt / checkpoint.META_FILE, ckpt / "state.pt"):
        assert checkpoint.resolve(str(named), tmp_path) == ckpt, named
        assert checkpoint.folder_for(None, str(named)) == ckpt.parent, named


def test_check_names_a_chosen_checkpoint_it_cannot_read_and_leaves_auto_to_the_run(tmp_path):
    """--resume PATH whose meta.pt is cut short: the run's own Unreadable (exit status 5). With
    auto, the run passes over it to an older one: --check does not refuse it."""
    ckpt = tmp_path / "ckpt_e0002_s000000"
    ckpt.mkdir()
    (ckpt / checkpoint.META_FILE).write_bytes(b"half")
    fits = checkpoint.Identity("ddp", "cnn", 1, 64)
    with pytest.raises(checkpoint.Unreadable, match=f"cannot read checkpoint {ckpt} "):
        checkpoint.check_resume(str(tmp_path), tmp_path, fits, [1])
    checkpoint.check_resume("auto", tmp_path, fits, [1])


# --check 0 is refused once read: a command line main.py cannot read is refused before the
# collector goes off, and could not show it turned back on.
@pytest.mark.parametrize("argv, status", [(["--check", "1"], 0), (["--check", "0"], 2)])
def test_main_gives_its_caller_the_garbage_collector_back(argv, status, capsys):
    """main() turns the collector off while torch loads, and setup turns it back on: --check and
    a refused command line end before setup, and a caller of main() gets it back all the same."""
    import gc

    import main

    assert main.main([*TINY, *argv]) == status, capsys.readouterr()
    assert gc.isenabled()


@pytest.mark.parametrize(
    "samples, sizes, noted",
    [
        (dict(train_samples=512), (512, 10_000), True),  # few trained, every one validated
        (dict(train_samples=512, val_samples=256), (512, 256), False),  # a quick run: both
        (dict(), (50_000, 10_000), False),  # the whole set
        (dict(train_samples=20_000), (20_000, 10_000), False),  # validates fewer than it trains
    ],
)
def test_a_run_that_validates_more_images_than_it_trains_says_so(samples, sizes, noted):
    from config import Config
    from session import validation_note

    note = validation_note(Config(**samples), *sizes)
    assert (note is not None) == noted, note
    if noted:
        assert note.startswith("[CONFIG] note: every epoch validates all 10000 validation images")
        assert "--val-samples N" in note


@pytest.mark.parametrize(
    "epoch, step, said",
    [
        (2, 0, "after epoch 1: resumes at epoch 2"),
        (2, 106, "after step 106 of epoch 2: resumes there"),
        (1, 0, "before any step: resumes at epoch 1"),
    ],
)
def test_a_checkpoints_position_in_words(epoch, step, said):
    assert checkpoint.Position(epoch, step).resumes == said


def test_the_oldest_torch_is_requirements_floor():
    """requirements.txt lets pip install no torch that main.py refuses, nor refuses one it runs."""
    floor = re.search(r"^torch>=(\d+)\.(\d+),", (REPO / "requirements.txt").read_text(), re.M)
    assert (int(floor[1]), int(floor[2])) == du.OLDEST_TORCH


def test_num_nodes():
    assert du.num_nodes({}) == 1
    assert du.num_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == 2
    step = {"SLURM_JOB_NUM_NODES": "3", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_ID": "0"}
    assert du.num_nodes(step) == 2


def test_the_course_cnn_its_size_and_shapes():
    model = build_model("cnn")
    # conv 3->16->32->64 (3x3) and fc 1024->512->10, with biases.
    expected = (3 * 16 + 16 * 32 + 32 * 64) * 9 + 16 + 32 + 64 + 1024 * 512 + 512 + 512 * 10 + 10
    assert count_parameters(model) == expected == 553_514
    for batch in (1, 7, 256):  # any batch size
        assert model(torch.randn(batch, 3, 32, 32)).shape == (batch, 10)
    with pytest.raises(AssertionError, match=r"\(N, 3, 32, 32\)"):
        model(torch.randn(2, 3, 28, 28))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_config_knows_every_models_units(name):
    """config.MODEL_UNITS (torch-free, for --check and the sweep) is what the model names."""
    from config import MODEL_UNITS

    assert MODEL_UNITS.keys() == MODELS.keys()
    assert MODEL_UNITS[name] == len(build_model(name).shard_units())


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
@pytest.mark.parametrize("parts,first_units", [(1, [0]), (2, [0, 2]), (4, [0, 1, 2, 3])])
def test_cut_parts_compute_the_model_and_hold_its_units(name, parts, first_units):
    """Run one after the other, the parts compute the model's output to the bit; each starts
    at its unit, holds the same number of units, and their state dicts make up the model's
    with the model's own names."""
    from model import cut

    torch.manual_seed(0)
    model = build_model(name).eval()
    pieces = cut(model, parts)
    units = model.shard_units()
    assert len(pieces) == parts
    for part, first in zip(pieces, first_units):
        held = [u for u in units if any(u is m for m in part.children())]
        assert held[0] is units[first] and len(held) == len(units) // parts
    x = torch.randn(3, 3, 32, 32)
    y = x
    for part in pieces:
        y = part(y)
    assert torch.equal(y, model(x))
    keys = [k for part in pieces for k in part.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())  # no key twice, none missing
    with pytest.raises(ValueError, match="do not cut into 3 equal parts"):
        cut(model, 3)


def test_a_trainer_is_built_with_keywords():
    """Trainer's fields are named where it is built: no row of positional Nones to miscount."""
    from train import Learner, Trainer

    with pytest.raises(TypeError):
        Learner(None, None, None, None)
    with pytest.raises(TypeError):  # a trainer has loaders and its meters
        Trainer(model=None, optimizer=None, precision=None, env=None)
    learner = Learner(model=None, optimizer=None, precision=None, env=None)
    assert learner.grad_accum == 1 and learner.clip_grad is None


def test_time_stamped_names_are_never_an_earlier_ones(tmp_path, monkeypatch):
    """One function names the sweeps' folders and what a job id names for a run without SLURM
    (local_id: its checkpoints, traces, a local sweep's logs, verify's folder): the time, then
    -2, -3, ... where a run started in the same second took the name (before any suffix). Its
    [METRIC] lines say job_id=local."""
    monkeypatch.setattr(layout.time, "strftime", lambda fmt: "20260101-120000")
    monkeypatch.setattr(layout, "LOGS_DIR", tmp_path)
    assert (layout.job_id({}), layout.job_id({"SLURM_JOB_ID": "42"})) == ("local", "42")
    assert layout.run_id({}) == "local-20260101-120000"
    assert layout.run_id({"SLURM_JOB_ID": "42"}) == "42"
    stem = layout.log_stem("ddp_2gpu", layout.local_id())
    log = layout.free_path(tmp_path, stem, ".log")
    assert log.name == "ddp_2gpu_local-20260101-120000.log"
    log.touch()
    assert layout.free_path(tmp_path, stem, ".log").name == "ddp_2gpu_local-20260101-120000-2.log"
    assert layout.verify_folder("42") == tmp_path / "verify-42"
    assert layout.verify_folder(layout.LOCAL_JOB).name == "verify-local-20260101-120000"
    assert layout.next_sweep_folder(tmp_path).name == "sweep-20260101-120000"
    (tmp_path / "sweep-20260101-120000").mkdir()
    (tmp_path / "sweep-20260101-120000-2").mkdir()
    assert layout.next_sweep_folder(tmp_path).name == "sweep-20260101-120000-3"


@pytest.mark.parametrize(
    "args,env",
    [
        (["--help"], {}),  # stdout, exit status 0
        (["--epochs", "two"], {}),  # stderr, exit status 2
        ([], {"WORLD_SIZE": "2", "RANK": "5"}),  # the environment it is given, read by main.py
    ],
)
def test_a_forked_main_py_answers_as_python_main_py_does(args, env):
    """What conftest.run_main and start_ranks start for the repository's main.py
    (dist_harness.ForkedMain, forked from a server that has imported the project) answers as
    `python main.py` does: the same exit status, stdout and stderr."""
    forked = ForkedMain(args, REPO, clean_environment(**env))
    out, err = forked.communicate(timeout=60)
    fresh = run([sys.executable, "main.py", *args], **env)
    assert (forked.returncode, out, err) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_forked_main_py_is_killed_as_a_process_is():
    """The fault tests SIGKILL ranks that start_ranks forked: a process of its own, its death
    reported as Popen reports it."""
    forked = ForkedMain([*LONG_RUN, "--no-checkpoint"], REPO, clean_environment())
    # It runs main.py: training begins (under torch 2.10 gloo first prints its connections).
    assert any(line.startswith("[CONFIG]") for line in forked.stdout)
    forked.kill()
    assert forked.wait(timeout=30) == -9 and forked.pid != os.getpid()


@pytest.mark.parametrize("own", [None, "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"])
def test_nccls_flight_recorder_dumps_into_the_jobs_log_folder(tmp_path, monkeypatch, own):
    """On GPUs each rank's last collectives are dumped on a timeout, named by job and rank.
    torch 2.9 renamed the buffer's setting and warns, twice a rank, about the old name: every
    torch the project allows reads the new one, so the project sets that one alone, and never
    beside a size the job set under either name."""
    assert du.OLDEST_TORCH >= du.FR_BUFFER_SIZE_SINCE, "a torch that knows only the old name"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    dump = ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    for name in (du.FR_BUFFER_SIZE, du.FR_BUFFER_SIZE_OLD, *dump):
        monkeypatch.delenv(name, raising=False)
    if own:
        monkeypatch.setenv(own, "50")
    du.turn_on_flight_recorder(tmp_path / "nccl-trace")
    sizes = {n: os.environ.get(n) for n in (du.FR_BUFFER_SIZE, du.FR_BUFFER_SIZE_OLD)}
    expected = {du.FR_BUFFER_SIZE: "2000", du.FR_BUFFER_SIZE_OLD: None}
    assert sizes == (expected if own is None else {n: "50" if n == own else None for n in sizes})
    assert [os.environ[n] for n in dump] == ["1", str(tmp_path / "nccl-trace" / "77_rank")]
    assert (tmp_path / "nccl-trace").is_dir()


# Modules that take most of a second or more to import, on every rank of every launch: (the
# module, code that needs it). torchvision serves the ResNets (and the classic loader,
# downloads); torch's pipelining a pipeline. A DDP run of the CNN, start to end, needs neither.
LAZY_IMPORTS = [
    ("torchvision", "session.build_model('resnet18')"),
    (
        "torch.distributed.pipelining",
        "assert session.trainer_class(True).__name__ == 'PipelineTrainer'",
    ),
]
DDP_RUN = [*TINY, *"--batch-size 64 --epochs 1 --no-checkpoint".split()]


# What a data-parallel run imports but `main.py --check` must not: FSDP, DTensor and DCP, most
# of a second of every check (run.sh's before each launch, the sweep's per configuration).
SHARDING_IMPORTS = [
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
]


def test_check_finds_device_data_and_checkpoint_without_the_sharding_imports(tmp_path):
    """--check of an FSDP2 run resuming from a folder of checkpoints finds the checkpoint and
    reads its meta.pt (or it would exit 2, or 5 for an unreadable one) and loads no wrapper and
    no DCP."""
    (tmp_path / "ckpt_e0002_s000000").mkdir()
    # What checkpoint.save writes of an FSDP2 run at world size 2, after epoch 1.
    identity = checkpoint.Identity("fsdp2", "cnn", count_parameters(build_model("cnn")), 256)
    meta = {"position": {"epoch": 2}, "identity": asdict(identity), "world_size": 2}
    torch.save(meta, tmp_path / "ckpt_e0002_s000000" / checkpoint.META_FILE)
    check = [*TINY, "--strategy", "fsdp2", "--resume", str(tmp_path), "--check", "1", "2"]
    probe = (
        "import sys, main\n"
        f"assert main.main({check!r}) == 0\n"
        f"loaded = [m for m in {SHARDING_IMPORTS!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = run([sys.executable, "-c", probe], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "check: ok: strategy=fsdp2 world sizes 1 2" in done.stdout, done.stdout


def test_a_rank_loads_torch_without_collecting_and_only_the_imports_its_run_needs():
    """main.py loads torch and the project with Python's collector off, and setup() freezes
    what they made and turns it back on: no collection runs between torch's import and the
    freeze, and the later ones (the training loop's, cleanup()'s) skip those objects
    (docs/development.md: what each saves, and what the thaw costs). At exit they thaw, so that
    Python's teardown frees them: frozen, triton's (torch 2.15) are reported by nanobind as
    leaked, a line each on stderr. An exit hook registered first runs last, after the thaw. A
    slow import (LAZY_IMPORTS) waits for the run that needs it."""
    probe = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
        "early = []\n"
        "def note(phase, info):\n"
        "    if phase == 'start' and 'torch' in sys.modules and not gc.get_freeze_count():\n"
        "        early.append(info['generation'])\n"
        "gc.callbacks.append(note)\n"
        "import main\n"
        f"assert main.main({DDP_RUN!r}) == 0\n"
        "assert not early, f'{len(early)} collections while torch loaded, {early.count(2)} full'\n"
        "assert gc.isenabled() and gc.get_freeze_count() > 200_000, gc.get_freeze_count()\n"
        "import session, strategies\n"
        "assert session.trainer_class(False) is session.Trainer\n"
        f"for module, needing in {LAZY_IMPORTS!r}:\n"
        "    assert module not in sys.modules, f'{module}: loaded by a run that does not need it'\n"
        "    exec(needing)\n"
        "    assert module in sys.modules, module\n"
    )
    done = run([sys.executable, "-c", probe], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "frozen at exit: 0", done.stdout[-2000:]
    assert done.stderr == "", done.stderr[-2000:]


def test_a_pulse_listens_only_on_the_address_its_peers_reach_it_at():
    """Not on every interface: bound to the one address it leaves at the store for its peers."""
    import peer_failures

    class Store(dict):
        set = dict.__setitem__

    store = Store()
    pulse = peer_failures.Pulse(store, 0, "127.0.0.1")
    try:
        host, port = store["pulse/0"].split()
        assert pulse.server.getsockname()[:2] == (host, int(port)) == ("127.0.0.1", int(port))
        assert peer_failures.answers((host, int(port)))
    finally:
        pulse.stop()

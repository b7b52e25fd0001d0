"""What the tests share, written once: the tiny run's arguments, running or starting a command
as a user would (without the SLURM variables of a surrounding job), reading `[METRIC]` and
`[CONFIG]` lines, a scratch copy of the repository, and the project's loopback SLURM cluster
(.ci/slurm/start.sh) for the tests marked `slurm`; and the check that a session leaves no file in
the repository."""

import inspect
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from utils import parse_config, parse_metric

# One torch thread per process, for the tests' own training and every process they start, as
# torchrun does per rank: make test runs two workers on two cores (pytest_xdist_make_scheduler),
# and torch's default of a thread per core had each worker's runs contend for both cores
# (docs/development.md#test-tiers). Set before any test module imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A suite started in the background (`make test &`, nohup) inherits SIGINT ignored, and so would
# every command the tests start: a bash script cannot trap a signal ignored at its start, and
# run.sh's Ctrl-C could not be tested. Taken back as a terminal's foreground job has it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = Path(os.environ.get("PROJECT_SLURM_DIR", "/tmp/project-slurm"))
START_TIMEOUT_S = 600  # on a clean machine, installing the packages comes first

# A run of seconds: synthetic data (no download), few images, no progress lines. Tests add
# --epochs, --batch-size and what they test.
TINY = "--dataset synthetic --train-samples 256 --val-samples 64 --print-every 1000".split()
# TINY as session.run's Config fields.
TINY_CFG = dict(dataset="synthetic", train_samples=256, val_samples=64, print_every=1000)

# A run long enough to be signalled during its first epoch (128 steps of 32 images), with a
# progress line every 20 steps to signal it on.
LONG_RUN = (
    "--dataset synthetic --train-samples 4096 --val-samples 64 --batch-size 32 --epochs 2 "
    "--print-every 20"
).split()

# torchrun on this machine alone (its own rendezvous): add --nproc_per_node and the program.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def clean_environment(**extra) -> dict:
    """This environment without the variables of a surrounding launcher (pytest may itself run
    inside a SLURM job or under torchrun, and run.sh would then launch with srun), with the
    tests' Python for run.sh and the plots."""
    launcher = ("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    return {**env, "PYTHON": sys.executable, **extra}


def run(command: list, cwd=REPO, timeout=60, **env) -> subprocess.CompletedProcess:
    """A command as a user runs it (text output captured), with clean_environment(**env). One
    that outlives `timeout` fails the test with the end of what it printed: where it hung
    (subprocess's own error shows only the first lines)."""
    try:
        return subprocess.run(
            [str(c) for c in command],
            cwd=cwd,
            env=clean_environment(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as hung:  # its output is bytes here, whatever text= said
        ends = [(s or b"").decode(errors="replace")[-4000:] for s in (hung.stdout, hung.stderr)]
        pytest.fail(
            f"{hung.cmd} timed out after {timeout} s; it printed, at the end:\n"
            + "\n--- stderr:\n".join(ends),
            pytrace=False,
        )


def popen(command: list, cwd=REPO, **env) -> subprocess.Popen:
    """A command started as a user starts it (text pipes for stdout and stderr), with
    clean_environment(**env): for a test that acts on it while it runs."""
    return subprocess.Popen(
        [str(c) for c in command],
        cwd=cwd,
        env=clean_environment(**env),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def benchmarks(*args, cwd=REPO, timeout=60, **env) -> subprocess.CompletedProcess:
    """run_benchmarks.py, the copy in cwd, as a user runs it there."""
    return run([sys.executable, Path(cwd) / "run_benchmarks.py", *args], cwd, timeout, **env)


def forks(program: str, cwd, env: dict) -> bool:
    """Whether a plain-python start of program runs forked from the server that has imported
    the project (dist_harness.ForkedMain: the same `__main__` block, argv, folder and
    environment, without seconds of imports): the repository's own main.py, with no variable
    of the test's own (a fresh interpreter reads some at start-up, PYTHONPATH or TORCH_LOGS)."""
    return program == "main.py" and cwd == REPO and not env


def run_main(
    args: list, nproc: int | None = None, cwd=REPO, timeout=240, **env
) -> subprocess.CompletedProcess:
    """main.py as a user starts it: plain python (forked where `forks` says so), or torchrun
    with nproc ranks."""
    if nproc is None and forks("main.py", cwd, env):
        from dist_harness import ForkedMain

        started = ForkedMain(args, cwd, clean_environment())
        try:
            out, err = started.communicate(timeout=timeout)
        finally:
            started.kill()
        return subprocess.CompletedProcess(started.args, started.returncode, out, err)
    launcher = [*TORCHRUN, f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    return run([*launcher, "main.py", *args], cwd=cwd, timeout=timeout, **env)


def call_main(main, capsys, *args) -> tuple[int, str, str]:
    """A script's main(argv) called in this process, as its command line would: (exit status,
    stdout, stderr), also where it ends in SystemExit (argparse)."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def stop_at_first_progress(
    args: list, cwd, timeout: float = 60, sig=signal.SIGUSR1
) -> subprocess.CompletedProcess:
    """main.py with `args` (one process, as a user starts it), sent `sig` once its first progress
    line of epoch 1 is out; it runs to its end."""
    proc = popen([sys.executable, "main.py", *args], cwd)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("epoch 1 step"):
                proc.send_signal(sig)
                break
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(seen) + out, err)


def metrics_in(text: str) -> list[dict]:
    """The `[METRIC]` lines of a log, parsed."""
    return [m for m in map(parse_metric, text.splitlines()) if m]


def config_in(text: str) -> dict:
    """The first `[CONFIG]` line of a log, parsed: the run's own."""
    return next(filter(None, map(parse_config, text.splitlines())))


def assert_breakdown_holds(m: dict) -> None:
    """No part is negative; reliable ones add up to the epoch's time; an unreliable one says it
    and reports neither compute nor the rest. The rest is t_comm where the run sends, t_other
    where it does not (one rank on one device): its communication is then 0."""
    from utils import TIME_PARTS

    assert all(m[t] == "na" or m[t] >= 0 for t in TIME_PARTS), m
    if m["world_size"] > 1:
        rest, nothing = "t_comm", "t_other"
    elif m["strategy"] not in ("dp", "model"):  # which may drive several GPUs from one rank
        rest, nothing = "t_other", "t_comm"
    else:
        rest, nothing = None, None
    if nothing:
        assert m[nothing] == 0, m
    if m["breakdown"] == "ok":
        assert sum(m[t] for t in TIME_PARTS) == pytest.approx(m["time"], rel=1e-3, abs=0.01)
        assert m["t_compute"] > 0  # measured, not zero
    else:
        assert m["breakdown"] == "unreliable" and m["t_compute"] == "na", m
        assert rest is None or m[rest] == "na", m


def assert_one_line_error(
    done: subprocess.CompletedProcess, *fragments: str, status: int = 2
) -> str:
    """The user's view of bad input: exit status `status`, exactly one `error:` line holding
    every fragment, and no Python traceback anywhere in the output. Returns the line."""
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert done.returncode == status, (done.returncode, output[-3000:])
    assert len(errors) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def copy_repo(folder: Path) -> Path:
    """The repository's programs in a scratch directory, so that the logs, job scripts,
    results.csv and plots/ a test makes never mix with the real ones."""
    for pattern in ("*.py", "*.sh", "*.toml"):
        for path in REPO.glob(pattern):
            shutil.copy2(path, folder / path.name)
    (folder / "logs").mkdir()
    return folder


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    return copy_repo(tmp_path)


def _controller_up(env: dict) -> bool:
    # Without its configuration file, scontrol would retry for a minute before giving up.
    if shutil.which("scontrol") is None or not Path(env["SLURM_CONF"]).is_file():
        return False
    ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=30)
    return "is UP" in ping.stdout


def _start_error(stderr: str) -> str:
    """start.sh's own error line (daemon log tails follow it), else its last line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    ours = [line.split("error: ", 1)[1] for line in lines if line.startswith("[start.sh] error: ")]
    return (ours or lines or ["no output"])[0 if ours else -1]


def _stop(env: dict) -> None:
    subprocess.run([REPO / ".ci" / "slurm" / "stop.sh"], env=env, capture_output=True, timeout=120)


# The files whose tests share a fixture built once for the file or the session (a trained
# reference, the loopback SLURM cluster): make test runs each of them on one worker, so that
# the fixture is built once. Collection refuses a file that shares one and is not listed.
ONE_WORKER_FILES = {
    "test_data.py",
    "test_equivalence.py",
    "test_exercise.py",
    "test_features.py",
    "test_pipeline.py",
    "test_resume.py",
    "test_run_sh.py",
    "test_slurm.py",
    "test_strategies.py",
    "test_trust.py",
}


def _shares_a_fixture(item) -> bool:
    """Whether the test uses a fixture of the tests' own built once per file or session."""
    return any(
        defs[-1].scope in ("module", "session")
        and Path(inspect.getfile(defs[-1].func)).parent == REPO / "tests"
        for defs in item._fixtureinfo.name2fixturedefs.values()
    )


def pytest_collection_modifyitems(items):
    """The longest chains first, so that no worker of make test ends the suite alone: the SLURM
    tests (all in test_slurm.py), the tests marked slow, the files run on one worker; the short
    tests fill the end."""
    unlisted = {item.path.name for item in items if _shares_a_fixture(item)} - ONE_WORKER_FILES
    if unlisted:
        raise pytest.UsageError(f"conftest.ONE_WORKER_FILES lacks {', '.join(sorted(unlisted))}")

    def chain(item) -> int:
        if "slurm_env" in item.fixturenames:
            return 0
        if item.get_closest_marker("slow"):
            return 1
        return 2 if item.path.name in ONE_WORKER_FILES else 3

    items.sort(key=chain)


def pytest_xdist_make_scheduler(config, log):
    """make test's two pytest-xdist workers: each test goes to whichever worker is free, in
    the collected order, except that a file of ONE_WORKER_FILES goes whole to one worker."""
    from xdist.scheduler import LoadScopeScheduling

    class FilesOfSharedFixturesWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).name in ONE_WORKER_FILES else nodeid

    config.option.loadscopereorder = False  # keep pytest_collection_modifyitems's order
    return FilesOfSharedFixturesWhole(config, log)


# ----------------------------------------------------------------------------- a clean repository

# What a session may add to the repository: Python's byte code and the tools' caches. Anything
# else (checkpoints/local-*, logs/, data/, results.csv) is a test that ran a tool in the
# repository rather than in tmp_path or repo_copy, or trained there without --no-checkpoint.
ALLOWED_LEFTOVERS = ("__pycache__/", "/.pytest_cache/", "/.ruff_cache/", "/.venv*")
UNTRACKED = pytest.StashKey[set]()
LEFT_BEHIND = pytest.StashKey[list]()


def untracked_files() -> set[str] | None:
    """The repository's files that git does not track, ignored ones included (a few ms); None
    outside a git checkout."""
    excludes = [f"--exclude={pattern}" for pattern in ALLOWED_LEFTOVERS]
    try:
        done = subprocess.run(
            ["git", "-C", REPO, "ls-files", "--others", *excludes],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError:  # no git
        return None
    return set(done.stdout.splitlines()) if done.returncode == 0 else None


def pytest_sessionstart(session):
    """Under pytest-xdist the controller alone compares, once every worker has finished."""
    if not hasattr(session.config, "workerinput") and (files := untracked_files()) is not None:
        session.config.stash[UNTRACKED] = files


def pytest_sessionfinish(session):
    """A session that left files in the repository fails, whatever its tests said."""
    before = session.config.stash.get(UNTRACKED, None)
    if before is None:
        return
    left = sorted((untracked_files() or before) - before)
    if left:
        session.config.stash[LEFT_BEHIND] = left
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    left = config.stash.get(LEFT_BEHIND, [])
    if not left:
        return
    terminalreporter.section("files left in the repository", red=True)
    for path in left[:10]:
        terminalreporter.write_line(path)
    if len(left) > 10:
        terminalreporter.write_line(f"... and {len(left) - 10} more")
    terminalreporter.write_line(
        f"error: the tests left {len(left)} file(s) in {REPO}: a test ran a tool there (run it "
        "in tmp_path or repo_copy, or add --no-checkpoint), or something else wrote there "
        "meanwhile"
    )


@pytest.fixture(scope="session")
def slurm_env() -> dict:
    """The environment in which SLURM commands reach the project's cluster (SLURM_CONF set).

    Starts the cluster (installing SLURM first if needed) and stops it after the session,
    unless it was already running. Where that is impossible the tests are skipped with the
    reason, except under CI (CI=true, as root), where they fail.
    """
    if os.geteuid() != 0:
        pytest.skip("the loopback SLURM cluster needs root: it installs packages, starts daemons")
    env = clean_environment(
        PROJECT_SLURM_DIR=str(SLURM_DIR), SLURM_CONF=str(SLURM_DIR / "etc" / "slurm.conf")
    )
    was_running = _controller_up(env)
    try:
        start = subprocess.run(
            [REPO / ".ci" / "slurm" / "start.sh"],
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
        failure = start.returncode and _start_error(start.stderr)
    except subprocess.TimeoutExpired:
        failure = f"no cluster after {START_TIMEOUT_S} s"
    if failure:
        _stop(env)  # whatever the partial start left running
        message = f"cannot start the loopback SLURM cluster: {failure}"
        if os.environ.get("CI"):  # CI runs as root: a green run must include these tests
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    yield env
    if not was_running:
        _stop(env)


def start_ranks(
    args: list, world_size: int, cwd=REPO, program="main.py", **env
) -> list[subprocess.Popen]:
    """main.py (or a program that runs it) as world_size processes started directly, as srun
    starts its tasks (no torchrun agent between the test and the ranks): each rank's own
    signals and exit status are seen. Forked where `forks` says so (dist_harness.ForkedMain, a
    Popen in all but that)."""
    from dist_harness import ForkedMain, free_port, launcher_variables

    port = free_port()

    def rank_environment(rank: int) -> dict:
        ours = launcher_variables(rank, world_size, port)
        return {**ours, "OMP_NUM_THREADS": "1", **env}  # a test may override ours

    if forks(program, cwd, env):
        return [
            ForkedMain(args, cwd, clean_environment(**rank_environment(rank)))
            for rank in range(world_size)
        ]
    return [
        popen([sys.executable, program, *args], cwd, **rank_environment(rank))
        for rank in range(world_size)
    ]


def main_on_ranks(
    args: list, world_size: int, timeout: float = 240, **env
) -> tuple[subprocess.CompletedProcess, list[int]]:
    """main.py on world_size ranks started directly (start_ranks, as srun starts them), run to
    their end: what torchrun would report of them, without its agent (every rank's stdout and
    stderr in rank order, the first non-zero exit status, else 0), and each rank's status."""
    if world_size == 1:
        done = run_main(args, timeout=timeout, **env)
        return done, [done.returncode]
    ranks = start_ranks(args, world_size, **env)
    try:
        outputs = [rank.communicate(timeout=timeout) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    statuses = [rank.returncode for rank in ranks]
    out, err = ("".join(output[i] for output in outputs) for i in (0, 1))
    status = next((s for s in statuses if s), 0)
    return subprocess.CompletedProcess(ranks[0].args, status, out, err), statuses

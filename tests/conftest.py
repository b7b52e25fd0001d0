"""Fixtures shared by the launcher tests: a scratch copy of the repository, and the project's
loopback SLURM cluster (.ci/slurm/start.sh) for the tests marked `slurm`."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = Path(os.environ.get("PROJECT_SLURM_DIR", "/tmp/project-slurm"))
START_TIMEOUT_S = 600  # on a clean machine, installing the packages comes first


def clean_environment(**extra) -> dict:
    """This environment without SLURM's job variables (pytest may itself run inside a job,
    and run.sh would then launch with srun), with the tests' Python for run.sh and plots."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "PYTHON": sys.executable, **extra}


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    """The repository's programs in a scratch directory, so that the logs, job scripts,
    results.csv and plots/ a test makes never mix with the real ones."""
    for pattern in ("*.py", "*.sh", "*.toml"):
        for path in REPO.glob(pattern):
            shutil.copy2(path, tmp_path / path.name)
    (tmp_path / "logs").mkdir()
    return tmp_path


def _controller_up(env: dict) -> bool:
    # Without its configuration file, scontrol would retry for a minute before giving up.
    if shutil.which("scontrol") is None or not Path(env["SLURM_CONF"]).is_file():
        return False
    ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True,
                          timeout=30)
    return "is UP" in ping.stdout


def _start_error(stderr: str) -> str:
    """start.sh's own error line (daemon log tails follow it), else its last line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    ours = [line.split("error: ", 1)[1] for line in lines if line.startswith("[start.sh] error: ")]
    return (ours or lines or ["no output"])[0 if ours else -1]


def _stop(env: dict) -> None:
    subprocess.run([REPO / ".ci" / "slurm" / "stop.sh"], env=env, capture_output=True,
                   timeout=120)


@pytest.fixture(scope="session")
def slurm_env() -> dict:
    """The environment in which SLURM commands reach the project's cluster (SLURM_CONF set).

    Starts the cluster (installing SLURM first if needed) and stops it after the session,
    unless it was already running. Skips the tests, with the reason, where that is impossible.
    """
    if os.geteuid() != 0:
        pytest.skip("the loopback SLURM cluster needs root: it installs packages, starts daemons")
    env = clean_environment(PROJECT_SLURM_DIR=str(SLURM_DIR),
                            SLURM_CONF=str(SLURM_DIR / "etc" / "slurm.conf"))
    was_running = _controller_up(env)
    try:
        start = subprocess.run([REPO / ".ci" / "slurm" / "start.sh"], env=env,
                               capture_output=True, text=True, timeout=START_TIMEOUT_S)
        failure = start.returncode and _start_error(start.stderr)
    except subprocess.TimeoutExpired:
        failure = f"no cluster after {START_TIMEOUT_S} s"
    if failure:
        _stop(env)  # whatever the partial start left running
        pytest.skip(f"cannot start the loopback SLURM cluster: {failure}")
    yield env
    if not was_running:
        _stop(env)


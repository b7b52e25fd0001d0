"""pick_python.sh, the one answer of run.sh and plot_results.sh to "which Python?": both take the
same interpreter in every situation, and a Python without what a script needs (before `make
install`) is one `error:` line that says so, not a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error, clean_environment
from helpers import executable

pytestmark = pytest.mark.fast  # make test-fast


def environment(**changes) -> dict:
    """clean_environment() without the variables that choose a Python, then `changes`."""
    env = {k: v for k, v in clean_environment().items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    return {**env, **changes}


def script(cwd: Path, name: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", name, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def without_site_packages(folder: Path) -> Path:
    """A python3 as a fresh machine's: the standard library only (no pandas, no torch)."""
    return executable(folder / "python3", f'exec "{sys.executable}" -S "$@"')


def test_plot_results_before_make_install_says_to_run_it(repo_copy, tmp_path):
    """No .venv, no PYTHON, a python3 without pandas on PATH: one line naming that Python, what
    it lacks and `make install`, exit status 2, nothing written."""
    bare = without_site_packages(tmp_path / "bin")
    done = script(
        repo_copy, "plot_results.sh", environment(PATH=f"{bare.parent}:{os.environ['PATH']}")
    )
    line = assert_one_line_error(
        done, "python3 cannot import pandas, matplotlib", "run 'make install'"
    )
    assert done.stderr.splitlines()[-1] == line
    assert not (repo_copy / "results.csv").exists() and not (repo_copy / "plots").exists()


def test_plot_results_names_the_python_it_was_given(repo_copy, tmp_path):
    bare = without_site_packages(tmp_path / "bin")
    done = script(repo_copy, "plot_results.sh", environment(PYTHON=str(bare)))
    assert_one_line_error(done, f"{bare} cannot import pandas", "make install")
    missing = script(repo_copy, "plot_results.sh", environment(PYTHON=str(tmp_path / "none")))
    assert_one_line_error(missing, f"no Python '{tmp_path / 'none'}' to run", "make install")


@pytest.mark.parametrize("chooser", ["PYTHON", "VIRTUAL_ENV", ".venv"])
def test_run_sh_and_plot_results_sh_take_the_same_python(repo_copy, tmp_path, chooser):
    """$PYTHON first, then the active virtual environment, then the repository's .venv: a
    stand-in that has no module at all shows which one each script ran."""
    venv = repo_copy / ".venv" if chooser == ".venv" else tmp_path / "venv"
    python = executable(venv / "bin" / "python", "exit 1")
    choosers = {"PYTHON": str(python), "VIRTUAL_ENV": str(venv)}  # .venv: neither set
    env = environment(**{name: value for name, value in choosers.items() if name == chooser})
    run_sh = script(repo_copy, "run.sh", env, "--epochs", "1")
    assert_one_line_error(run_sh, f"{python} cannot import torch", "make install")
    plots = script(repo_copy, "plot_results.sh", env)
    assert_one_line_error(plots, f"{python} cannot import pandas, matplotlib", "make install")


def test_pick_python_order():
    def picked(*args: str, **env: str) -> str:
        done = subprocess.run(
            ["bash", "-c", 'source pick_python.sh; pick_python "$@"', "-", *args],
            cwd=REPO,
            env=environment(**env),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    nowhere = "/nonexistent-repository"
    assert picked(nowhere) == "python3"
    assert picked(str(REPO)) == (
        str(REPO / ".venv/bin/python") if (REPO / ".venv/bin/python").exists() else "python3"
    )
    assert picked(nowhere, VIRTUAL_ENV="/v") == "/v/bin/python"
    assert picked(nowhere, "yes", VIRTUAL_ENV="/v") == "python"  # the container's own
    assert picked(nowhere, "yes", PYTHON="/p", VIRTUAL_ENV="/v") == "/p"

"""docs/gpu-runs/next_run.sh, the next GPU's checks in one device call, run here with a stand-in
Python: the steps it runs are those docs/gpu-runs/README.md lists, in order; it ends by its
deadline, at most 540 s (the call's 600 s less the machine's start and the copy back), a stalled
command cut and the steps after it skipped, each said so; a failing step stops no other and
lands in the summary with its status, as does a step whose shell ends before its verdict, and
the script's status is 1; and every main.py command line it runs passes --check.
"""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

import main
from conftest import REPO

pytestmark = pytest.mark.fast  # make test-fast

SCRIPT = REPO / "docs" / "gpu-runs" / "next_run.sh"
README = SCRIPT.with_name("README.md")
CALL_BUDGET_S = 540
DEADLINE = re.compile(r"^DEADLINE_S=\$\{DEADLINE_S:-(\d+)\}$", re.M)
README_STEP = re.compile(r"^\| (\d) \| `([\w-]+)` \|", re.M)
SUMMARY_STEP = re.compile(r"^(\d) (\S+) +(PASS|REFUSED|SKIPPED|FAIL \([^)]*\)) *(.*)$", re.M)

# The machine's python3, stood in for: records its arguments, then, where an argument is the one
# STUB_SLEEP, STUB_FAIL, STUB_REFUSE or STUB_END_STEP names, hangs, fails with a traceback,
# refuses in one line as main.py does (status 2), or ends the shell that runs its step (the
# parent of its `timeout`); else succeeds (under --profile, naming a trace it wrote).
STUB = """#!/bin/bash
echo "$*" >>"$STUB_LOG"
has() { [[ -n $1 && " ${*:2} " == *" $1 "* ]]; }
has "${STUB_SLEEP:-}" "$@" && exec sleep 60
has "${STUB_END_STEP:-}" "$@" && exec kill -9 "$(ps -o ppid= -p "$PPID")"
if has "${STUB_FAIL:-}" "$@"; then
    printf 'Traceback (most recent call last):\\nRuntimeError: planted\\n' >&2
    exit 1
fi
if has "${STUB_REFUSE:-}" "$@"; then
    echo "error: $STUB_REFUSE: planted refusal" >&2
    exit 2
fi
if has --profile "$@"; then
    trace=$(mktemp)
    echo "[PROFILE] steps 4-6 (graphed) of each rank traced: $trace (the stand-in's)"
fi
"""


def run_script(tmp_path: Path, **env) -> tuple[list[tuple[str, ...]], float, int]:
    """next_run.sh with the stand-in Python and nvidia-smi: its summary's steps (stage, step,
    verdict, note), its wall time and its exit status."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", STUB), ("nvidia-smi", "#!/bin/bash\necho 'NVIDIA H200'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    environment = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PY": str(bin_dir / "python"),
        "OUT": str(tmp_path / "out"),
        "STUB_LOG": str(tmp_path / "args"),
        **env,
    }
    start = time.monotonic()
    done = subprocess.run(
        ["bash", SCRIPT], cwd=REPO, env=environment, capture_output=True, timeout=60
    )
    wall = time.monotonic() - start
    steps = SUMMARY_STEP.findall((tmp_path / "out" / "summary.txt").read_text())
    return steps, wall, done.returncode


def test_its_deadline_fits_one_device_call():
    (deadline,) = DEADLINE.findall(SCRIPT.read_text())
    assert int(deadline) <= CALL_BUDGET_S


def test_a_stalled_command_is_cut_by_the_deadline_and_what_follows_is_skipped(tmp_path):
    """The deadline 8 s: the environment step's python -c hangs; its timeout is what is left
    less the kill's grace (3 s), and no later command has the second it needs."""
    steps, wall, _ = run_script(tmp_path, DEADLINE_S="8", STUB_SLEEP="-c")
    assert wall < 8
    verdicts = [verdict for _, _, verdict, _ in steps]
    assert verdicts[0] == "FAIL (timed out)"
    assert set(verdicts[1:]) == {"SKIPPED"}
    log = (tmp_path / "out" / "2-equal-ddp" / "graphed.log").read_text()
    assert log.startswith("== skipped at t=") and "s left of the deadline, 15s needed: " in log


def test_a_failing_step_stops_no_other_and_its_status_is_in_the_summary(tmp_path):
    steps, _, status = run_script(tmp_path, STUB_FAIL="--grad-accum", STUB_REFUSE="--loader")
    assert status == 1
    verdicts = {name: (verdict, note) for _, name, verdict, note in steps}
    assert verdicts.pop("equal-grad-accum") == (
        "FAIL (status 1)",
        "status 1 graphed, 1 eager: RuntimeError: planted",
    )
    log = (tmp_path / "out" / "2-equal-grad-accum" / "graphed.log").read_text()
    assert "Traceback (most recent call last):\nRuntimeError: planted\n== rc=1 " in log
    # A graphed run refused in one line is an answer where the probe accepts one.
    assert verdicts.pop("classic-loader") == ("REFUSED", "error: --loader: planted refusal")
    assert {verdict for verdict, _ in verdicts.values()} == {"PASS"}


def test_a_step_whose_shell_ends_early_is_in_the_summary_as_failed(tmp_path):
    """resume-cpu's first command (the only one with --device) ends its step's shell: the
    step's provisional verdict stands, and the steps beside it still report."""
    steps, _, status = run_script(tmp_path, STUB_END_STEP="--device")
    verdicts = {name: (verdict, note) for _, name, verdict, note in steps}
    assert verdicts.pop("resume-cpu") == ("FAIL (no verdict)", "ended before its verdict")
    assert {verdict for verdict, _ in verdicts.values()} == {"PASS"}
    assert status == 1


def test_the_readme_lists_its_steps_and_every_main_py_command_line_passes_check(tmp_path, capsys):
    """--check judges them as on a CPU: eager (--cuda-graphs needs a GPU), and without the
    checkpoint to resume, which the script writes first."""
    steps, _, status = run_script(tmp_path)
    assert status == 0
    listed = README_STEP.findall(README.read_text())
    assert len(listed) > 20, "README.md lists no steps of next_run.sh"
    assert [(stage, name) for stage, name, *_ in steps] == listed
    lines = (tmp_path / "args").read_text().splitlines()
    command_lines = [
        line.split()[1:] for line in dict.fromkeys(lines) if line.startswith("main.py ")
    ]
    assert len(command_lines) > 20
    for args in command_lines:
        args = ["--no-cuda-graphs" if a == "--cuda-graphs" else a for a in args]
        if "--resume" in args:
            at = args.index("--resume")
            del args[at : at + 2]
        cfg, world_sizes = main.parse_command_line([*args, "--check"])
        assert main.check(cfg, world_sizes) == 0, args
    assert capsys.readouterr().out.count("check: ok:") == len(command_lines)

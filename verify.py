"""The cluster's acceptance test: what no test on a one-GPU machine can prove, checked in one
short job on the cluster itself (`python run_benchmarks.py --verify`; `--local` runs it here).

1. equivalence: DDP, FSDP and FSDP2 at the job's world size end an epoch with the parameters of
   one process trained on the same global batches: the tests' proof (gloo, one machine) on the
   cluster's backend, devices and links, where a reduction that drops or doubles a rank's share
   would show.
2. killed-rank: a rank killed (SIGKILL) mid-epoch ends the run within KILL_BOUND_S with one
   `error:` line: srun, the network and NCCL's watchdog of this cluster, not a localhost store.
3. stop-resume: SIGUSR1 to the job's step (SLURM's time-limit warning) stops every rank at one
   step with a checkpoint that every node writes to the shared file system (FSDP2: a shard a
   rank); the resumed run ends with the parameters of an uninterrupted one.
4. comm: `[COMM]` busbw of each collective at the model's message sizes and the sweep's largest,
   beside the transport NCCL chose and `nvidia-smi topo -m`; a warning where a multi-node run
   went over sockets.

Ranks are launched as users launch them: `run.sh` (srun inside the allocation, torchrun
without). Inside SLURM this process never signals run.sh itself, which would requeue the verify
job. Every run's log goes into the report's folder (logs/verify-<job id>/) beside report.md, a
row per check. Exit status 0 only when every check passed; one `error: verify: <check> failed`
line each.

    python verify.py [--out DIR] [--checks CHECK ...] [-- main.py options, e.g. --device cpu]
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from layout import VERIFY_REPORT, job_id, relative, verify_folder
from slurm_jobs import main_value, split_argv
from utils import EXIT_STATUS, fail, last_line, parse_comm
from verify_job import (
    DEFAULTS,
    WARNING,
    Row,
    print_outcome,
    refuse_verify_options,
    report_text,
)
from verify_runs import (
    Context,
    alone,
    finish,
    kill_rank,
    kill_task,
    launch,
    run,
    stop_all,
    tag,
    wait_for_progress,
)

KILL_BOUND_S = 120  # a dead rank must end the run within this (docs/failures.md: seconds)
STOPPED_STATUS = EXIT_STATUS["stopped"]

# Tolerance on the largest |parameter difference| after one epoch of 10 SGD steps, every run
# in float64: the ranks sum in another order than one process, a few ulps per operation. In
# fp32 that tipped ReLU and max-pool ties to 1e-4 apart at 4 ranks (a sound cluster FAILed); in
# fp64 the runs end 1e-16 apart. 1e-9 lies 7 orders above that and 7 below a rank's share
# missing or doubled (1e-2 and more: the planted bug of tests/test_verify.py). docs/verify.md.
TOLERANCE = 1e-9
COMPARED = "fp64"  # the --precision of the runs whose parameters are compared

# ----------------------------------------------------------------------------- the checks


class Failed(Exception):
    """A check that failed: its figure, and the log to read."""

    def __init__(self, figure: str, log: Path):
        super().__init__(figure)
        self.figure, self.log = figure, log


STEPS = 10  # equivalence: one epoch of this many global batches
# stop-resume: steps per epoch, for seconds of training left after the first progress line
# (step 10), when the signal goes out: this CNN's step takes 10 to 40 ms on a CPU (2 ranks on
# 2 cores, here and on the loopback cluster), a few ms on a GPU.
STOP_STEPS = {"cpu": 100, "cuda": 1000}
KILL_EPOCHS = 50  # killed-rank: a run far longer than KILL_BOUND_S
COLLECTIVES = {"all_reduce", "all_gather", "reduce_scatter"}  # comm: each must be measured


def settings(
    ctx: Context, steps: int, epochs: int, print_every: int, precision: str = "fp32"
) -> list[str]:
    """What makes N ranks equal one process (tests/dist_harness.py's EQUAL_CFG): no
    augmentation, SGD (Adam's step g / (sqrt(v) + eps) turns last-bit differences of near-zero
    gradients into steps of up to lr); the user's options in between. A share of 16 images per
    rank and step, the same global batches at any world size (8 a rank let a ReLU or max-pool
    tie tip 2 gloo ranks 3.7e-4 from one process after 10 steps). The checks that compare
    parameters run in COMPARED precision (see TOLERANCE), the others as users train."""
    batch = 16 * ctx.world_size
    return [
        *DEFAULTS,
        *ctx.extra,
        *f"--batch-size {batch} --train-samples {steps * batch} --val-samples {batch}".split(),
        *f"--epochs {epochs} --optimizer sgd --lr 0.05 --seed 7 --precision {precision}".split(),
        *f"--no-augment --print-every {print_every}".split(),
    ]


def ended(status: int | None) -> str:
    return "did not end in time (killed)" if status is None else f"ended with exit status {status}"


def run_to_end(ctx: Context, args: list[str], name: str, what: str) -> None:
    """A run through run.sh that must end with status 0; else the check fails, naming `what`."""
    status = run(ctx, args, name)
    if status != 0:
        raise Failed(f"{what} {ended(status)}", ctx.log(name))


def started(ctx: Context, args: list[str], name: str) -> subprocess.Popen:
    """A run through run.sh, once rank 0 printed a progress line (training runs)."""
    log = ctx.log(name)
    proc = launch(ctx, args, log)
    if not wait_for_progress(log, proc):
        raise Failed(f"training never started: {ended(finish(proc, 60))}", log)
    return proc


def max_diffs(ctx: Context, reference: Path, others: list[Path], log: Path) -> list[float]:
    """The largest |difference| between the final parameters of a reference run's checkpoint
    and each other run's (one process: torch loads once)."""
    done = alone(ctx, ["verify.py", "--max-diff", reference, *others], timeout=600)
    if done.returncode:
        raise Failed(f"cannot compare the checkpoints: {last_line(done.stderr)}", log)
    return [float(word) for word in done.stdout.split()]


def tolerated(diff: float) -> tuple[bool, str]:
    passed = diff <= TOLERANCE
    return passed, f"({'within' if passed else 'over'} tolerance {TOLERANCE:g})"


def check_equivalence(ctx: Context) -> Row:
    args = settings(ctx, STEPS, epochs=1, print_every=1000, precision=COMPARED)
    reference, ref_log = ctx.out / "ckpt-single", ctx.log("equivalence-single")
    done = alone(ctx, ["main.py", "--strategy", "single", *args, "--checkpoint-dir", reference])
    ref_log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise Failed(f"the one-process reference {ended(done.returncode)}", ref_log)
    folders = {s: ctx.out / f"ckpt-{s}" for s in ("ddp", "fsdp", "fsdp2")}
    for s, folder in folders.items():
        strategy_args = ["--strategy", s, *args, "--checkpoint-dir", str(folder)]
        run_to_end(ctx, strategy_args, f"equivalence-{s}", s)
    diffs = dict(zip(folders, max_diffs(ctx, reference, list(folders.values()), ref_log)))
    worst = ctx.log(f"equivalence-{max(diffs, key=diffs.get)}")
    figure = ", ".join(f"{s} {d:.3g}" for s, d in diffs.items())
    passed, verdict = tolerated(max(diffs.values()))
    where = f"max abs param diff vs 1 process at {ctx.world_size} ranks"
    return Row("equivalence", passed, f"{where}: {figure} {verdict}", relative(worst))


def check_killed_rank(ctx: Context) -> Row:
    name, victim = "killed-rank", ctx.world_size - 1
    log = ctx.log(name)
    args = settings(ctx, STOP_STEPS[ctx.device], epochs=KILL_EPOCHS, print_every=10)
    proc = started(ctx, ["--strategy", "ddp", *args, "--no-checkpoint"], name)
    if not kill_rank(ctx, tag(ctx, name), victim):
        finish(proc, 0)
        raise Failed(f"rank {victim}'s process was not found to kill", log)
    killed = time.monotonic()
    status = finish(proc, KILL_BOUND_S)
    seconds = time.monotonic() - killed
    naming = re.compile(rf"^error: .*\brank(\(s\))? {victim}\b")
    named = [line for line in log.read_text(errors="replace").splitlines() if naming.match(line)]
    figure = f"rank {victim} killed: the run {ended(status)} after {seconds:.1f} s"
    if status in (0, None) or not named:
        raise Failed(f"{figure} (bound {KILL_BOUND_S} s), {len(named)} error: line naming it", log)
    said = named[0].split("; last seen")[0]  # the rest names where each rank was
    return Row(name, True, f"{figure} (bound {KILL_BOUND_S} s): {said}", relative(log))


def check_stop_resume(ctx: Context) -> Row:
    name = "stop-resume"
    run_args = settings(ctx, STOP_STEPS[ctx.device], epochs=2, print_every=10, precision=COMPARED)
    args = ["--strategy", "fsdp2", *run_args, "--resume", "auto"]
    stopped, whole = ctx.out / "ckpt-stopped", ctx.out / "ckpt-uninterrupted"
    log = ctx.log(name)
    proc = started(ctx, [*args, "--checkpoint-dir", str(stopped)], name)
    if not stop_all(ctx, proc, tag(ctx, name)):
        finish(proc, 0)
        raise Failed("the ranks' step was not found to signal", log)
    stopped_with = finish(proc)
    text = log.read_text(errors="replace")
    at = re.search(r"\[CHECKPOINT\] stopped on SIGUSR1 at (epoch \d+ step \d+)", text)
    if not (at and stopped_with == STOPPED_STATUS):
        raise Failed(
            f"after SIGUSR1 the run {ended(stopped_with)}, not {STOPPED_STATUS} (stopped)", log
        )
    for part, folder in (("resumed", stopped), ("uninterrupted", whole)):
        part_args = [*args, "--checkpoint-dir", str(folder)]
        run_to_end(ctx, part_args, f"{name}-{part}", f"the {part} run")
    (diff,) = max_diffs(ctx, stopped, [whole], log)
    passed, verdict = tolerated(diff)
    return Row(
        name,
        passed,
        f"fsdp2 stopped at {at.group(1)} ({ended(stopped_with)}); resumed ends "
        f"{diff:.3g} from the uninterrupted run {verdict}",
        relative(ctx.log(f"{name}-resumed")),
    )


# NCCL_DEBUG=INFO's lines on the network and on each channel's transport: "Using network IB",
# "Channel 00/0 : 0[0] -> 1[1] via P2P/IPC", "via NET/IB/0/GDRDMA", "via NET/Socket/0",
# "via NET/AWS Libfabric/0" (the OFI plugin), "via SHM/direct/direct".
NCCL_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.MULTILINE)
NCCL_VIA = re.compile(r"NCCL INFO Channel .* via ((?:P2P|SHM|NET)/[^/\n]+)")


def nccl_transports(log: str) -> list[str]:
    """What NCCL chose: its networks, then the channels' transports, each once."""
    found = [f"network {n}" for n in NCCL_NETWORK.findall(log)] + NCCL_VIA.findall(log)
    return list(dict.fromkeys(t.strip() for t in found))


def over_sockets(transports: list[str]) -> bool:
    return any(t in ("network Socket", "NET/Socket") for t in transports)


def busbw_summary(rows: list[dict]) -> str:
    """The model's gradient all-reduce and each collective at the largest size measured."""
    largest = max(r["bytes"] for r in rows)
    picked = [r for r in rows if r["label"] == "grad"]
    picked += [r for r in rows if r["label"] == "sweep" and r["bytes"] == largest]
    return "; ".join(
        f"{r['op']} {r['label']} {r['bytes'] / 2**20:.3g} MiB {r['busbw_gbps']:.3g} GB/s"
        for r in picked
    )


def comm_table(rows: list[dict]) -> str:
    lines = ["| op | message | bytes | busbw GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['label']} | {r['bytes']} | {r['busbw_gbps']:.3g} |" for r in rows]
    return "\n".join(lines)


def keep_topology(ctx: Context) -> str:
    """`nvidia-smi topo -m` of this (the first) node, kept beside the report."""
    done = command(["nvidia-smi", "topo", "-m"])
    if done is None:
        return "no nvidia-smi"
    (ctx.out / "topo.txt").write_text(done.stdout + done.stderr)
    return relative(ctx.out / "topo.txt")


def check_comm(ctx: Context) -> Row:
    name = "comm"
    log = ctx.log(name)
    args = ["--strategy", "ddp", *settings(ctx, 1, epochs=1, print_every=1000)]
    status = run(ctx, [*args, "--comm-benchmark", "--no-checkpoint"], name, NCCL_DEBUG="INFO")
    text = log.read_text(errors="replace")
    rows = [r for r in map(parse_comm, text.splitlines()) if r]
    if status != 0 or not rows:
        raise Failed(f"the benchmark {ended(status)}, {len(rows)} [COMM] lines", log)
    (ctx.out / "comm.md").write_text(comm_table(rows) + "\n")
    transports = nccl_transports(text)
    chose = f"NCCL: {', '.join(transports)}" if transports else f"no NCCL ({rows[0]['backend']})"
    if len(ctx.nodes) > 1 and over_sockets(transports):
        ctx.warnings.append(
            f"{WARNING}NCCL went over TCP sockets between the nodes: a scaling study "
            "would measure TCP; run in the container (--environment) or set NCCL_NET "
            f"(docs/verify.md); see {relative(log)}"
        )
    passed = min(r["busbw_gbps"] for r in rows) > 0 and {r["op"] for r in rows} >= COLLECTIVES
    figure = f"{busbw_summary(rows)}; {chose}; all in comm.md; topology: {keep_topology(ctx)}"
    return Row(name, passed, figure, relative(log))


CHECKS = {  # in the report's order
    "equivalence": check_equivalence,
    "killed-rank": check_killed_rank,
    "stop-resume": check_stop_resume,
    "comm": check_comm,
}


def run_check(ctx: Context, check: str) -> Row:
    """The check's row: PASS or FAIL with its figure; a check that breaks is a FAIL too."""
    try:
        return CHECKS[check](ctx)
    except Failed as e:
        return Row(check, False, e.figure, relative(e.log))
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
        return Row(check, False, f"{type(e).__name__}: {e}", relative(ctx.out))


# ----------------------------------------------------------------------------- where it ran


def torch_versions() -> dict:
    """torch, CUDA and NCCL as this Python's torch sees them (run through --versions)."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "GPUs": torch.cuda.device_count(),
        "torch": torch.__version__,
        "CUDA": torch.version.cuda or "none",
        "NCCL": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "none (no GPU)",
    }


def command(argv: list[str]) -> subprocess.CompletedProcess | None:
    """argv run to its end, or None where it cannot start or outlives 30 s."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None


def command_output(argv: list[str]) -> str | None:
    done = command(argv)
    return done.stdout.strip() if done and done.returncode == 0 else None


def node_list() -> list[str]:
    if "SLURM_JOB_NODELIST" in os.environ:
        hosts = command_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        if hosts:
            return hosts.split()
    return [os.uname().nodename]


def where(ctx: Context) -> dict:
    driver = command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        **ctx.versions,
        "driver": driver.splitlines()[0] if driver else "none (no nvidia-smi)",
        "job": os.environ.get("SLURM_JOB_ID", "none (here, through torchrun)"),
        "world size": ctx.world_size,
        "device": ctx.device,
        "nodes": " ".join(ctx.nodes),
        "main.py options after --": shlex.join(ctx.extra) or "none",
    }


def learn_versions(ctx: Context) -> None:
    """torch's versions, and the device main.py will train on (a GPU where torch sees one,
    unless --device cpu): first, since the settings depend on it."""
    done = alone(ctx, ["verify.py", "--versions"], timeout=300)
    if done.returncode:
        fail(f"verify: the jobs' Python cannot run torch: {last_line(done.stderr)}", code=1)
    ctx.versions = json.loads(done.stdout)
    gpu = ctx.versions["GPUs"] > 0 and main_value(ctx.extra, "device") != "cpu"
    ctx.device = "cuda" if gpu else "cpu"


# ----------------------------------------------------------------------------- main


def max_param_diffs(reference: Path, *others: Path):
    """--max-diff: the largest |difference| between the final parameters of a checkpoint folder
    and each of others (DDP's full state, or FSDP's DCP shards read whole)."""
    import checkpoint_files

    def final(folder: Path) -> dict:
        path = checkpoint_files.latest(folder)
        if path is None:
            fail(f"no checkpoint in {folder}")
        return checkpoint_files.read_model(path)

    mine = final(reference)
    for folder in others:
        theirs = final(folder)
        if mine.keys() != theirs.keys():
            fail(f"{reference} and {folder} hold different parameters")
        yield max((mine[k].double() - theirs[k].double()).abs().max().item() for k in mine)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        usage="%(prog)s [options] [-- main.py options]", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, help="the report's folder (default: logs/verify-<job id>)")
    p.add_argument(
        "--checks",
        nargs="+",
        choices=list(CHECKS),
        default=list(CHECKS),
        help="run these checks only (default: all)",
    )
    # Inner steps, run by verify.py itself: on another node, or with the jobs' torch.
    p.add_argument("--kill-task", nargs=2, metavar=("TAG", "RANK"), help=argparse.SUPPRESS)
    p.add_argument("--max-diff", nargs="+", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--versions", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    ours, extra = split_argv(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(ours)
    if args.kill_task:
        return 0 if kill_task(args.kill_task[0], int(args.kill_task[1])) else 1
    if args.max_diff:
        for diff in max_param_diffs(*args.max_diff):
            print(diff)
        return 0
    if args.versions:
        print(json.dumps(torch_versions()))
        return 0
    refuse_verify_options(extra)
    in_slurm = "SLURM_JOB_ID" in os.environ
    name = "SLURM_NTASKS" if in_slurm else "NPROC"  # the job's tasks, or run.sh's here
    ranks = os.environ.get(name, "" if in_slurm else "2")
    if not ranks.isdigit() or int(ranks) < 2:
        fail(
            f"verify runs 2 or more ranks, not {name}={ranks!r}: "
            "start it with run_benchmarks.py --verify"
        )
    out = (args.out or verify_folder(job_id())).resolve()
    if out.exists():  # its runs would resume or refuse the earlier checkpoints
        fail(f"{relative(out)} exists: an earlier verify wrote there; choose another --out")
    out.mkdir(parents=True)
    ctx = Context(out, int(ranks), node_list(), extra, in_slurm)
    learn_versions(ctx)
    rows = []
    for check in args.checks:
        print(f"verify: {check} ...", flush=True)
        rows.append(run_check(ctx, check))
        print(f"verify: {check}: {rows[-1].result}: {rows[-1].figure}", flush=True)
    report = out / VERIFY_REPORT
    report.write_text(report_text(rows, where(ctx), ctx.warnings))
    return 0 if print_outcome(rows, report, ctx.warnings) else 1


if __name__ == "__main__":
    sys.exit(main())

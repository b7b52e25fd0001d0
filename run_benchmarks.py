"""Scaling sweep: train every strategy on every GPU count with SLURM, then collect and plot.

    python run_benchmarks.py                           # 1, 2, 4, 8 GPUs x ddp, fsdp
    python run_benchmarks.py --gpus 4 8 --strategies fsdp --account ACCOUNT -- --dataset synthetic
    python run_benchmarks.py --dry-run                 # print the job scripts, submit nothing
    python run_benchmarks.py --wait                    # block until the sweep ends, report failures
    python run_benchmarks.py --local --gpus 1 2        # no SLURM: torchrun on this machine
    python run_benchmarks.py --models cnn resnet50     # each model its own runs (default: cnn)
    python run_benchmarks.py --verify --wait           # first, on a new cluster: verify.py

Each sweep has a folder of its own, logs/sweep-<date-time>/, so two sweeps never mix. Every
configuration is first checked (`main.py --check`, one process per model and strategy, no
training): one bad configuration and nothing is written or submitted. Then each gets a script in
jobs/sweep-<date-time>/ that submits run.sh, the only launch recipe, with sbatch, one task per
GPU on ceil(gpus / gpus-per-node) nodes; a last job, once all have ended, runs plot_results.sh
on the sweep's folder and writes its outcome to collect_outcome.txt there. Strong scaling (the
default) keeps the global batch at every GPU count, weak the batch per GPU; --repeats R runs
each configuration R times, --one-at-a-time and --exclusive keep jobs from measuring each other.
--verify submits the cluster's acceptance test (verify.py) instead. docs/slurm.md tells it all.

Arguments after `--` go to main.py. --partition and --account are optional: sbatch also reads
SBATCH_PARTITION and SBATCH_ACCOUNT.
"""

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

import config
import layout
import slurm_jobs
from config import ONE_PROCESS, PRECISIONS, STRATEGIES, SWEEP_GPUS
from utils import count, fail, note, rank_unit
from verify_job import run_verify, verify_gpus

# The course's sweep; config.STRATEGIES has more (fsdp2, pipeline, and the one-process model,
# dp and single).
DEFAULT_STRATEGIES = ("ddp", "fsdp")
DEFAULT_MODEL = config.Config.model  # main.py's, the course CNN


@dataclass(frozen=True)
class Configuration:
    """One point of the sweep: a model's strategy on a number of GPUs, and what its job trains
    (the fields SWEEP_OPTION names: batch_size is the global batch)."""

    strategy: str
    gpus: int
    nodes: int
    batch_size: int
    epochs: int
    precision: str
    model: str = DEFAULT_MODEL

    @property
    def name(self) -> str:  # the CNN's runs named as before there was a model axis
        return layout.configuration_name(
            self.strategy, self.gpus, "" if self.model == DEFAULT_MODEL else self.model
        )

    @property
    def tasks_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def shape(self) -> str:
        return f"{count(self.nodes, 'node')} x {count(self.tasks_per_node, 'task')}"


# The switches that say what to do, and their help.
MODES = {
    "--dry-run": "print the job scripts; write and submit nothing",
    "--wait": "wait for the sweep to end; exit 1 if a job did not complete",
    "--local": "no SLURM: run the sweep one after the other here, through torchrun",
    "--verify": "one short job that checks the cluster (verify.py): equivalence, a killed rank, "
    "stop and resume, the network; run it first on a new cluster",
    "--one-at-a-time": "each job waits for the one before it (jobs that share cores measure "
    "each other)",
    "--exclusive": "sbatch --exclusive: no other job on a benchmark's nodes",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        usage="%(prog)s [options] [-- main.py arguments]",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to main.py, e.g. -- --dataset synthetic --compile",
    )
    p.add_argument(
        "--gpus",
        type=int,
        nargs="+",
        help=f"GPU counts, one task each (default: {' '.join(map(str, SWEEP_GPUS))}; --verify: "
        "one count, default 2 nodes' worth)",
    )
    p.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=list(DEFAULT_STRATEGIES),
        help="default: ddp fsdp (model, dp and single run one process: --gpus 1 only; "
        "pipeline runs only at the GPU counts the model cuts into, the others skipped)",
    )
    p.add_argument(
        "--models",
        nargs="+",
        choices=config.MODELS,
        default=[DEFAULT_MODEL],
        help="each model its own runs, at every GPU count and strategy (default: %(default)s)",
    )
    p.add_argument("--gpus-per-node", type=int, default=4, help="default: %(default)s")
    p.add_argument("--epochs", type=int, default=5, help="default: %(default)s")
    p.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="strong scaling: the global batch size of every GPU count; weak: the "
        "batch per GPU (default: %(default)s)",
    )
    p.add_argument(
        "--scaling",
        choices=("strong", "weak"),
        default="strong",
        help="strong: the same global batch for every GPU count; weak: the same "
        "batch per GPU (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="run every configuration R times (default: %(default)s)",
    )
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="default: %(default)s")
    slurm = p.add_argument_group("SLURM (default: run.sh's #SBATCH lines and SBATCH_* variables)")
    slurm.add_argument("--partition", help="sbatch --partition")
    slurm.add_argument("--account", help="sbatch --account")
    slurm.add_argument("--time", help="time limit of each training job, e.g. 00:30:00")
    slurm.add_argument("--cpus-per-task", type=int, help="CPUs (and OpenMP threads) per rank")
    slurm.add_argument(
        "--environment",
        metavar="EDF",
        help="CSCS Alps: run the tasks in this container (EDF file or name)",
    )
    mode = p.add_argument_group("what to do")
    for flag, help in MODES.items():
        mode.add_argument(flag, action="store_true", help=help)
    mode.add_argument(
        "--poll-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="between two looks at the queue with --wait (default: %(default)s)",
    )
    return p


# main.py's options that the sweep sets in every job (Configuration's fields), each with its own
# option that chooses it. Given again after `--`, main.py would take the last one: a job named
# ddp_1gpu would train FSDP, silently.
SWEEP_OPTION = {
    "strategy": "--strategies",
    "model": "--models",
    "epochs": "--epochs",
    "batch_size": "--batch-size",
    "precision": "--precision",
}

# The sweep's options that size each job. A launcher's option after `--` (--gpus, --nodes:
# config.LAUNCHER_OPTION) is no option of main.py: it would fail every job, and main.py's check
# before submitting, which refuses it, runs only where the jobs' Python has torch.
GPU_COUNT_OPTIONS = "--gpus and --gpus-per-node"


def sweep_option(token: str) -> str | None:
    """The sweep's own option for what an argument after `--` would choose, or None where the
    sweep leaves it to main.py."""
    if config.LAUNCHER_OPTION.match(token.split("=", 1)[0]):
        return GPU_COUNT_OPTIONS
    return SWEEP_OPTION.get(slurm_jobs.main_option(token))


def refuse_sweep_options(tokens: list[str], where: str) -> None:
    """One error line for an option that the sweep chooses itself."""
    for token in tokens:
        if ours := sweep_option(token):
            fail(
                f"{token.split('=', 1)[0]} {where} is the sweep's choice: use "
                f"run_benchmarks.py {ours} instead"
            )


def parse_args(ours: list[str]) -> argparse.Namespace:
    """Our options; one of main.py's given before `--` is named, with where it goes."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(ours)
    if unknown:
        if slurm_jobs.main_option(unknown[0]):
            refuse_sweep_options(unknown[:1], "is an option of main.py that")
            fail(
                f"{unknown[0].split('=', 1)[0]} is an option of main.py: put main.py's options "
                f"after --, e.g. python run_benchmarks.py [options] -- {shlex.join(unknown)}"
            )
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def check_args(args) -> None:
    for name in ("gpus_per_node", "epochs", "batch_size", "cpus_per_task", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.local and (args.environment or args.exclusive):
        fail(
            f"--{'environment' if args.environment else 'exclusive'} needs SLURM; leave it "
            "out with --local (which runs one configuration at a time anyway)"
        )
    if args.poll_interval <= 0:
        fail(f"--poll-interval must be positive, got {args.poll_interval}")
    one_process = sorted(set(args.strategies) & set(ONE_PROCESS))
    if one_process and any(g > 1 for g in args.gpus):
        fail(
            f"--strategies {' '.join(one_process)} run one process: sweep them with --gpus 1 "
            "(in a sweep of their own)"
        )
    for gpus in args.gpus:
        if gpus < 1:
            fail(f"--gpus: every count must be at least 1, got {gpus}")
        slurm_jobs.nodes_for(gpus, args.gpus_per_node)
        if args.scaling == "strong" and not args.verify and args.batch_size % gpus:
            fail(f"--batch-size {args.batch_size} does not split evenly over {gpus} GPUs")


def plan(args) -> list[Configuration]:
    gpu_counts = list(dict.fromkeys(args.gpus))  # without repeats, in the order given
    nodes = {g: slurm_jobs.nodes_for(g, args.gpus_per_node) for g in gpu_counts}

    def global_batch(gpus: int) -> int:
        return args.batch_size * gpus if args.scaling == "weak" else args.batch_size

    return [
        Configuration(s, g, nodes[g], global_batch(g), args.epochs, args.precision, m)
        for m in dict.fromkeys(args.models)
        for g in gpu_counts
        for s in dict.fromkeys(args.strategies)
    ]


def without_uncuttable(runs: list[Configuration]) -> list[Configuration]:
    """The runs without the pipeline's at GPU counts its model does not cut into (said once a
    model): those counts are no failure of the sweep, the other strategies still run there."""
    kept, cuts = [], []
    for model in dict.fromkeys(r.model for r in runs):
        fits = config.pipeline_world_sizes(model)
        own = [r for r in runs if r.model == model]
        skipped = sorted({r.gpus for r in own if r.strategy == "pipeline" and r.gpus not in fits})
        cuts.append(config.pipeline_cut(model))
        if skipped:
            counts = ", ".join(map(str, skipped))
            note(f"note: pipeline skipped at GPU counts {counts}: {cuts[-1]}")
        kept += [r for r in own if r.strategy != "pipeline" or r.gpus in fits]
    if not kept:
        fail(f"nothing to run: {'; '.join(cuts)}")
    return kept


def main_args(run: Configuration, extra: list[str]) -> list[str]:
    chosen = [
        word
        for dest in SWEEP_OPTION
        for word in (config.option_flag(dest), str(getattr(run, dest)))
    ]
    return [*chosen, "--comm-benchmark", *extra]  # every job measures its collectives (comm.csv)


def run_script(run: Configuration, sweep: str, args, extra: list[str]) -> str:
    logs, jobs = layout.logs_folder(sweep), layout.jobs_folder(sweep)
    log = f"{logs}/{layout.log_stem(run.name, '%j')}"
    options = [
        "--parsable",
        f"--job-name=bench-{run.name}",
        f"--output={log}.log",
        f"--error={log}{layout.ERR_SUFFIX}",
        *slurm_jobs.slurm_options(args),
        *slurm_jobs.job_size(run.nodes, run.tasks_per_node, args),
    ]
    if args.time:
        options.append(f"--time={args.time}")
    env = {"SAMPLES_DIR": logs}  # run.sh's GPU and CPU samplers: beside the logs
    if args.environment:
        env["EDF"] = slurm_jobs.edf_value(args.environment)
    comment = (
        f"# {run.model} {run.strategy} on {count(run.gpus, 'GPU')}: {run.shape}, one per GPU. "
        "Written by run_benchmarks.py.\n"
        f"# Submit again with: bash {jobs}/{run.name}.sh [more sbatch options]\n"
        "# run.sh is the launch recipe; these options size the job and name its logs.\n"
    )
    return slurm_jobs.script(comment, options, ["run.sh", *main_args(run, extra)], env)


def collect_script(sweep: str, args) -> str:
    logs, jobs = layout.logs_folder(sweep), layout.jobs_folder(sweep)
    command = "bash plot_results.sh"
    if args.environment:  # the host may lack pandas and matplotlib; the image has them
        command = (
            f"srun --environment={shlex.quote(slurm_jobs.edf_value(args.environment))} {command}"
        )
    command = f"LOGS={logs} {command}"  # first: an assignment after srun is no assignment
    # Its exit status is the job's (sacct shows it); its outcome, with the last error line of
    # its log, goes to the sweep's folder, where the user of a sweep not waited for looks.
    log = layout.collect_log(sweep, "$SLURM_JOB_ID")
    command += (
        f'; status=$?; echo "exit status $status"; {{ echo "collect job $SLURM_JOB_ID: exit '
        f'status $status (0: results.csv and plots/ written), log {log}"; '
        f'grep "^error: " {log} | tail -n 1; }} > {logs}/{layout.SWEEP_OUTCOME}; exit $status'
    )
    options = [
        "--parsable",
        "--job-name=bench-collect",
        "--ntasks=1",
        "--time=00:15:00",
        f"--output={layout.collect_log(sweep, '%j')}",
        *slurm_jobs.slurm_options(args),
    ]
    comment = (
        f"# Collects {logs}/ into results.csv and plots into plots/. Written by "
        "run_benchmarks.py,\n# which submits it with --dependency=afterany:<the sweep's "
        f"job ids>.\n# Submit again with: bash {jobs}/collect.sh [more sbatch "
        "options]\n"
    )
    return slurm_jobs.script(comment, options, ["--wrap", command], {})


def repeated(runs: list[Configuration], repeats: int, named=lambda run: run.name):
    """(configuration, name) R times each, one configuration after the other; the name,
    named(run), says which repeat (a repeat's log differs by its job id or time stamp alone)."""
    for run in runs:
        for i in range(1, repeats + 1):
            name = named(run)
            yield run, name if repeats == 1 else f"{name} (repeat {i} of {repeats})"


def submit_sweep(runs: list[Configuration], args, extra: list[str]) -> list[slurm_jobs.Job]:
    logs = layout.next_sweep_folder(layout.LOGS_DIR)
    logs.mkdir(parents=True)
    sweep, jobs = logs.name, []
    print(
        f"sweep {sweep}: logs in {layout.relative(logs)}/, "
        f"job scripts in {layout.jobs_folder(sweep)}/",
        flush=True,
    )
    try:
        for run, name in repeated(runs, args.repeats):
            in_turn = args.one_at_a_time and jobs
            after = [f"--dependency=afterany:{jobs[-1].job_id}"] if in_turn else []
            script = layout.JOBS_DIR / sweep / f"{run.name}.sh"
            slurm_jobs.write(script, run_script(run, sweep, args, extra))
            job_id = slurm_jobs.submit(script, *after)
            log = logs / f"{layout.log_stem(run.name, job_id)}.log"
            jobs.append(slurm_jobs.Job(name, job_id, log))
            print(f"{name}: job {job_id} ({run.shape}), log {layout.relative(log)}", flush=True)
        dependency = "--dependency=afterany:" + ":".join(j.job_id for j in jobs)
        job_id = slurm_jobs.submit(
            slurm_jobs.write(layout.JOBS_DIR / sweep / "collect.sh", collect_script(sweep, args)),
            dependency,
        )
    except slurm_jobs.SubmitError as e:
        submitted = " ".join(j.job_id for j in jobs)
        hint = f" (already queued: {submitted}; scancel {submitted} to drop them)" if jobs else ""
        fail(f"{e}{hint}", code=1)
    jobs.append(slurm_jobs.Job("collect", job_id, layout.REPO / layout.collect_log(sweep, job_id)))
    print(f"collect: job {job_id}, after all the others: results.csv and plots/", flush=True)
    return jobs


def how_to_follow(jobs: list[slurm_jobs.Job]) -> str:
    """What a user who does not wait for the sweep reads later, and where."""
    sweep = jobs[0].log.parent.name
    ids = ",".join(job.job_id for job in jobs)
    return (
        f"not waiting (--wait would, and report failures): when every job has ended, "
        f"{layout.logs_folder(sweep)}/{layout.SWEEP_OUTCOME} says whether collecting gave "
        f"results; each job's state: sacct -X -j {ids} --format=JobID,JobName,State,ExitCode"
    )


def report(jobs: list[slurm_jobs.Job]) -> int:
    failed = [j for j in jobs if j.state != "COMPLETED"]
    for job in failed:
        err = job.log.with_suffix(layout.ERR_SUFFIX)
        where = err if err.exists() and err.stat().st_size else job.log
        print(
            f"failed: {job.name} job {job.job_id} {job.state}, see {layout.relative(where)}",
            file=sys.stderr,
        )
    print(f"sweep done: {len(jobs) - len(failed)} of {len(jobs)} jobs completed")
    outcome = jobs[0].log.parent / layout.SWEEP_OUTCOME  # the collect job's: where results went
    if outcome.exists():
        print(outcome.read_text().rstrip())
    return 1 if failed else 0


def dry_run(runs: list[Configuration], args, extra: list[str]) -> None:
    sweep = layout.next_sweep_folder(layout.LOGS_DIR).name
    jobs = layout.jobs_folder(sweep)
    for run in runs:
        print(f"# ---- {jobs}/{run.name}.sh\n{run_script(run, sweep, args, extra)}")
    print(
        f"# ---- {jobs}/collect.sh, submitted with --dependency=afterany:<the job ids "
        f"above>\n{collect_script(sweep, args)}",
        end="",
    )


def check_configurations(runs: list[Configuration], args, extra: list[str]) -> set[str]:
    """main.py --check for each model and strategy at every GPU count of the sweep, before
    anything is written or submitted: a typo fails here, in seconds, not in the queue. Returns
    the devices the checks found ({"unknown"} where none ran)."""
    python = slurm_jobs.checking_python(args)
    if not python:
        return {"unknown"}
    # One check per model, strategy and global batch (weak scaling has one per GPU count).
    checks = {}
    for run in runs:
        checks.setdefault((run.model, run.strategy, run.batch_size), []).append(run)
    devices = set()
    for (model, strategy, _), same in checks.items():
        which = f"--strategy {strategy}" + (f" --model {model}" if len(args.models) > 1 else "")
        argv = [*main_args(same[0], extra), *slurm_jobs.check_device(args, extra)]
        argv += ["--check", *(str(run.gpus) for run in same)]
        devices.add(slurm_jobs.check_main(python, argv, which))
    return devices


def run_locally(runs: list[Configuration], args, extra: list[str], devices: set[str]) -> int:
    """The same sweep through run.sh without SLURM: torchrun, one configuration at a time, on
    the devices main.py --check found here (a rank per GPU, or processes on the CPU)."""
    logs = layout.next_sweep_folder(layout.LOGS_DIR)
    plot = ["bash", "plot_results.sh"]
    if args.dry_run:
        for run, _ in repeated(runs, args.repeats):
            command = ["bash", "run.sh", *main_args(run, extra)]
            print(f"NPROC={run.gpus} {shlex.join(command)}")
        print(f"LOGS={layout.relative(logs)} {shlex.join(plot)}")
        return 0
    logs.mkdir(parents=True)
    print(f"sweep {logs.name}: logs in {layout.relative(logs)}/", flush=True)
    one = rank_unit(devices)[0]

    def in_words(run: Configuration) -> str:  # its name, ddp_1gpu, counts GPUs: a CPU has none
        model = f"{run.model} " if len(args.models) > 1 else ""
        return f"{model}{run.strategy} on {count(run.gpus, one)}"

    failed = []
    for run, name in repeated(runs, args.repeats, in_words):
        # <sweep>/<name>_local-<time>.log: never an earlier run's file.
        log = layout.free_path(logs, layout.log_stem(run.name, layout.local_id()), ".log")
        err_log = log.with_suffix(layout.ERR_SUFFIX)
        print(f"{name} here: log {layout.relative(log)}", flush=True)
        env = {**slurm_jobs.without_slurm(), "NPROC": str(run.gpus), "SAMPLES_DIR": str(logs)}
        with open(log, "w") as out, open(err_log, "w") as err:
            command = ["bash", "run.sh", *main_args(run, extra)]
            done = subprocess.run(command, cwd=layout.REPO, stdout=out, stderr=err, env=env)
        if done.returncode:
            failed.append(name)
            where = f"exit status {done.returncode}, see {layout.relative(err_log)}"
            print(f"{name}: {where}", file=sys.stderr, flush=True)
    status = subprocess.run(plot, cwd=layout.REPO, env={**os.environ, "LOGS": str(logs)}).returncode
    if status:
        failed.append("plot_results.sh")
    steps = len(runs) * args.repeats + 1
    print(
        f"sweep done: {steps - len(failed)} of {steps} steps succeeded"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


# ----------------------------------------------------------------------------- --verify

# The sweep's options that choose its runs: --verify chooses its own (verify.py).
SWEEP_ONLY = "strategies models repeats scaling one_at_a_time epochs batch_size precision".split()


def refuse_sweep_only(ours: list[str]) -> None:
    actions = build_parser()._option_string_actions
    for token in ours:
        if slurm_jobs.option_dest(token, actions) in SWEEP_ONLY:
            fail(
                f"{token.split('=', 1)[0]} is the sweep's; --verify runs the checks' own "
                "configurations (docs/verify.md): leave it out"
            )


def main(argv=None) -> int:
    ours, extra = slurm_jobs.split_argv(sys.argv[1:] if argv is None else argv)
    args = parse_args(ours)
    if args.verify:
        refuse_sweep_only(ours)
        args.gpus = verify_gpus(args)
    else:
        args.gpus = args.gpus or list(SWEEP_GPUS)
        refuse_sweep_options(extra, "after --")
    check_args(args)
    if not (args.local or args.dry_run):  # before the checks: without SLURM they are in vain
        slurm_jobs.require("sbatch", *(["squeue"] if args.wait else []))
    if args.verify:
        return run_verify(args, extra)
    runs = without_uncuttable(plan(args))
    devices = check_configurations(runs, args, extra)
    if args.local:
        return run_locally(runs, args, extra, devices)
    if args.dry_run:
        dry_run(runs, args, extra)
        return 0
    jobs = submit_sweep(runs, args, extra)
    if not args.wait:
        print(how_to_follow(jobs))
        return 0
    try:
        slurm_jobs.wait_for_jobs(jobs, args.poll_interval)
    except KeyboardInterrupt:
        print("\nstopped waiting; the jobs go on (squeue --me)", file=sys.stderr)
        return 130
    return report(jobs)


if __name__ == "__main__":
    sys.exit(main())

"""Train the CIFAR-10 CNN with DDP or FSDP: one script from a laptop to a multi-node cluster.

    python main.py --strategy ddp                         # one process (CPU or one GPU)
    torchrun --nproc_per_node=4 main.py --strategy fsdp   # one node, four ranks
    srun python main.py ...                               # inside an sbatch job (see run.sh)
    python main.py --check 1 2 4 8 --strategy fsdp        # validate for these world sizes only

The launcher decides the world size; this script only reads it (utils.read_ranks). Each rank
parses the options (config.py) before torch loads, so that a mistyped option is answered at
once; then it checks them (--check), or builds its trainer, resumes and trains it (session.py),
reports how the run ended and cleans up. Rank 0 alone prints: one `[CONFIG]` line with the
resolved configuration, progress, and one `[METRIC]` line per epoch (format in utils.py).
"""

import argparse
import difflib
import gc
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import stopping
from config import LAUNCHER_OPTION, Config, add_options, validate
from utils import (
    EXIT_MEANING,
    EXIT_STATUS,
    CheckpointError,
    UsageError,
    is_rank_zero,
    log0,
    read_ranks,
)

if TYPE_CHECKING:  # only named here: session.py loads torch
    from session import Outcome

# How long a rank other than 0 whose command line is bad waits for its launcher to end it once
# rank 0 has said why and exited (stopping.await_stop_signal): rank 0 may still be starting
# Python on a loaded machine; plain srun (no --kill-on-bad-exit) waits them out.
PEER_EXIT_WAIT_S = 5.0

# ----------------------------------------------------------------------------- parse

USAGE = "usage: python main.py [OPTION ...]  (python main.py --help describes every option)"


class OptionError(UsageError):
    """A command line the parser cannot read: one short usage line, then the error."""


class OptionParser(argparse.ArgumentParser):
    """argparse, but a command line it cannot read raises OptionError, for main() to answer in
    one line, instead of printing the whole usage and exiting."""

    def error(self, message: str):
        raise OptionError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: "
        + ", ".join(f"{EXIT_STATUS[name]} {meaning}" for name, meaning in EXIT_MEANING.items()),
    )
    add_options(parser)
    check = (
        "validate the configuration for world sizes N (default: the launcher's) and find the "
        "data, then exit without training"
    )
    parser.add_argument("--check", nargs="*", type=int, metavar="N", help=check)
    return parser


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """Why arguments the parser left over are not main.py's, and what was meant."""
    options = [arg for arg in extras if arg.startswith("-")]
    if not options:
        return f"unexpected argument {extras[0]!r}: main.py takes options only"
    name = options[0].split("=", 1)[0]
    if LAUNCHER_OPTION.match(name):
        return (
            f"main.py has no {name}: the launcher sets the number of ranks (torchrun "
            "--nproc_per_node=N, NPROC=N bash run.sh, or srun/sbatch --ntasks=N --gpus=N); "
            "for a sweep over GPU counts: python run_benchmarks.py --gpus 1 2 4"
        )
    # A typo is close (--stratgy: 0.95); at difflib's default 0.6 any word finds a "match"
    # (--frobnicate: --microbatches, 0.62).
    close = difflib.get_close_matches(name, parser._option_string_actions, n=1, cutoff=0.75)
    return f"unrecognized option {name}" + (f"; did you mean {close[0]}?" if close else "")


def parse_command_line(argv: list[str]) -> tuple[Config, list[int] | None]:
    """The configuration, and the world sizes to check (None: train)."""
    parser = build_parser()
    options, extras = parser.parse_known_args(argv)
    if extras:
        raise OptionError(unrecognized(parser, extras))
    options = vars(options)
    check = options.pop("check")
    return validate(Config(**options)), check


# ----------------------------------------------------------------------------- check


def check(cfg: Config, world_sizes: list[int]) -> int:
    """`--check`: would this configuration run at these world sizes? One process, no training."""
    world_sizes = world_sizes or [read_ranks()[2]]
    if min(world_sizes) < 1:
        raise UsageError(f"--check: world sizes must be at least 1, got {min(world_sizes)}")
    import torch  # loads here, once the options are known to be readable

    import checkpoint
    import cost_model
    import data
    import distributed_utils
    import feasibility
    from model import build_model, count_parameters

    distributed_utils.check_torch()
    train_size, source = data.find_data(cfg.dataset, cfg.data_dir, cfg.train_samples, cfg.download)
    spec = data.DATASETS[cfg.dataset]
    with torch.device("meta"):  # the model's code runs (a ResNet loads torchvision); no memory
        model = build_model(cfg.model, spec.num_classes, spec.image_shape)
    device, where = distributed_utils.check_device(cfg.device)
    feasibility.check(cfg, world_sizes, train_size, device)
    step = feasibility.describe_graphs(cfg, device, world_sizes)
    state = cost_model.describe(cfg, model, world_sizes, distributed_utils.num_nodes())
    if cfg.resume:  # the checkpoint's meta.pt: does it fit this run, as session.run asks
        fits = checkpoint.run_identity(cfg, count_parameters(model))
        folder = checkpoint.folder_for(cfg.checkpoint_dir, cfg.resume) if cfg.checkpoint else None
        checkpoint.check_resume(cfg.resume, folder or Path("."), fits, world_sizes)
    elif cfg.checkpoint and cfg.checkpoint_dir:
        checkpoint.refuse_overwrite(Path(cfg.checkpoint_dir), cfg.resume)
    print(
        f"check: ok: strategy={cfg.strategy} world sizes {' '.join(map(str, world_sizes))}, "
        f"global batch {cfg.batch_size}, {train_size} training images ({source}), device={where}; "
        f"the step: {step}; {state}"
    )
    return EXIT_STATUS["finished"]


# ----------------------------------------------------------------------------- build, run


def train(cfg: Config, argv: list[str]) -> int:
    """Join the other ranks, build and run this rank's trainer (session.run), report, leave; a
    dead or hung peer ends this rank with one line."""
    import distributed_utils  # torch loads here, once the options are known to be readable
    import peer_failures
    import session
    from precision import set_deterministic

    distributed_utils.check_torch()
    set_deterministic(cfg.deterministic)  # before CUDA starts
    # exercise 5.1 begin
    env = distributed_utils.setup(cfg.pg_timeout, cfg.device)
    # exercise 5.1 end
    failed = True
    try:
        outcome = session.run(cfg, env)  # build this rank's trainer, resume it, train it
        status = report(outcome, cfg.epochs, argv)
        # Leave together: under srun --kill-on-bad-exit the first rank to exit non-zero (a stop
        # exits 3) ends the others, which must not cut rank 0's pruning or report short.
        distributed_utils.barrier()
        failed = False
    except Exception as e:
        if not peer_failures.is_peer_failure(e):
            raise
        # Its own log holds the cause: say which rank, rather than wait for the time limit.
        print(f"error: {peer_failures.describe_peer_failure(e)}", file=sys.stderr, flush=True)
        return EXIT_STATUS["peer_failed"]
    finally:
        # exercise 5.1 begin
        distributed_utils.cleanup(failed)
        # exercise 5.1 end
    return status


# ----------------------------------------------------------------------------- report


def continue_command(argv: list[str], folder: Path) -> str:
    """The command line that resumes a stopped run: its own, resuming from its folder."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--resume="):
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        kept.append(arg)
    return shlex.join(["main.py", *kept, "--resume", str(folder)])


def stop_report(outcome: "Outcome", epochs: int, argv: list[str]) -> str:
    at = outcome.stopped_at
    signal_name = stopping.stop_signal() or "a signal to another rank"
    text = (
        f"[CHECKPOINT] stopped on {signal_name} at epoch {at.epoch} step {at.step} of "
        f"{epochs} epochs"
    )
    if outcome.folder is None:
        return text + " (no checkpoint written: --no-checkpoint)"
    return f"{text}; continue with: {continue_command(argv, outcome.folder)}"


def report(outcome: "Outcome", epochs: int, argv: list[str]) -> int:
    """Rank 0's last line on a run that did not finish; the exit status."""
    if outcome.diverged:
        log0(f"error: {outcome.diverged}", file=sys.stderr)
        return EXIT_STATUS["diverged"]
    if outcome.stopped_at:
        log0(stop_report(outcome, epochs, argv))
        return EXIT_STATUS["stopped"]
    return EXIT_STATUS["finished"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with stopping.catch_stop_signals():  # a warning during start-up must not kill us either
        parsed = False
        try:
            cfg, world_sizes = parse_command_line(argv)  # before torch loads
            parsed = True
            # What loads next, torch and the project, lives as long as the process: collecting
            # while it loads frees nothing and costs 0.4 s. distributed_utils.setup freezes it
            # and turns the collector back on.
            gc.disable()
            if world_sizes is not None:
                return check(cfg, world_sizes)
            return train(cfg, argv)
        except UsageError as e:  # the same on every rank: one line, rank 0's
            if isinstance(e, OptionError):
                log0(USAGE, file=sys.stderr)
            log0(f"error: {e}", file=sys.stderr)
            # Found within milliseconds of the start, when rank 0 may not yet have taken the
            # stop signals: let rank 0 exit first, its launcher then ends this rank. (Later
            # errors come after torch has loaded, or after the ranks have met.)
            if not parsed and not is_rank_zero():
                stopping.await_stop_signal(timeout_s=PEER_EXIT_WAIT_S)
            if isinstance(e, CheckpointError):
                return EXIT_STATUS["checkpoint"]
            return EXIT_STATUS["usage"]
        finally:
            gc.enable()  # --check and errors end before setup turns it on: the caller gets it back


if __name__ == "__main__":
    # Once one rank has exited 3 (stopped), srun's --kill-on-bad-exit (and torchrun) sends
    # SIGTERM to the others while they still leave: the stop signals stay caught while main()
    # ends, then ignored, so that their status stays 3 rather than 143.
    stopping.take_stop_signals()
    status = main()
    stopping.ignore_stop_signals()
    sys.exit(status)

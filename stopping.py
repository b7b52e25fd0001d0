"""Stopping on a signal: SIGUSR1 or SIGUSR2 (SLURM's warning before the time limit; run.sh asks
for USR1 with `--signal=B:USR1@T`, other sites and tools use USR2), SIGTERM (preemption,
`scancel`) and SIGINT (Ctrl-C) no longer end the process once taken: they become a stop that
every rank takes at the same step boundary, within a few steps (`StopRequest`), after which the
run saves a checkpoint (checkpoint.py) and exits with status 3. A second Ctrl-C ends at once.

Catching the signals needs no torch: main.py catches them before torch loads (seconds, during
which a warning must not kill the process either). Only `StopRequest` imports torch.distributed.
"""

import contextlib
import datetime
import os
import signal
import sys
import time

from utils import read_ranks

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
_stop_signal: str | None = None  # set by the handler: the name of the signal received

# A terminal's Ctrl-C reaches every process of the foreground group: the ranks, and a launcher
# that may pass its own on to them (torchrun does, within milliseconds). A SIGINT that comes this
# long after the first is the user's second Ctrl-C; one sooner is the same Ctrl-C again.
INTERRUPT_AGAIN_S = 1.0
_first_interrupt: float | None = None  # when the first SIGINT came (time.monotonic)


def _on_stop_signal(signum, frame) -> None:
    global _stop_signal, _first_interrupt
    if signum == signal.SIGINT:
        now = time.monotonic()
        if _first_interrupt is None:
            _first_interrupt = now
            _say(
                b"[STOP] Ctrl-C: every rank stops within a few steps and saves a checkpoint; "
                b"Ctrl-C again ends at once, without one\n"
            )
        elif now - _first_interrupt >= INTERRUPT_AGAIN_S:
            _end_at_once()
    _stop_signal = signal.Signals(signum).name


def _say(line: bytes) -> None:
    """Rank 0 writes line straight to its stdout: a handler that printed through sys.stdout
    could land inside a print of the code it interrupted (a reentrant write raises)."""
    if read_ranks()[0] == 0:
        with contextlib.suppress(OSError):
            os.write(sys.stdout.fileno(), line)


def _end_at_once() -> None:
    """The second Ctrl-C: end as Ctrl-C ends a program, by SIGINT's own default action (a
    calling shell or make then stops too). The checkpoints already saved stay as they are."""
    _say(b"[STOP] Ctrl-C again: ending now, without a checkpoint of this step\n")
    with contextlib.suppress(Exception):  # what is buffered, where that is safe now
        sys.stdout.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def take_stop_signals() -> None:
    """From here on the STOP_SIGNALS no longer end the process: they ask for a checkpoint and a
    stop."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)


def ignore_stop_signals() -> None:
    """From here to the process's very end a stop signal does nothing: ignored, not handled
    (Python gives handled signals their default action back while its interpreter shuts down,
    torch's teardown taking seconds at times; ignored ones stay ignored)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def catch_stop_signals():
    """take_stop_signals() for a block: the handlers before it come back after."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    take_stop_signals()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_signal() -> str | None:
    """The name of the stop signal this process received, if any."""
    return _stop_signal


def await_stop_signal(timeout_s: float) -> str | None:
    """Wait, stop signals taken, until one comes or timeout_s passes; its name, or None. (A rank
    other than 0 with a bad command line waits for rank 0 to say so: torchrun and srun
    --kill-on-bad-exit would otherwise end rank 0 with SIGTERM, its error unsaid.)"""
    deadline = time.monotonic() + timeout_s
    while _stop_signal is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return _stop_signal


# Steps between two agreements on a stop. One agreement (a gloo all-reduce) cost about 0.5 ms
# between two ranks on a 2-core machine, a sixth of this model's step on an H100 (3-4 ms,
# docs/performance.md): paid once every this many steps, well within SLURM's warning time.
STOP_POLL_EVERY = 10


class StopRequest:
    """A signal to one rank becomes a stop at the same step on every rank: every
    STOP_POLL_EVERY-th call, `poll` starts a tiny all-reduce (MAX) of this rank's flag on a CPU
    gloo group and reads the previous one's result, so the ranks agree at most two intervals
    after the first signal, without any device synchronization in the training loop.
    """

    def __init__(self, timeout_s: float = 300.0):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        # The group's timeout is the run's --pg-timeout, not gloo's default of 30 minutes.
        self.group = (
            dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            if read_ranks()[2] > 1
            else None
        )
        self.pending = None
        self.every, self.calls = STOP_POLL_EVERY, 0

    def __enter__(self) -> "StopRequest":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.drain()
        self.group = self.pending = None  # the group dies with the model's, in cleanup()

    def poll(self) -> bool:
        """True on every rank at the same step once any rank was signalled."""
        if self.group is None:
            return _stop_signal is not None
        self.calls += 1
        if (self.calls - 1) % self.every:
            return False
        agreed = self.drain()
        flag = self.torch.tensor([int(_stop_signal is not None)])
        self.pending = (
            self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group, async_op=True),
            flag,
        )
        return agreed

    def drain(self) -> bool:
        """Finish the all-reduce in flight (before a stop, an epoch's end or shutdown)."""
        if self.group is None:
            return _stop_signal is not None
        if self.pending is None:
            return False
        work, flag = self.pending
        work.wait()
        self.pending = None
        return bool(flag.item())

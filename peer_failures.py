"""When a rank dies or hangs (docs/failures.md): the others end, each with one line naming the
ranks that failed and where every rank was last seen, and exit status 1.

Every rank of a multi-rank run has a pulse: a thread that answers on a socket of its own,
whatever the rank's main thread is blocked in. A rank whose collective failed asks the pulses
of the ranks that did not check in after it (describe_peer_failure).
"""

import contextlib
import os
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

# gloo's errors name its source file, except one: a timeout in one operation closes every pair
# of its context, and the operations waiting on them get this text alone (gloo's
# unbound_buffer.cc). Without it, a stopped peer could end rank 0 in a traceback (seen in CI).
GLOO_PAIRS_CLOSED = "Application timeout caused pair closure"


def is_peer_failure(error: BaseException) -> bool:
    """A collective that failed because another rank died or hung (not a bug of ours).

    NCCL and the store raise DistError's subclasses. gloo raises a plain RuntimeError (torch
    2.14, measured: "[.../gloo/transport/tcp/pair.cc:545] Read error ...: Connection reset by
    peer" for a killed peer, "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting
    5000ms for recv operation" for a stopped one, GLOO_PAIRS_CLOSED for the operations beside
    the one that timed out), so for gloo its text is all there is.
    """
    text = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and ("gloo" in text or GLOO_PAIRS_CLOSED in text)
    )


# A rank's pulse: a thread of its own answers every connection to a socket of its own, whatever
# the rank's main thread is blocked in. It tells a rank that died (nothing listens) or hung
# (SIGSTOP stops the thread too: no answer) from one that is alive but still blocked in a
# collective: gloo's ring leaves the ranks that are not a dead rank's neighbours waiting for
# ranks that have already left it, until those exit (seen at 4 and 8 ranks). Not through the
# rendezvous store: a store that is gone makes torch's C++ client log a 20-frame backtrace.
PULSE_WAIT_S = 0.5  # for a rank's answer
# The store every rank met at, kept for the check-in after a failed collective (silent_ranks):
# torch offers no public way to get it back from the process group.
_store = None
_pulse = None  # this rank's Pulse, from start_pulse() to stop_pulse()


class Pulse:
    def __init__(self, store, rank: int, rendezvous_addr: str):
        # The address this node reaches rank 0's at: rank 0 reaches this one's there too.
        family, _, _, _, rank0 = socket.getaddrinfo(rendezvous_addr, 9, type=socket.SOCK_DGRAM)[0]
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(rank0)  # a datagram socket: nothing is sent
                host = probe.getsockname()[0]
        except OSError:  # no route known to it: the node's name is the best guess left
            host = socket.gethostname()
        self.server = socket.create_server(("", 0), family=family)
        self.server.settimeout(1.0)  # where shutdown() does not wake accept() (not Linux)
        store.set(f"pulse/{rank}", f"{host} {self.server.getsockname()[1]}")
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._answer, name="pulse", daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        while not self.stopped.is_set():
            with contextlib.suppress(OSError):  # a caller that left, a timeout, stop()
                connection, _ = self.server.accept()
                with connection:
                    connection.sendall(b"1")

    def stop(self) -> None:
        self.stopped.set()
        with contextlib.suppress(OSError):  # Linux: the waiting accept() returns at once
            self.server.shutdown(socket.SHUT_RDWR)
        self.thread.join()
        self.server.close()


def start_pulse(store, rank: int, rendezvous_addr: str) -> None:
    """Before the process group: by the time any rank has joined it, every pulse answers."""
    global _store, _pulse
    _store, _pulse = store, Pulse(store, rank, rendezvous_addr)


def stop_pulse() -> None:
    global _pulse
    if _pulse is not None:
        _pulse.stop()
        _pulse = None


def pulse_address(rank: int) -> tuple[str, int] | None:
    """Where rank's pulse answers; None for a rank that died before it had one."""
    key = f"pulse/{rank}"
    if not _store.check([key]):
        return None
    host, port = _store.get(key).decode().split()
    return host, int(port)


def answers(address: tuple[str, int] | None) -> bool:
    """Whether the pulse at address answers: its rank's process runs."""
    if address is None:
        return False
    try:
        with socket.create_connection(address, timeout=PULSE_WAIT_S) as connection:
            return connection.recv(1) == b"1"
    except OSError:  # refused: nobody listens; a timeout: nobody answers
        return False


def silent_ranks(grace_s: float = 3.0) -> tuple[list[int], list[int]]:
    """After a failed collective: the ranks that did not check in at the rendezvous store,
    split into those whose pulse does not answer (they died or hung) and those whose pulse
    does (alive, still blocked in a collective: they lost their peers).

    Every rank that meets the failure does so within moments of the others (a dead peer closes
    its sockets; a hung one times every rank out together), writes its check-in, and waits a
    little for the others'.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    store = dist.PrefixStore("checkin", _store)
    store.set(str(rank), "alive")
    deadline = time.monotonic() + grace_s
    while True:
        missing = [r for r in range(world) if not store.check([str(r)])]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    with ThreadPoolExecutor(max(len(missing), 1)) as pool:  # PULSE_WAIT_S at most, for all
        answered = pool.map(answers, [pulse_address(r) for r in missing])
        alive = [r for r, answer in zip(missing, answered) if answer]
    return [r for r in missing if r not in alive], alive


def say_where(text: str) -> None:
    """Leave at the rendezvous store where this rank is now (e.g. "epoch 2 step 40, in DDP's
    gradient all-reduces"), for the line that names it if it dies or hangs after this. One small
    write; the training loop makes one every stopping.STOP_POLL_EVERY steps."""
    if _store is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.PrefixStore("where", _store).set(str(dist.get_rank()), text)


def last_seen() -> str:
    """Where each rank last said it was (say_where), in rank order."""
    store = dist.PrefixStore("where", _store)
    ranks = range(dist.get_world_size())
    return "; ".join(
        f"rank {r} {store.get(str(r)).decode() if store.check([str(r)]) else 'nowhere yet'}"
        for r in ranks
    )


def native_stderr_held(fn):
    """fn()'s result, with what was written meanwhile to stderr's file descriptor (torch's C++
    logs) shown after it; where fn raises, that text is dropped and the exception raised."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            result = fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        sys.stderr.write(held.read().decode(errors="replace"))
    return result


def names(ranks: list[int]) -> str:
    return f"rank(s) {', '.join(map(str, ranks))}"


def who_failed() -> str:
    dead, lost = silent_ranks()
    said = [f"{names(dead)} died or hung"] if dead else []
    if lost:  # their own lines, if any, follow once the ranks they wait for have exited
        said.append(f"{names(lost)} alive, blocked in a collective{' with them' if dead else ''}")
    return "; ".join(said or ["a peer failed"]) + f"; last seen: {last_seen()}"


def describe_peer_failure(error: BaseException) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    try:
        who = native_stderr_held(who_failed)
    except Exception:  # the store lives in rank 0 (or torchrun's agent): it may be gone too
        # (torch's C++ client logged the broken connection with a 20-frame backtrace: dropped,
        # this line says it)
        who = (
            "the rendezvous store is gone too: rank 0 has ended (its own error line names "
            "the rank that failed) or died"
        )
    return f"rank {dist.get_rank()}: {who}; stopping ({first_line[:200]})"

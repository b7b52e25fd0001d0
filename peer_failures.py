"""When a rank dies or hangs (docs/failures.md): the others end within --pg-timeout, each with one
line naming the ranks that failed and where every rank was last seen, and exit status 1.

Every rank of a multi-rank run has a pulse: a thread that answers on a socket of its own,
whatever the rank's main thread is blocked in. A rank whose collective failed asks the pulses
of the ranks that did not check in after it (describe_peer_failure). A rank blocked where no
collective will ever fail (a CUDA graph's replayed collectives escape NCCL's watchdog: C++
that never returns to Python) is ended by its own watchdog, a thread that asks the peers'
pulses every few seconds.
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

from utils import EXIT_STATUS

# gloo's errors name its source file, except one: a timeout in one operation closes every pair
# of its context, and the operations waiting on them get this text alone (gloo's
# unbound_buffer.cc). Without it, a stopped peer could end rank 0 in a traceback (seen in CI).
GLOO_PAIRS_CLOSED = "Application timeout caused pair closure"


def is_peer_failure(error: BaseException) -> bool:
    """A collective that failed because another rank died or hung (not a bug of ours).

    NCCL and the store raise DistError's subclasses; gloo a plain RuntimeError whose text is all
    there is (torch 2.14: "[.../gloo/transport/tcp/pair.cc:545] Read error ...: Connection reset
    by peer" for a killed peer, "[.../unbound_buffer.cc:78] Timed out waiting 5000ms for recv
    operation" for a stopped one, GLOO_PAIRS_CLOSED beside the one that timed out).
    """
    text = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and ("gloo" in text or GLOO_PAIRS_CLOSED in text)
    )


# A rank's pulse tells a rank that died (nothing listens) or hung (SIGSTOP stops the thread
# too: no answer) from one alive but still blocked in a collective (gloo's ring leaves the
# ranks that are not a dead rank's neighbours waiting, until those exit). Not through the
# rendezvous store: a store that is gone makes torch's C++ client log a 20-frame backtrace.
PULSE_WAIT_S = 0.5  # for a rank's answer
# What a caller says to a pulse: a question, or that rank N leaves cleanly (not to be taken
# for dead once its pulse is gone).
ASKING, LEAVING = b"?", b"leaving "
# The store every rank met at, kept for the check-in after a failed collective (silent_ranks):
# torch offers no public way to get it back from the process group.
_store = None
_pulse = None  # this rank's Pulse, from start_pulse() to leave()
_watchdog = None  # this rank's Watchdog, from watch() to leave()


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
        # Only there: its peers need no other address, and nobody else needs one at all.
        self.server = socket.create_server((host, 0), family=family)
        self.server.settimeout(1.0)  # where shutdown() does not wake accept() (not Linux)
        store.set(f"pulse/{rank}", f"{host} {self.server.getsockname()[1]}")
        self.left: set[int] = set()  # the peers that said they leave cleanly
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._answer, name="pulse", daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        while not self.stopped.is_set():
            # a caller that left or said nothing readable, a timeout, stop()
            with contextlib.suppress(OSError, ValueError):
                connection, _ = self.server.accept()
                with connection:
                    connection.settimeout(PULSE_WAIT_S)
                    said = connection.recv(32)
                    if said.startswith(LEAVING):
                        self.left.add(int(said.removeprefix(LEAVING)))
                    connection.sendall(b"1")  # after noting a leave: the leaver waits for it

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


def pulse_address(rank: int) -> tuple[str, int] | None:
    """Where rank's pulse answers; None for a rank that died before it had one."""
    key = f"pulse/{rank}"
    if not _store.check([key]):
        return None
    host, port = _store.get(key).decode().split()
    return host, int(port)


def answers(address: tuple[str, int] | None, said: bytes = ASKING) -> bool:
    """Whether the pulse at address answers what was said: its rank's process runs."""
    if address is None:
        return False
    try:
        with socket.create_connection(address, timeout=PULSE_WAIT_S) as connection:
            connection.sendall(said)
            return connection.recv(1) == b"1"
    except OSError:  # refused: nobody listens; a timeout: nobody answers
        return False


def ask_all(addresses: list, said: bytes = ASKING) -> list[bool]:
    """answers() for every address, all at once: PULSE_WAIT_S at most."""
    with ThreadPoolExecutor(max(len(addresses), 1)) as pool:
        return list(pool.map(answers, addresses, [said] * len(addresses)))


# The longest pause between two rounds of the watchdog's questions: one connection to every
# peer's pulse, from a thread of its own, nothing on the main thread.
WATCH_EVERY_S = 5.0


class Watchdog:
    """Ends this rank as a failed collective would (the same line, exit status 1) once a peer's
    pulse has been silent for silence_s and that peer did not say it left cleanly: the main
    thread may be blocked in C++ for good, so this thread ends the process itself. A slow peer
    still answers: its pulse runs from before the process group to the rank's cleanup.
    """

    def __init__(self, rank: int, peers: dict[int, tuple[str, int] | None], silence_s: float):
        self.rank, self.peers, self.silence_s = rank, peers, silence_s
        self.left = _pulse.left
        self.every = min(WATCH_EVERY_S, silence_s / 4)
        self.lock = threading.Lock()  # one line, the watchdog's or the main thread's
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        heard = dict.fromkeys(self.peers, time.monotonic())
        while not self.stopped.wait(self.every):
            now = time.monotonic()
            asked = [r for r in self.peers if r not in self.left]
            for r, answered in zip(asked, ask_all([self.peers[r] for r in asked])):
                if answered:
                    heard[r] = now
            dead = [r for r in asked if r not in self.left and now - heard[r] >= self.silence_s]
            if dead:
                self._end(dead, now - max(heard[r] for r in dead))

    def _end(self, dead: list[int], silent_s: float) -> None:
        with self.lock:
            if self.stopped.is_set():  # the main thread met the failure first: it says it
                return
            who = f"{names(dead)} died or hung; last seen: {last_seen_if_reachable(dead)}"
            cause = f"their pulse has not answered for {silent_s:.0f} s"
            print(f"error: {failure_line(who, cause)}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_STATUS["peer_failed"])

    def stop(self) -> None:
        with self.lock:
            self.stopped.set()
        self.thread.join()

    def say_leaving(self) -> None:
        ask_all(list(self.peers.values()), LEAVING + str(self.rank).encode())


def watch(timeout_s: float) -> None:
    """Once every rank has joined the process group (so every pulse answers): watch the peers,
    naming a silent one after half of --pg-timeout, so that the first round that misses it,
    the silence and the round that names it fit in --pg-timeout."""
    global _watchdog
    rank, world = dist.get_rank(), dist.get_world_size()
    peers = {r: pulse_address(r) for r in range(world) if r != rank}
    _watchdog = Watchdog(rank, peers, timeout_s / 2)


def leave(cleanly: bool) -> None:
    """Stop watching and answering. A rank that leaves cleanly tells every peer first, so that
    none still at work takes it for dead; a failed rank does not, so that they name it."""
    global _watchdog, _pulse
    if _watchdog is not None:
        _watchdog.stop()
        if cleanly:
            _watchdog.say_leaving()
        _watchdog = None
    if _pulse is not None:
        _pulse.stop()
        _pulse = None


def silent_ranks(grace_s: float = 3.0) -> tuple[list[int], list[int]]:
    """After a failed collective: the ranks that did not check in at the rendezvous store
    within grace_s (the ranks meet a failure within moments of each other), split into those
    whose pulse does not answer (died or hung) and those whose pulse does (alive, still blocked
    in a collective: they lost their peers).
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
    answered = ask_all([pulse_address(r) for r in missing])
    alive = [r for r, answer in zip(missing, answered) if answer]
    return [r for r in missing if r not in alive], alive


def say_where(text: str) -> None:
    """Leave at the rendezvous store where this rank is now (e.g. "epoch 2 step 40, in DDP's
    gradient all-reduces"), for the line that names it if it dies or hangs after this: one
    small write every stopping.STOP_POLL_EVERY steps."""
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


def last_seen_if_reachable(dead: list[int]) -> str:
    """last_seen(), unless the store went with the ranks named dead: under srun it lives in rank
    0, and a stopped rank 0's would keep the question waiting for --pg-timeout."""
    if 0 in dead:
        return "not known (the rendezvous store lives in rank 0)"
    try:
        return native_stderr_held(last_seen)
    except Exception:  # rank 0 has ended meanwhile, and the store with it
        return "not known (the rendezvous store is gone)"


def native_stderr_held(fn):
    """fn()'s result, what it wrote to stderr's file descriptor (torch's C++ logs) shown after
    it; where fn raises, that text is dropped."""
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


def failure_line(who: str, cause: str) -> str:
    """This rank's line, after `error: `: who failed, and what made this rank stop."""
    return f"rank {dist.get_rank()}: {who}; stopping ({cause[:200]})"


def describe_peer_failure(error: BaseException) -> str:
    if _watchdog is not None:  # one line: this one, not the watchdog's too
        _watchdog.stop()
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    try:
        who = native_stderr_held(who_failed)
    except Exception:  # the store lives in rank 0 (or torchrun's agent): it may be gone too
        who = (
            "the rendezvous store is gone too: rank 0 has ended (its own error line names "
            "the rank that failed) or died"
        )
    return failure_line(who, first_line)

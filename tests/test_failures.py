"""A rank that dies or hangs ends the others with one line naming it and exit status 1.

The two ranks are started directly, as srun starts its tasks: under torchrun its agent would
kill rank 0 itself on seeing rank 1 die, and rank 0's own reaction would never be seen."""

import os
import re
import signal
import threading
import time

import pytest

import distributed_utils
import peer_failures
from helpers import ARGS, DEAD_S, HUNG_S, end_rank1_during_training, kill_during_training


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "failure,signal_sent,bound",
    [("dies", signal.SIGKILL, DEAD_S), ("hangs", signal.SIGSTOP, HUNG_S)],
)
def test_a_dead_or_hung_peer_ends_rank_0_with_one_line_and_status_1(failure, signal_sent, bound):
    error, status, elapsed = end_rank1_during_training([*ARGS, "--device", "cpu"], signal_sent)
    print(f"rank 1 {failure}: rank 0 said so after {elapsed:.1f} s: {error}")
    assert error.startswith("error: rank 0: rank(s) 1 died or hung; last seen: "), error
    # Where each rank last said it was: both in epoch 1's training, in DDP's step collectives.
    seen = re.findall(r"rank (\d) at epoch 1 step \d+ in DDP's gradient all-reduces", error)
    assert seen == ["0", "1"], error
    assert status == 1
    assert elapsed < bound, elapsed


@pytest.mark.timeout(180)
def test_a_killed_rank_is_named_apart_from_the_ranks_that_lost_it():
    """Of 4 ranks, rank 3 killed: its neighbours in gloo's ring fail at once, while another
    (rank 1, seen every time) stays blocked in the all-reduce, waiting for ranks that have left
    it, until they exit. Rank 0 names rank 3 alone as dead, and any rank it names beside it as
    alive (its pulse went on). No rank's stderr holds a C++ backtrace."""
    errors = kill_during_training([*ARGS, "--device", "cpu"], 4, victim=3)
    line = next(line for line in errors[0].splitlines() if line.startswith("error:"))
    print(line)
    blocked = r"(rank\(s\) [\d, ]+ alive, blocked in a collective with them; )?"
    assert re.match(rf"error: rank 0: rank\(s\) 3 died or hung; {blocked}last seen: ", line)
    assert not any("Exception raised from" in err for err in errors), errors


def describe_after_rank_0_has_left(env) -> tuple[str, str] | None:
    """Rank 0 leaves, and the rendezvous store it hosts with it; then rank 1 meets a failed
    collective. Its line, and what it wrote to stderr's file descriptor meanwhile."""
    import os
    import tempfile

    if env.rank == 0:
        return None
    with tempfile.TemporaryFile() as native:
        saved = os.dup(2)
        os.dup2(native.fileno(), 2)
        try:
            time.sleep(3)  # rank 0's process ends (its pulse and this rank's stop on the way)
            line = peer_failures.describe_peer_failure(RuntimeError("gloo: connection closed"))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        native.seek(0)
        return line, native.read().decode(errors="replace")


@pytest.mark.timeout(120)
def test_a_rank_that_outlives_the_store_says_so_in_one_line():
    """Reading the store that rank 0 took with it, torch's C++ client logs the broken
    connection with a 20-frame backtrace: kept out, the rank's one line says it."""
    from dist_harness import spawn

    _, (line, native) = spawn(describe_after_rank_0_has_left, 2, timeout=100)
    print(line)
    assert line.startswith("rank 1: the rendezvous store is gone too: rank 0 has ended"), line
    assert native == "", native


# The run's --pg-timeout in the next three tests: a wait longer than this is not one that
# --pg-timeout cut short.
SHORT_TIMEOUT_S = 2


def errors_of_two_collectives_a_late_peer_misses(env) -> list[tuple[str, bool]]:
    """Rank 0 starts two all-reduces a second apart; rank 1 comes to neither within the
    timeout. What each of rank 0's raised, and whether is_peer_failure says a peer failed."""
    import torch
    import torch.distributed as dist

    if env.rank == 1:
        time.sleep(3 * SHORT_TIMEOUT_S)
        return []
    first = dist.all_reduce(torch.ones(1), async_op=True)
    time.sleep(SHORT_TIMEOUT_S / 2)  # the first times out while the second still waits
    second = dist.all_reduce(torch.ones(1), async_op=True)
    seen = []
    for work in (first, second):
        try:
            work.wait()
        except RuntimeError as e:
            seen.append((str(e).splitlines()[0], peer_failures.is_peer_failure(e)))
    return seen


@pytest.mark.timeout(120)
def test_every_error_of_a_timed_out_gloo_context_is_a_peer_failure():
    """The operation that times out names gloo; the one beside it only says that the pairs
    were closed. Both are a peer's failure: one line, not a traceback."""
    from dist_harness import spawn

    seen, _ = spawn(
        errors_of_two_collectives_a_late_peer_misses, 2, pg_timeout_s=SHORT_TIMEOUT_S, timeout=100
    )
    assert seen[1][0] == peer_failures.GLOO_PAIRS_CLOSED, seen
    assert "gloo" in seen[0][0] and "Timed out" in seen[0][0], seen
    assert all(peer_failure for _, peer_failure in seen), seen


def wait_for_rank0_then_leave_late(env) -> str:
    """Rank 0 works alone (a download) for three --pg-timeouts while rank 1 waits, and hands its
    result to it; then rank 0, which hosts the rendezvous store, leaves first, and rank 1 two
    --pg-timeouts later."""
    handed = distributed_utils.on_rank0(lambda: time.sleep(3 * SHORT_TIMEOUT_S) or "rank 0's")
    if env.rank == 1:
        time.sleep(2 * SHORT_TIMEOUT_S)
    return handed


@pytest.mark.timeout(120)
def test_a_live_rank_waiting_long_is_not_taken_for_dead():
    """A download takes minutes: the others wait on the handshake group, not --pg-timeout. A
    rank that goes on after rank 0 has finished (for longer than its watchdog gives a silent
    peer, half of --pg-timeout) finishes too: none was named."""
    from dist_harness import spawn

    outcomes = spawn(wait_for_rank0_then_leave_late, 2, pg_timeout_s=SHORT_TIMEOUT_S, timeout=100)
    assert outcomes == ["rank 0's", "rank 0's"]


def late_collective_on_the_hybrid_mesh(env) -> tuple[float, str]:
    """Rank 1 comes late to an all-reduce of its node's shard group (ranks 0 and 1): how long
    rank 0 waited before giving up, and why."""
    import torch
    import torch.distributed as dist

    from fsdp_utils import hybrid_mesh

    group = hybrid_mesh(env.device, ranks_per_node=2).get_group("shard")
    if env.rank == 1:
        time.sleep(4 * SHORT_TIMEOUT_S)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        error = ""
    except RuntimeError as e:
        error = str(e).splitlines()[0]
    return time.monotonic() - start, error


@pytest.mark.timeout(120)
def test_hybrid_mesh_groups_time_out_after_the_pg_timeout():
    """The mesh's own groups get --pg-timeout, not the backend's default of 30 minutes. Four
    ranks, two "nodes": at two, the shard group would be the whole world, which has it."""
    from dist_harness import spawn

    (waited, error), *_ = spawn(
        late_collective_on_the_hybrid_mesh, 4, pg_timeout_s=SHORT_TIMEOUT_S, timeout=100
    )
    assert error, "rank 0's collective should have timed out"
    assert SHORT_TIMEOUT_S - 0.5 < waited < 3 * SHORT_TIMEOUT_S, (waited, error)


# The run's --pg-timeout in the watchdog's test: the bound within which a dead peer ends a rank
# that nothing else would wake.
WATCHED_TIMEOUT_S = 8


def wait_for_ever_beside_a_dying_peer(env, folder) -> None:
    """Rank 1 dies (SIGKILL), writing the time first to folder/killed; rank 0 waits where no
    timeout reaches it, standing in for a replayed CUDA graph's collective (NCCL's watchdog
    never sees those), its stderr in folder/rank0.err."""
    peer_failures.say_where(f"at rank {env.rank}'s stand-in for a replay")
    if env.rank == 1:
        (folder / "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    os.dup2(os.open(folder / "rank0.err", os.O_WRONLY | os.O_CREAT), 2)
    threading.Event().wait()


@pytest.mark.timeout(150)
def test_a_dead_peer_ends_a_rank_that_no_timeout_would_wake(tmp_path):
    """The watchdog asks the peers' pulses every few seconds: rank 0 prints the line an eager
    run's failed collective gets and exits with its status, within --pg-timeout of the death."""
    from dist_harness import spawn_outcomes
    from utils import EXIT_STATUS

    outcomes = spawn_outcomes(
        wait_for_ever_beside_a_dying_peer,
        2,
        tmp_path,
        pg_timeout_s=WATCHED_TIMEOUT_S,
        timeout=4 * WATCHED_TIMEOUT_S,
    )
    error = tmp_path / "rank0.err"
    waited = error.stat().st_mtime - float((tmp_path / "killed").read_text())
    print(f"rank 0 named its dead peer {waited:.1f} s after it died: {error.read_text()}")
    assert outcomes == [("died", EXIT_STATUS["peer_failed"]), ("died", -signal.SIGKILL)]
    where = "at rank {}'s stand-in for a replay"
    assert re.fullmatch(
        rf"error: rank 0: rank\(s\) 1 died or hung; last seen: rank 0 {where.format(0)}; "
        rf"rank 1 {where.format(1)}; stopping \(.+\)\n",
        error.read_text(),
    ), error.read_text()
    assert waited < WATCHED_TIMEOUT_S, waited

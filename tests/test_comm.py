"""comm_bench.py: nccl-tests' bandwidth definitions against hand-computed numbers, the message
sizes of the course CNN, the [COMM] line's round trip, and real 2-rank gloo runs."""

import subprocess
import time

import pytest
import torch

import comm_bench
from conftest import REPO, TINY, TORCHRUN, metrics_in, run_main
from dist_harness import spawn
from helpers import meta_model
from model import build_model, count_parameters
from precision import loss_input, make_precision, storage_dtype, wire_dtypes
from utils import COMM_FIELDS, format_comm, parse_comm


@pytest.mark.parametrize(
    "op,n,algbw,busbw",
    [
        # 2,214,056 bytes in 1 ms: algbw 2.214056 GB/s; busbw x 2(n-1)/n for all_reduce,
        # (n-1)/n else.
        ("all_reduce", 4, 2.214056, 3.321084),
        ("all_reduce", 2, 2.214056, 2.214056),
        ("all_reduce", 8, 2.214056, 3.874598),
        ("all_gather", 4, 2.214056, 1.660542),
        ("reduce_scatter", 8, 2.214056, 1.937299),
        ("all_gather", 1, 2.214056, 0.0),  # one rank sends nothing over any link
    ],
)
def test_bandwidths_follow_nccl_tests(op, n, algbw, busbw):
    got = comm_bench.bandwidths(op, 2_214_056, n, 1e-3)
    assert got == pytest.approx((algbw, busbw))


def test_an_unknown_collective_is_refused():
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        comm_bench.bus_factor("broadcast", 2)


def test_a_bucket_closes_once_it_reaches_its_cap_and_the_last_cap_repeats():
    # caps 10, then 20: 4 + 6 reaches 10; 5 + 10 + 7 passes 20; 30 alone; 1 left over.
    assert comm_bench.fill_buckets([4, 6, 5, 10, 7, 30, 1], [10, 20]) == [10, 22, 30, 1]


def test_message_sizes_of_the_course_cnn():
    model = build_model("cnn")
    grad = count_parameters(model) * 4
    assert comm_bench.ddp_buckets(model, 4, rebuilt=False) == [grad]
    assert sum(comm_bench.ddp_buckets(model, 4)) == grad
    # The classifier, 1024x512 + 512 + 512x10 + 10 parameters, is the one block large enough
    # for a unit of its own; the root holds the three conv blocks' 23,584.
    units = comm_bench.fsdp_units(model, 4)
    assert units == {"root": 23_584 * 4, "classifier": 529_930 * 4}
    assert sum(units.values()) == grad
    assert comm_bench.fsdp_units(model, 2)["root"] * 2 == units["root"]  # bf16 gathers halve


def _ddp_logged_buckets(env, models: dict[str, list[str]]) -> dict:
    """DDP's own record of its buckets (bytes, in the order it reduces them), for each
    precision's models (models: --precision -> names) built and stepped as a run of that
    --precision builds and steps them (session.build_trainer: in its storage dtype; under
    autocast in bf16 and fp16) and wrapped as ddp_utils wraps them: at construction, and as
    rebuilt after the first iteration."""
    from ddp_utils import get_ddp_model

    found = {}
    for precision, names in models.items():
        torch.set_default_dtype(storage_dtype(precision))
        steps = make_precision(precision, env.device, strategy="ddp")
        for name in names:
            model = get_ddp_model(build_model(name), env.device)
            for _ in range(3):  # rebuilt in the second forward, logged by the third's
                images, labels = torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)
                with steps.autocast(env.device):
                    logits = model(images)
                torch.nn.functional.cross_entropy(loss_input(logits), labels).backward()
            logged = model._get_ddp_logging_data()
            found[precision, name] = [
                [int(size) for size in logged[key].split(",")]
                for key in ("bucket_sizes", "rebuilt_bucket_sizes")
            ]
    return found


@pytest.mark.timeout(180)
def test_the_timed_buckets_are_those_ddp_logs():
    """What --comm-benchmark times as DDP's messages at each --precision (comm_bench.messages:
    the whole gradient, then each rebuilt bucket) is what DDP logs (the CNN's bytes, torch 2.14:
    docs/concepts.md; ResNet-18's middle bucket passes the 25 MiB cap). Under bf16 autocast
    the gradients stay fp32, as timed, but the classifier's first bias reaches DDP after the
    first bucket's 1 MiB cap is reached: a bucket later than the parameters' reverse order,
    which --comm-benchmark times."""
    models = {"fp32": ["cnn", "resnet18"], "fp64": ["cnn"], "bf16": ["cnn"]}
    (logged,) = spawn(_ddp_logged_buckets, 1, models, timeout=160)
    for precision, names in models.items():
        _, reduced = wire_dtypes(precision, "ddp")
        for name in names:
            model = build_model(name)
            messages = comm_bench.messages(model, precision, "ddp", [])
            timed = [size for op, _, size in messages if op == "all_reduce"]  # grad, bucket0, ...
            assert sum(timed[1:]) == count_parameters(model) * reduced.itemsize
            if precision == "bf16":  # the classifier's first bias a bucket later than timed
                bias = model.classifier[1].bias.numel() * 4
                grad, first, second = timed
                timed = [grad, first - bias, second + bias]
            assert [timed[:1], timed[1:]] == logged[precision, name], (precision, name)
    assert logged["bf16", "cnn"][1] == [2_117_672, 96_384]


def test_comm_line_round_trip():
    row = {
        "op": "all_gather",
        "label": "unit_conv1",
        "bytes": 1792,
        "world_size": 2,
        "time_us": 242.5,
        "algbw_gbps": 0.0073897,
        "busbw_gbps": 0.00369485,
        "device": "cpu",
        "backend": "gloo",
        "job_id": "local",
    }
    line = format_comm(row)
    assert line.startswith("[COMM] op=all_gather label=unit_conv1 bytes=1792 world_size=2 ")
    assert parse_comm("0: " + line) == row  # srun -l prefix too
    assert parse_comm(line.replace(" busbw_gbps=0.00369485", "")) is None  # a field missing
    assert parse_comm("[METRIC] epoch=1") is None


def _tiny_benchmark(env):
    return comm_bench.run_comm_benchmark(
        meta_model(), env.device, "fp32", "ddp", largest=16 << 10, repeats=(1, 3, 2)
    )


def _round_of_sleeps(env):
    calls = []

    def run():
        calls.append(1)
        time.sleep(0.02)

    return comm_bench.time_round(run, env.device, 5), len(calls)


def test_a_round_times_its_collectives_back_to_back_and_gives_the_time_of_one():
    seconds, calls = spawn(_round_of_sleeps, 1)[0]
    assert calls == 5
    assert 0.02 <= seconds < 0.03


@pytest.mark.timeout(120)
def test_two_gloo_ranks_measure_every_message():
    ranks = spawn(_tiny_benchmark, 2, timeout=100)
    assert ranks[0] == ranks[1]  # every rank reports the slowest rank's median
    rows = ranks[0]
    sweep = [(r["op"], r["bytes"]) for r in rows if r["label"] == "sweep"]
    assert sweep == [(op, size) for size in (4096, 16384) for op in comm_bench.OPS]
    assert {r["label"] for r in rows if r["op"] == "all_gather"} >= {"unit_root", "sweep"}
    for row in rows:
        assert row["world_size"] == 2 and row["time_us"] > 0
        factor = 1.0 if row["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n at n=2
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        parsed = parse_comm(format_comm(row))
        assert parsed and all(k in parsed for k in COMM_FIELDS)


@pytest.mark.timeout(180)
def test_benchmark_py_comm_under_torchrun():
    done = subprocess.run(
        [*TORCHRUN, "--nproc_per_node=2", "benchmark.py", "--comm"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [r for r in map(parse_comm, done.stdout.splitlines()) if r]
    assert rows and len(rows) == done.stdout.count("[COMM]")  # rank 0 alone prints
    assert {r["op"] for r in rows} == set(comm_bench.OPS)
    assert {r["world_size"] for r in rows} == {2}


@pytest.mark.timeout(200)
def test_comm_benchmark_leaves_training_as_it_was():
    """--comm-benchmark draws no random number and touches no model: the same losses."""
    args = [*TINY, "--epochs", "1", "--batch-size", "32", "--no-checkpoint"]
    plain, measured = (run_main(args + extra) for extra in ([], ["--comm-benchmark"]))
    assert plain.returncode == measured.returncode == 0, measured.stderr[-2000:]
    assert "[COMM]" not in plain.stdout and parse_comm(
        next(line for line in measured.stdout.splitlines() if line.startswith("[COMM]"))
    )
    keys = ("train_loss", "val_loss", "acc")
    assert [[m[k] for k in keys] for m in metrics_in(plain.stdout)] == [
        [m[k] for k in keys] for m in metrics_in(measured.stdout)
    ]

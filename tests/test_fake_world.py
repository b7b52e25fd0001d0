"""FSDP and FSDP2 at world size 8 in one process: torch's fake process group stands in for the
other seven ranks, so that the sharding of an 8-GPU run is built, stepped and planned here.

What it proves: each of `full`, `grad_op` and `hybrid` (2 nodes x 4) wraps the model, runs a
training step, and leaves one rank holding 1/8 (1/4 for hybrid: a node's share) of the
parameters, gradients and optimizer state, and planning 1/8 (1/4) of the model for a sharded
checkpoint (torch.distributed.checkpoint's save plan of rank 0). What it does not: the fake group
moves no data (every collective returns at once with what the buffers held), so nothing about
NCCL, bandwidth, or the numerics between ranks; those need real ranks (test_equivalence.py on
gloo, `run_benchmarks.py --verify` on a cluster). On a GPU the same test also prints one rank's
CUDA peak at N = 8, the number to set beside the course's FSDP 8-GPU `peak_mem`."""

import pytest
import torch

from dist_harness import in_fresh_process
from model import build_model

pytestmark = pytest.mark.fast  # make test-fast

WORLD, PER_NODE = 8, 4
ON_A_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
SETUPS = [(s, sh) for s in ("fsdp", "fsdp2") for sh in ("full", "grad_op", "hybrid")]


def one_rank_of_eight(device_type: str) -> dict:
    """Rank 0 of 8 (fake group): per strategy and sharding, the bytes of state it holds, the
    elements of its checkpoint plan, and (CUDA) its allocator peak; and the same of the whole
    model trained unwrapped, for reference."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from config import Config
    from fsdp_utils import get_fsdp2_model, get_fsdp_model
    from measure import state_bytes
    from model import build_model
    from optim import make_optimizer

    device = torch.device(device_type)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    wrap = {"fsdp": get_fsdp_model, "fsdp2": get_fsdp2_model}
    images = torch.randn(256 // WORLD, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (256 // WORLD,), device=device)

    def step(model, strategy) -> torch.optim.Optimizer:
        optimizer = make_optimizer(Config(strategy=strategy), model)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        return optimizer

    found = {}
    whole = build_model("cnn").to(device)
    found["whole"] = {"state": state_bytes(whole, step(whole, "single")), "planned": None}
    for strategy, sharding in SETUPS:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = wrap[strategy](
            build_model("cnn"),
            device,
            sharding=sharding,
            precision="fp32",
            cpu_offload=False,
            ranks_per_node=PER_NODE,
        )
        state = state_bytes(model, step(model, strategy))
        planner = DefaultSavePlanner()
        planner.set_up_planner(get_model_state_dict(model), is_coordinator=True)
        planned = sum(
            torch.Size(item.tensor_data.chunk.sizes).numel()
            for item in planner.create_local_plan().items
            if item.tensor_data is not None
        )
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        found[f"{strategy} {sharding}"] = {"state": state, "planned": planned, "peak": peak}
    dist.destroy_process_group()
    return found


@pytest.mark.timeout(240)
@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=ON_A_GPU)])
def test_one_rank_of_eight_holds_and_plans_its_share(device_type):
    found = in_fresh_process(one_rank_of_eight, device_type)
    whole = found.pop("whole")
    tensors = [p.shape for p in build_model("cnn").parameters()]
    for name, seen in found.items():
        shards = PER_NODE if name.endswith("hybrid") else WORLD
        # The plan cuts every tensor along its first dimension: rank 0 writes the first
        # ceil(rows / shards) rows of each.
        planned = sum(-(-shape[0] // shards) * shape[1:].numel() for shape in tensors)
        # Its state: the share of each, padded by at most a row of every tensor (FSDP2 shards
        # rows; FSDP1 flat buffers, padded to a multiple of the shards).
        slack = 16 * sum(shape[1:].numel() for shape in tensors)
        print(
            f"{name}: {seen['state']:,} bytes of state (whole model {whole['state']:,}), "
            f"{seen['planned']:,} elements planned"
            + (f", CUDA peak {seen['peak'] / 2**20:.1f} MB" if seen["peak"] else "")
        )
        assert seen["planned"] == planned, (seen["planned"], planned)
        assert whole["state"] / shards <= seen["state"] <= whole["state"] / shards + slack

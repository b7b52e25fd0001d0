"""The answers of docs/concepts.md, shown with the project's own code.

Each test runs what one answer claims: in this process where one rank is enough, on 2 real
gloo ranks (dist_harness.spawn) where the claim is about several; where an answer states how
torch works (DDP's buffer broadcasts, its bucket copies, the sampler's padding, 16-bit
arithmetic), the test counts it, so that it fails when the mechanism changes. The last tests
check the document itself: every question of the course and of EXERCISES.md has its heading,
every `file.py:name` names a function or class that exists, and every line the page quotes,
`(code: ...)`, is still in the one named.
"""

import ast
import contextlib
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmark import OperationCounter
from data import ShardSampler, make_synthetic, validation_weights
from dist_harness import spawn
from helpers import meta_model
from model import build_model

REPO = Path(__file__).resolve().parent.parent
CONCEPTS = REPO / "docs" / "concepts.md"
EXERCISES = REPO / "EXERCISES.md"
SEED = 42
pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]


def batch(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


class Dispatched(OperationCounter):
    """The operations dispatched by overload (aten.mul.out), and c10d's broadcasts of
    floating-point tensors: DDP's of the buffers (its rebuild of the buckets broadcasts integer
    indices)."""

    def __init__(self):
        super().__init__(by_overload=True)
        self.float_broadcasts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) == "c10d.broadcast_":
            self.float_broadcasts += any(t.is_floating_point() for t in args[0])
        return super().__torch_dispatch__(func, types, args, kwargs)


# ----------------------------------------------------------------------------- sampler


def test_without_a_sampler_every_rank_sees_the_same_images_with_it_disjoint_shards():
    """Where the world size does not divide the set, DistributedSampler (drop_last=False, as
    data.build_loaders makes it) pads the shared permutation with its first indices up to a
    multiple of the world size: at 2 ranks, 1001 images give shards of 501, one in both."""
    size, world = 1000, 2
    # Without a sampler, each rank iterates the data set (or shuffles it with the same seed).
    no_sampler = [
        torch.randperm(size, generator=torch.Generator().manual_seed(SEED)).tolist()
        for _ in range(world)
    ]
    assert no_sampler[0] == no_sampler[1]
    # With the project's sampler (data.build_loaders makes the same one for training).
    shards = []
    for rank in range(world):
        sampler = ShardSampler(size, world, rank, shuffle=True, seed=SEED)
        sampler.set_epoch(0)
        shards.append(list(sampler))
    assert len(shards[0]) == len(shards[1]) == size // world
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(size))
    size = 1001
    shards = [list(ShardSampler(size, world, rank, shuffle=True, seed=SEED)) for rank in range(2)]
    assert len(shards[0]) == len(shards[1]) == 501
    assert set(shards[0]) | set(shards[1]) == set(range(size))
    assert len(set(shards[0]) & set(shards[1])) == 1


def test_without_set_epoch_every_epoch_repeats_the_first_shuffle():
    size, world = 1000, 2

    def epochs(call_set_epoch: bool) -> list[list[list[int]]]:
        samplers = [ShardSampler(size, world, r, shuffle=True, seed=SEED) for r in range(world)]
        orders = []
        for epoch in range(2):
            for sampler in samplers:
                if call_set_epoch:  # what data.py's Loaders.set_position does every epoch
                    sampler.set_epoch(epoch)
            orders.append([list(sampler) for sampler in samplers])
        return orders

    without = epochs(call_set_epoch=False)
    assert without[0] == without[1]  # the same shard, in the same order, every epoch
    first, second = epochs(call_set_epoch=True)
    assert first == without[0] and all(a != b for a, b in zip(first, second))
    assert not set(second[0]) & set(second[1])  # one shared permutation: still disjoint


# ----------------------------------------------------------------------------- zero_grad


def test_without_zero_grad_the_second_backward_adds_to_the_first():
    torch.manual_seed(SEED)
    model = build_model("cnn")
    x, y = batch()

    def backward() -> list[torch.Tensor]:
        F.cross_entropy(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    first = backward()
    second = backward()  # no zero_grad in between: accumulates
    for g1, g2 in zip(first, second):
        torch.testing.assert_close(g2, 2 * g1)
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.zero_grad(set_to_none=True)  # what train.py's Learner.step does first
    assert all(p.grad is None for p in model.parameters())
    for g1, g3 in zip(first, backward()):
        torch.testing.assert_close(g3, g1)


# ----------------------------------------------------------------------------- DDP vs FSDP


def _parameters_after_one_step(env) -> dict:
    return {strategy: _one_step(env, strategy) for strategy in ("ddp", "fsdp")}


def _one_step(env, strategy: str) -> dict:
    from ddp_utils import get_ddp_model
    from fsdp_utils import get_fsdp_model

    torch.manual_seed(SEED)  # the same initial weights on every rank
    model = build_model("cnn")
    full = sum(p.numel() for p in model.parameters())
    wrap = get_ddp_model if strategy == "ddp" else get_fsdp_model
    model = wrap(model, env.device)
    held = sum(p.numel() for p in model.parameters())
    bytes_held = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(seed=env.rank)  # every rank its own data
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"full": full, "held": held, "bytes": bytes_held, "flat": flat}


def test_ddp_replicates_every_parameter_fsdp_full_shard_holds_half_of_them_at_two_ranks():
    ranks = spawn(_parameters_after_one_step, 2, timeout=100)
    ddp, fsdp = [r["ddp"] for r in ranks], [r["fsdp"] for r in ranks]
    for r in ddp:
        assert r["held"] == r["full"] == 553_514
    # Different data on each rank, yet identical parameters after the step: averaged gradients.
    assert torch.equal(ddp[0]["flat"], ddp[1]["flat"])
    full = fsdp[0]["full"]
    for r in fsdp:
        assert 0.45 < r["held"] / full < 0.55, (r["held"], full)
        assert 0.45 < r["bytes"] / (4 * full) < 0.55
    assert fsdp[0]["held"] + fsdp[1]["held"] == full  # the shards add up to the model


def _ddp_initial_weights(env) -> torch.Tensor:
    from ddp_utils import get_ddp_model

    torch.manual_seed(SEED + env.rank)  # every rank initialises differently
    model = get_ddp_model(torch.nn.Conv2d(3, 4, 3), env.device)
    return model.module.weight.detach().clone()


def test_ddp_starts_from_rank0s_parameters():
    ranks = spawn(_ddp_initial_weights, 2, timeout=90)
    torch.manual_seed(SEED)
    rank0_init = torch.nn.Conv2d(3, 4, 3).weight.detach()
    for weights in ranks:  # rank 0's initial weights on both: broadcast at construction
        assert torch.equal(weights, rank0_init)


# What each forward of _buffer_broadcasts runs: training (with backward) or evaluation (under
# no_grad), and whether it syncs gradients (False: under no_sync, as --grad-accum's micro-batches
# before the last, fsdp_utils.gradient_sync).
FORWARDS = [
    ("train", True),
    ("train", True),
    ("eval", True),
    ("eval", True),
    ("train", True),
    ("train", False),
    ("train", True),
    ("train", True),
]
# Rank 0's buffers are broadcast before a forward only where the forward before it trained and
# synced (torch's nn/parallel/distributed.py: _check_sync_bufs_pre_fwd reads
# require_forward_param_sync, which the previous forward's _post_forward set); the first
# forward, after the constructor's broadcast, too. Not "before every training forward": that
# would be [1, 1, 0, 0, 1, 1, 1, 1].
BROADCASTS_BEFORE = [1, 1, 1, 0, 0, 1, 0, 1]


def _buffer_broadcasts(env) -> dict:
    """Per forward of FORWARDS: the broadcasts DDP issued, and the running mean the module
    held when its own forward started (after DDP's broadcast, if any)."""
    from ddp_utils import get_ddp_model

    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    model = get_ddp_model(model, env.device)
    bn = model.module[1]
    entering = []
    model.module.register_forward_pre_hook(lambda *_: entering.append(bn.running_mean.clone()))
    x, _ = batch(seed=env.rank)  # every rank its own data: its own batch statistics
    broadcasts = []
    for mode, sync in FORWARDS:
        model.train(mode == "train")
        accumulating = contextlib.nullcontext() if sync else model.no_sync()
        with Dispatched() as dispatched, accumulating, torch.set_grad_enabled(mode == "train"):
            out = model(x)
            if mode == "train":
                out.sum().backward()
        broadcasts.append(dispatched.float_broadcasts)
    return {"broadcasts": broadcasts, "entering": entering}


def test_ddp_broadcasts_buffers_only_after_a_synced_training_forward():
    ranks = spawn(_buffer_broadcasts, 2, timeout=90)
    for r in ranks:
        assert r["broadcasts"] == BROADCASTS_BEFORE
    entering = [r["entering"] for r in ranks]
    for i, count in enumerate(BROADCASTS_BEFORE):
        if count:  # rank 0's statistics on both ranks
            assert torch.equal(entering[0][i], entering[1][i]), i
    # The forward after an accumulating one starts from each rank's own statistics.
    after_no_sync = FORWARDS.index(("train", False)) + 1
    assert not torch.equal(entering[0][after_no_sync], entering[1][after_no_sync])


def _backward_copies(env) -> dict:
    """Per (gradient_as_bucket_view, zero_grad's set_to_none): the operations of one backward
    of the CNN under DDP that move gradients, after 3 steps (the buckets rebuilt, the
    gradients views of them from then on)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    moves = ("aten.mul.out", "aten.copy_.default", "aten.add_.Tensor", "aten.div_.Scalar")
    found = {}
    for view in (True, False):
        for set_to_none in (True, False):
            torch.manual_seed(SEED)
            model = DDP(build_model("cnn"), gradient_as_bucket_view=view)
            optimizer = torch.optim.Adam(model.parameters())
            x, y = batch()
            for _ in range(3):
                optimizer.zero_grad(set_to_none=set_to_none)
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            loss = F.cross_entropy(model(x), y)
            with Dispatched() as dispatched:
                loss.backward()
            found[view, set_to_none] = {op: dispatched.counts[op] for op in moves}
    return found


def test_bucket_views_save_the_copy_back_not_the_copy_in():
    """With zero_grad(set_to_none=True), as train.py's step, each backward makes fresh
    gradients that DDP copies into its buckets (mul.out: divided by the world size on the
    way), with views or without; views save the copy back (copy_). Keeping the gradients
    (set_to_none=False), autograd adds into the bucket and DDP divides it in place."""
    (found,) = spawn(_backward_copies, 1, timeout=90)
    n = len(list(build_model("cnn").parameters()))  # 10 tensors, each its own copy
    copy_in, copy_back = "aten.mul.out", "aten.copy_.default"
    add, divide = "aten.add_.Tensor", "aten.div_.Scalar"
    assert found[True, True] == {copy_in: n, copy_back: 0, add: 0, divide: 0}
    assert found[False, True] == {copy_in: n, copy_back: n, add: 0, divide: 0}
    assert found[True, False] == {copy_in: 0, copy_back: 0, add: n, divide: n}


# ----------------------------------------------------------------------------- precision


def test_fp16_loses_small_gradients_that_bf16_and_a_scaled_fp16_keep():
    """One batch's gradient of the CNN cast to fp16 loses its smallest elements (below fp16's
    smallest subnormal, 6e-8: zero), where bf16, with fp32's exponent range, keeps every one,
    and so does fp16 after GradScaler's first scale, 2**16. Summed over 8 ranks' gradients (8
    batches), each addition rounded to the format: bf16's 8 significant bits leave the sum off
    by about 2**-8, fp32's 24 by about 2**-24. Prints what concepts.md quotes."""
    torch.manual_seed(SEED)
    model = build_model("cnn")
    grads = []
    for rank in range(8):
        model.zero_grad()
        images, labels = batch(32, seed=rank)
        F.cross_entropy(model(images), labels).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    g = grads[0][grads[0] != 0]

    def lost(dtype: torch.dtype, scale: float = 1.0) -> int:
        return int(((g * scale).to(dtype) == 0).sum())

    def subnormal(dtype: torch.dtype, scale: float = 1.0) -> int:
        cast = (g * scale).to(dtype)
        return int(((cast != 0) & (cast.abs() < torch.finfo(dtype).tiny)).sum())

    exact = torch.stack(grads).double().sum(0)

    def sum_error(dtype: torch.dtype) -> float:
        total = grads[0].to(dtype)
        for other in grads[1:]:
            total = total + other.to(dtype)
        return float((total.double() - exact).norm() / exact.norm())

    scale = torch.amp.GradScaler("cpu").get_scale()
    print(
        f"{g.numel()} nonzero of {grads[0].numel()}; fp16 zero {lost(torch.float16)}, "
        f"subnormal {subnormal(torch.float16)}; bf16 zero {lost(torch.bfloat16)}; fp16 x "
        f"{scale:.0f}: zero {lost(torch.float16, scale)}, subnormal "
        f"{subnormal(torch.float16, scale)}, inf {int((g * scale).half().isinf().sum())}; sum of "
        f"8 off by {sum_error(torch.bfloat16):.2g} (bf16), {sum_error(torch.float16):.2g} "
        f"(fp16), {sum_error(torch.float32):.2g} (fp32)"
    )
    assert lost(torch.float16) > 0 and lost(torch.bfloat16) == 0
    assert scale == 2**16 and lost(torch.float16, scale) == 0
    assert 2**-10 < sum_error(torch.bfloat16) < 2**-6
    assert sum_error(torch.float32) < 2**-20


# ----------------------------------------------------------------------------- no_grad


def test_no_grad_builds_no_autograd_graph_and_saves_no_activations():
    torch.manual_seed(SEED)
    model = build_model("cnn").eval()
    x, _ = batch()
    saved = []

    def count(tensors: list):
        def pack(t):
            tensors.append(t.numel() * t.element_size())
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    with count(saved):
        out = model(x)
    assert out.requires_grad and out.grad_fn is not None and sum(saved) > 0
    saved_no_grad = []
    with count(saved_no_grad), torch.no_grad():  # as train.py's Trainer.evaluate runs
        out = model(x)
    assert not out.requires_grad and out.grad_fn is None
    assert sum(saved_no_grad) == 0  # nothing kept for a backward pass that never comes


# ----------------------------------------------------------------------------- train/eval


def test_train_and_eval_mode_give_the_cnn_the_same_output_a_resnet_with_batchnorm_not():
    torch.manual_seed(SEED)
    cnn = build_model("cnn")
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(cnn.train()(x), cnn.eval()(x), rtol=0, atol=0)
    model = build_model("resnet18")
    x, _ = batch(4)
    bn = model.bn1
    before = bn.running_mean.clone()
    with torch.no_grad():
        in_eval = model.eval()(x)
        assert torch.equal(bn.running_mean, before)  # eval: uses the running statistics
        in_train = model.train()(x)  # train: the batch's own statistics, and updates them
    assert not torch.allclose(in_train, in_eval, atol=1e-3)
    assert not torch.equal(bn.running_mean, before)


# ----------------------------------------------------------------------------- validation

VAL_IMAGES = 101  # odd: the sampler pads one rank's shard with a repeat


def _accuracy_counts(model, images, labels, rank: int, world: int) -> tuple[float, float]:
    sampler = ShardSampler(len(labels), world, rank, shuffle=False)  # as build_loaders' val
    idx = torch.tensor(list(sampler))
    with torch.no_grad():
        hit = (model(images[idx]).argmax(1) == labels[idx]).float()
    weights = validation_weights(0, len(idx), rank, world, len(labels), torch.device("cpu"))
    return float((hit * weights).sum()), float(weights.sum())


def _validation_model_and_data():
    torch.manual_seed(SEED)
    model = build_model("cnn").eval()
    _, val = make_synthetic(0, VAL_IMAGES, SEED)
    images = (val.images.float() - 128) / 64
    return model, images, val.labels


def _validate_on_rank(env) -> dict:
    from measure import all_reduce

    model, images, labels = _validation_model_and_data()
    correct, count = _accuracy_counts(model, images, labels, env.rank, env.world_size)
    total_correct, total_count = all_reduce([correct, count], env.device)
    return {
        "own": 100 * correct / count,
        "reduced": 100 * total_correct / total_count,
        "count": total_count,
    }


def test_validation_all_reduce_turns_per_rank_accuracies_into_the_whole_sets():
    model, images, labels = _validation_model_and_data()
    with torch.no_grad():
        one_process = 100 * int((model(images).argmax(1) == labels).sum()) / VAL_IMAGES
    ranks = spawn(_validate_on_rank, 2, timeout=90)
    assert ranks[0]["own"] != ranks[1]["own"]  # each rank alone sees only its half
    for r in ranks:
        assert r["count"] == VAL_IMAGES  # every image once: the padding repeat has weight 0
        assert r["reduced"] == pytest.approx(one_process, rel=1e-12)


# ----------------------------------------------------------------------------- FLOPs per stage


def unit_flop_shares() -> dict[str, float]:
    """Each shard unit's share of the CNN's training FLOPs per image, counted by torch's
    FlopCounterMode per module, as cost_model.training_flops_per_image counts the whole."""
    from torch.utils.flop_counter import FlopCounterMode

    from cost_model import training_flops_per_image

    with torch.device("meta"):
        model = build_model("cnn")
        images, labels = torch.empty(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(images), labels).backward()
    by_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    names = [name for name, child in model.named_children() if child in model.shard_units()]
    units = {name: by_module.get(f"CNN.{name}", 0) // 2 for name in names}
    assert sum(units.values()) == training_flops_per_image("cnn", 10, (3, 32, 32))
    return {name: flops / sum(units.values()) for name, flops in units.items()}


def test_the_quoted_flop_shares_and_stage_bounds_are_the_counted_ones():
    """concepts.md's shares per unit and the speed-ups that the slowest stage bounds at 4 and 2
    stages (model.cut: conv1+conv2 | conv3+classifier), and performance.md's reading of them."""
    share = unit_flop_shares()
    pct = {name: f"{100 * value:.0f}%" for name, value in share.items()}
    assert pct["conv2"] == pct["conv3"]
    halves = [share["conv1"] + share["conv2"], share["conv3"] + share["classifier"]]
    concepts = " ".join(CONCEPTS.read_text().split())
    for quoted in (
        f"does {pct['classifier']} of the FLOPs, `conv1` {pct['conv1']}, `conv2` and `conv3` "
        f"{pct['conv2']} each",
        f"slowest stage, {pct['conv2']} of the work, bounds the step: at most "
        f"{1 / max(share.values()):.1f} times",
        f"({100 * halves[0]:.0f}% / {100 * halves[1]:.0f}%: at most {1 / max(halves):.1f} times)",
    ):
        assert quoted in concepts
    performance = " ".join((REPO / "docs" / "performance.md").read_text().split())
    assert f"do {pct['conv2']} of the FLOPs each, `conv1` {pct['conv1']}" in performance


# ----------------------------------------------------------------------------- ResNet-50's memory


def test_the_resnet50_state_quoted_is_cost_models_prediction():
    """The answer to Q7.3a: ResNet-50's parameters, its state per GPU at 8 GPUs under DDP and
    FSDP (and FSDP2), and its largest FSDP unit, as cost_model counts them from the model's
    shapes; and the peaks the answer adds up from them, in MiB."""
    from config import Config
    from cost_model import state_mem
    from model import count_parameters, unit_parameters
    from utils import MB

    model = meta_model("resnet50")
    psi, tensors = count_parameters(model), len(list(model.parameters()))
    state = {s: state_mem(Config(strategy=s), model, 8) for s in ("ddp", "fsdp", "fsdp2")}
    largest = max(sum(p.numel() for p in unit) for unit in unit_parameters(model).values())
    assert state["ddp"] == 16 * psi + 4 * tensors
    concepts = " ".join(CONCEPTS.read_text().split())
    for quoted in (
        f"Ψ = {psi:,} in {tensors} parameter tensors",
        f"16Ψ + 4·{tensors} = {state['ddp']:,} bytes ({state['ddp'] / MB:.1f} MiB)",
        f"under FSDP `full` {state['fsdp']:,} ({state['fsdp'] / MB:.1f} MiB",
        f"FSDP2 {state['fsdp2']:,})",
        f"`layer4` unit, {largest:,} parameters ({100 * largest / psi:.0f}%)",
        f"of the {(state['ddp'] - state['fsdp']) / MB:.0f} MiB of state FSDP shards away",
        f"about {state['ddp'] / MB:.1f} + 32 x 32.7 = {state['ddp'] / MB + 32 * 32.7:,.0f} MiB",
        f"about {state['fsdp'] / MB:.1f} + 32 x 40.5 = {state['fsdp'] / MB + 32 * 40.5:,.0f} MiB",
    ):
        assert quoted in concepts, quoted


# ----------------------------------------------------------------------------- the document

QUESTIONS = [
    "Why `x.shape[1:]`",
    "Why synchronise after the download",
    "What happens without a `DistributedSampler`",
    "replicated or sharded under DDP",
    "`auto_wrap_policy`",
    "`MixedPrecision`",
    "`FULL_SHARD`",
    "When to choose FSDP",
    "`cleanup()`",
    "Why does `local_rank` pick the device",
    "`torchrun` instead of `srun`",
    "forgetting `zero_grad`",
    "Why `no_grad` in validation",
    "Why all-reduce after validation",
    "Why `model.train()` at the start of each epoch",
    "Which method is faster",
    "Which scales",
    "Which saves memory",
]


# ----------------------------------------------------------------------------- pipeline schedules


def drawn_schedules() -> list[list[list[str]]]:
    """The schedules concepts.md draws: per drawing, per stage, the slot contents ('' idle)."""
    blocks = re.findall(r"```\n        time ->\n(.*?)```", CONCEPTS.read_text(), re.S)
    return [
        [line.split("|")[1:-1] for line in block.splitlines() if line.startswith("stage ")]
        for block in blocks
    ]


def in_flight_peak(slots: list[str]) -> int:
    """The most micro-batches a stage holds activations of: forwarded, not yet backwarded."""
    held, peak = 0, 0
    for op in slots:
        held += (op.startswith("F")) - (op.startswith("B"))
        peak = max(peak, held)
    return peak


def test_the_drawn_schedules_obey_the_pipeline_and_idle_the_textbook_bubble():
    """GPipe and 1F1B for 4 stages and 8 micro-batches as drawn: every forward and backward
    once per stage, each after what it depends on (Fi after the stage before's Fi, Bi after
    the stage after's Bi and its own Fi), each stage idle pipeline_utils.ideal_bubble of the
    slots; 1F1B holds at most 4 micro-batches' activations, GPipe's first stage all 8."""
    from pipeline_utils import ideal_bubble

    stages, micro = 4, 8
    gpipe, one_f_one_b = drawn_schedules()
    for drawing in (gpipe, one_f_one_b):
        assert len(drawing) == stages
        when = {(s, op.strip()): t for s, row in enumerate(drawing) for t, op in enumerate(row)}
        for s, row in enumerate(drawing):
            ops = sorted(op.strip() for op in row if op.strip())
            assert ops == sorted(f"{k}{i}" for k in "FB" for i in range(micro))
            idle = sum(not op.strip() for op in row) / len(row)
            assert idle == pytest.approx(ideal_bubble(stages, micro))
            for i in range(micro):
                if s > 0:
                    assert when[(s, f"F{i}")] > when[(s - 1, f"F{i}")]
                if s < stages - 1:
                    assert when[(s, f"B{i}")] > when[(s + 1, f"B{i}")]
                assert when[(s, f"B{i}")] > when[(s, f"F{i}")]
    assert in_flight_peak([op.strip() for op in gpipe[0]]) == micro
    assert max(in_flight_peak([op.strip() for op in row]) for row in one_f_one_b) == stages


def headings() -> list[str]:
    return [line for line in CONCEPTS.read_text().splitlines() if line.startswith("#")]


def test_every_question_of_the_course_has_a_heading():
    missing = [q for q in QUESTIONS if not any(q in h for h in headings())]
    assert not missing, missing


# A question of EXERCISES.md: a list item (continued on lines indented by two spaces) ending in
# its id, "? (Q4.2b)": section 4, exercise 2, its second question.
SHEET_ITEM = re.compile(r"^- (.+(?:\n  .+)*)", re.M)
QUESTION_ID = r"Q\d+\.\d+[a-z]"
ASKED = re.compile(rf"\? \(({QUESTION_ID})\)$")
# Where concepts.md answers: the line right after a heading, "Sheet questions: Q4.2b, Q4.3a."
ANSWERS = re.compile(rf"^#+ .+\n\nSheet questions: ({QUESTION_ID}(?:, {QUESTION_ID})*)\.$", re.M)


def sheet_questions(text: str) -> tuple[list[str], list[str]]:
    """The ids of the sheet's questions, in order, and what is wrong with the sheet: a question
    that carries no id, or a question mark outside a list item."""
    ids, bad = [], []
    for item in SHEET_ITEM.findall(text):
        item = " ".join(item.split())
        asked = ASKED.search(item)
        if asked:
            ids.append(asked.group(1))
        elif "?" in item:
            bad.append(f"no id: {item}")
    outside = SHEET_ITEM.sub("", text).splitlines()
    bad += [f"a question outside a list item: {line}" for line in outside if "?" in line]
    return ids, bad


def answered(text: str) -> list[str]:
    """The ids concepts.md's headings answer, in order (an id may be answered twice)."""
    return [i for line in ANSWERS.findall(text) for i in line.split(", ")]


def unpaired(sheet: str, answers: str) -> list[str]:
    ids, bad = sheet_questions(sheet)
    given = answered(answers)
    bad += [f"{i}: asked twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    bad += [f"{i}: no answer" for i in ids if i not in given]
    bad += [f"{i}: answers no question" for i in dict.fromkeys(given) if i not in ids]
    return bad


def test_every_question_of_the_sheet_has_an_answer_heading():
    """Each question of EXERCISES.md carries an id, and a heading of concepts.md answers it,
    named on the line after the heading; no heading names a question the sheet does not ask."""
    ids, _ = sheet_questions(EXERCISES.read_text())
    assert len(ids) >= 20
    assert not unpaired(EXERCISES.read_text(), CONCEPTS.read_text())


def test_the_pairing_checker_finds_unpaired_questions():
    sheet = (
        "Intro, no question.\n\n- Why? (Q1.1a)\n- And how, in two\n  lines? (Q1.1b)\n"
        "- Without an id?\n- Twice? (Q1.1a)\n- Unanswered? (Q2.1a)\n\nWhy here?\n"
    )
    answers = (
        "## One\n\nSheet questions: Q1.1a, Q1.1b.\n\nText.\n\n## Two\n\nSheet questions: Q9.9a.\n"
        "\n## Three\n\nText first.\nSheet questions: Q2.1a.\n"
    )
    assert unpaired(sheet, answers) == [
        "no id: Without an id?",
        "a question outside a list item: Why here?",
        "Q1.1a: asked twice",
        "Q2.1a: no answer",
        "Q9.9a: answers no question",
    ]


def definitions(path: Path) -> dict[str, str]:
    """The source, decorators included, of every function and class of a module, under the
    names the page uses: 'f', 'Class' and 'Class.method'."""
    text = path.read_text()
    lines = text.splitlines()

    def source(node: ast.AST) -> str:
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        return "\n".join(lines[first - 1 : node.end_lineno])

    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = source(node)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef):
                    found[f"{node.name}.{member.name}"] = source(member)
    return found


# `file.py:name`, where name is a function, class or method of that file.
REFERENCE = re.compile(r"`([\w/]+\.(?:py|sh)):([\w.]+)`")
# `file.py:name` (code: `a line of it`): the line the answer quotes.
QUOTE = re.compile(r"`([\w/]+\.py):([\w.]+)`\s+\(code: `([^`\n]+)`\)")


def bad_references(text: str, root: Path = REPO) -> list[str]:
    """What is wrong with each code reference of a page: a file, a name or a quoted line that
    is not there (a line number is no name: the page names code, never its lines)."""
    bad = []
    for file, name in REFERENCE.findall(text):
        path = root / file
        if not path.is_file():
            bad.append(f"{file}: no such file")
        elif name not in definitions(path):
            bad.append(f"{file}:{name}: no such function or class")
    for file, name, code in QUOTE.findall(text):
        path = root / file
        source = definitions(path).get(name) if path.is_file() else None
        if source is not None and code not in source:  # else already named above
            bad.append(f"{file}:{name}: does not hold `{code}`")
    return bad


def test_every_code_reference_names_a_definition_that_holds_the_code_quoted():
    text = CONCEPTS.read_text()
    assert len(REFERENCE.findall(text)) >= 15
    # Every quoted line follows the name of the code that holds it, so it is checked too.
    assert len(QUOTE.findall(text)) == text.count("(code: `")
    assert not bad_references(text)


def test_the_learners_reading_order_names_code_that_is_there():
    """docs/architecture.md's reading order for DDP against FSDP, held to the code as this page
    is: each step names a function or class that exists."""
    text = (REPO / "docs" / "architecture.md").read_text()
    order = text.split("## Where a learner starts", 1)[1].split("\n## ", 1)[0]
    assert len(REFERENCE.findall(order)) >= 10
    assert not bad_references(order)


def test_the_reference_checker_finds_bad_references(tmp_path):
    (tmp_path / "m.py").write_text(
        "class A:\n    @staticmethod\n    def f():\n        return 1\n\n\ndef g():\n    pass\n"
    )
    page = (
        "`m.py:A.f` (code: `@staticmethod`) `m.py:g` (code: `pass`) `m.py:A`\n"
        "`m.py:3` `m.py:h` `n.py:g` `m.py:g` (code: `return 1`)\n"
    )
    assert bad_references(page, tmp_path) == [
        "m.py:3: no such function or class",
        "m.py:h: no such function or class",
        "n.py: no such file",
        "m.py:g: does not hold `return 1`",
    ]

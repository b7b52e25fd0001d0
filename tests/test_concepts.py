"""The answers of docs/concepts.md, shown with the project's own code.

Each test runs what one answer claims: in this process where one rank is enough, on 2 real
gloo ranks (dist_harness.spawn) where the claim is about several. The last tests check the
document itself: every question has its heading, every `file.py:LINE` points to a line that
exists, every `file.py:name` to a function or class that exists.
"""

import ast
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data import ShardSampler, make_synthetic, validation_weights
from dist_harness import spawn
from model import build_model

REPO = Path(__file__).resolve().parent.parent
CONCEPTS = REPO / "docs" / "concepts.md"
SEED = 42
pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]


def batch(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


# ----------------------------------------------------------------------------- sampler


def test_without_a_sampler_every_rank_sees_the_same_images_with_it_disjoint_shards():
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
    optimizer.zero_grad(set_to_none=True)  # what train.py's Trainer.step does first
    assert all(p.grad is None for p in model.parameters())
    for g1, g3 in zip(first, backward()):
        torch.testing.assert_close(g3, g1)


# ----------------------------------------------------------------------------- DDP vs FSDP


def _parameters_after_one_step(env, strategy: str) -> dict:
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


def test_ddp_replicates_every_parameter_and_the_replicas_stay_equal():
    ranks = spawn(_parameters_after_one_step, 2, "ddp", timeout=90)
    for r in ranks:
        assert r["held"] == r["full"] == 553_514
    # Different data on each rank, yet identical parameters after the step: averaged gradients.
    assert torch.equal(ranks[0]["flat"], ranks[1]["flat"])


def test_fsdp_full_shard_holds_about_half_the_parameters_per_rank_at_two_ranks():
    ranks = spawn(_parameters_after_one_step, 2, "fsdp", timeout=90)
    full = ranks[0]["full"]
    for r in ranks:
        assert 0.45 < r["held"] / full < 0.55, (r["held"], full)
        assert 0.45 < r["bytes"] / (4 * full) < 0.55
    assert ranks[0]["held"] + ranks[1]["held"] == full  # the shards add up to the model


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


def test_train_and_eval_mode_give_the_same_output_for_the_cnn():
    torch.manual_seed(SEED)
    model = build_model("cnn")
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(model.train()(x), model.eval()(x), rtol=0, atol=0)


def test_train_and_eval_mode_differ_for_a_resnet_with_batchnorm():
    torch.manual_seed(SEED)
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
    from train import all_reduce

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


def headings() -> list[str]:
    return [line for line in CONCEPTS.read_text().splitlines() if line.startswith("#")]


def test_every_question_of_the_course_has_a_heading():
    missing = [q for q in QUESTIONS if not any(q in h for h in headings())]
    assert not missing, missing


def defined_names(path: Path) -> set[str]:
    """'f', 'Class' and 'Class.method' for every function and class of a module."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return names


REFERENCE = re.compile(r"`([\w/]+\.(?:py|sh)):([\w.]+)`")


def test_every_code_reference_points_to_a_line_or_definition_that_exists():
    references = REFERENCE.findall(CONCEPTS.read_text())
    assert len(references) >= 15
    bad = []
    for file, where in references:
        path = REPO / file
        if not path.is_file():
            bad.append(f"{file}: no such file")
        elif where.isdigit():
            lines = path.read_text().splitlines()
            if not 1 <= int(where) <= len(lines) or not lines[int(where) - 1].strip():
                bad.append(f"{file}:{where}: no such line, or a blank one")
        elif where not in defined_names(path):
            bad.append(f"{file}:{where}: no such function or class")
    assert not bad, bad


def test_every_line_reference_shows_the_code_the_text_quotes():
    """A `file.py:LINE` is followed by the code it means, `(code: ...)`: edits that move the
    line are caught here rather than by a reader."""
    text = CONCEPTS.read_text()
    pairs = re.findall(r"`([\w/]+\.py):(\d+)`\s+\(code: `([^`\n]+)`\)", text)
    assert len(pairs) == len(re.findall(r"`[\w/]+\.py:\d+`", text))
    for file, line, code in pairs:
        lines = (REPO / file).read_text().splitlines()
        now = [str(n) for n, text in enumerate(lines, 1) if code in text]
        assert code in lines[int(line) - 1], f"{file}:{line} should be {file}:{' or '.join(now)}"

"""Launcher variables, rendezvous, device choice and model shapes: no processes needed."""

import pytest
import torch

import distributed_utils as du
from model import MODELS, build_model, count_parameters
from utils import UsageError


@pytest.mark.parametrize("env,expected", [
    ({}, (0, 0, 1)),  # plain `python main.py`
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, (3, 1, 4)),  # torchrun / run.sh
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"},
     (5, 1, 8)),  # plain srun
    # The batch script itself (no step): SLURM's task count is not ours to wait for.
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8"}, (0, 0, 1)),
    # torchrun's variables win over SLURM's (torchrun inside an allocation).
    ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}, (1, 1, 2)),
])
def test_ranks_from_torchrun_or_slurm(env, expected):
    assert du.read_ranks(env) == expected


def test_bad_rank_variables_are_usage_errors():
    with pytest.raises(UsageError, match="outside world size"):
        du.read_ranks({"RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "4"})
    with pytest.raises(UsageError, match="not an integer"):
        du.read_ranks({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "4"})


def test_rendezvous_prefers_environment_then_slurm_job():
    assert du.rendezvous({"MASTER_ADDR": "h1", "MASTER_PORT": "1234"}) == ("h1", 1234)
    addr, port = du.rendezvous({"MASTER_ADDR": "h1", "SLURM_JOB_ID": "123456"})
    assert port == du.DEFAULT_PORT + 123456 % du.PORT_RANGE
    # Two jobs sharing a node get different ports.
    assert du.rendezvous({"MASTER_ADDR": "h", "SLURM_JOB_ID": "7"})[1] != \
        du.rendezvous({"MASTER_ADDR": "h", "SLURM_JOB_ID": "8"})[1]
    assert du.rendezvous({}) == ("127.0.0.1", du.DEFAULT_PORT)


def test_master_addr_from_nodelist_needs_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UsageError, match="set MASTER_ADDR"):
        du.rendezvous({"SLURM_JOB_NODELIST": "nid[001-002]"})


def test_device_and_backend_follow_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert du.pick_device(3) == (torch.device("cpu"), "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert du.pick_device(5) == (torch.device("cuda", 1), "nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # --gpus-per-task=1
    assert du.pick_device(3) == (torch.device("cuda", 0), "nccl")


def test_num_nodes():
    assert du.num_nodes({}) == 1
    assert du.num_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == 2
    assert du.num_nodes({"SLURM_JOB_NUM_NODES": "3", "SLURM_STEP_NUM_NODES": "2",
                         "SLURM_STEP_ID": "0"}) == 2


@pytest.mark.parametrize("batch", [1, 7, 256])
def test_model_takes_any_batch_size(batch):
    model = build_model("cnn")
    assert model(torch.randn(batch, 3, 32, 32)).shape == (batch, 10)


def test_model_rejects_wrong_image_shape():
    with pytest.raises(AssertionError, match=r"\(N, 3, 32, 32\)"):
        build_model("cnn")(torch.randn(2, 3, 28, 28))


def test_course_cnn_size():
    # conv 3->16->32->64 (3x3) and fc 1024->512->10, with biases.
    expected = (3 * 16 + 16 * 32 + 32 * 64) * 9 + 16 + 32 + 64 + 1024 * 512 + 512 + 512 * 10 + 10
    assert count_parameters(build_model("cnn")) == expected == 553_514
    assert set(MODELS) >= {"cnn"}

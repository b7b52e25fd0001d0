"""Where a graphed run's peak_mem comes from: allocated/reserved memory step by step."""
import contextlib, sys
import torch
import cuda_graphs, distributed_utils
from checkpoint import Position
from config import Config
from session import build_trainer

one_stream = sys.argv[1] == "one"
if one_stream:
    streams = {}
    @contextlib.contextmanager
    def side_stream(device):
        if device.type != "cuda":
            yield; return
        current = torch.cuda.current_stream(device)
        side = streams.setdefault(device, torch.cuda.Stream(device))
        side.wait_stream(current)
        with torch.cuda.stream(side):
            yield
        current.wait_stream(side)
    cuda_graphs.side_stream = side_stream
    import strategies; strategies.side_stream = side_stream
model = sys.argv[2]
env = distributed_utils.setup()
cfg = Config(dataset="synthetic", train_samples=256*40, val_samples=256, batch_size=256, epochs=2,
             checkpoint=False, augment=True, print_every=10**9, cuda_graphs=True, model=model)
trainer, _ = build_trainer(cfg, env)
MB = 2**20
def show(tag):
    torch.cuda.synchronize()
    print(f"{tag:>14}: alloc {torch.cuda.memory_allocated()/MB:8.1f} max {torch.cuda.max_memory_allocated()/MB:8.1f} reserved {torch.cuda.memory_reserved()/MB:8.1f} baseline {trainer.memory.baseline/MB:.1f}", flush=True)
show("built")
step = trainer.train_step
trainer.loaders.set_position(1, 0)
batches = iter(trainer.loaders.train)
for i in range(16):
    images, labels = next(batches)
    step(images, labels, trainer.loss_sum)
    show(f"step {i+1}{' graph' if step.graph is not None else ''}")
torch.cuda.reset_peak_memory_stats()
for i in range(5):
    images, labels = next(batches)
    step(images, labels, trainer.loss_sum)
show("after reset")
distributed_utils.cleanup()

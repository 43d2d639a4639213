"""A real PyTorch DDP training job for Gangway (needs torch; gloo backend).

Runs either way:

* one process per rank, started by Gangway (examples/ddp.yaml): Gangway sets
  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
* under torchrun, one torchrun per replica (examples/ddp_torchrun.yaml):
  torchrun sets the same variables for its workers.

Either way ``init_process_group(init_method="env://")`` reads them. The job
checkpoints through examples/gangway_checkpoint.py: rank 0 saves every
CKPT_EVERY steps and when the checkpoint signal (SIGTERM) arrives; every
rank learns of the signal at the next step (an all-reduce of a flag), so the
gang stops together after rank 0's save, which Gangway sees through LATEST
and uses to stop the gang early and to resume it (GANGWAY_RESUME_FROM).
"""

import os
import signal
import sys
import time

# Exit code for "this interpreter has no torch": the example jobs list it in
# restart.fail_on_exit_codes, so the job fails at once instead of restarting.
NO_TORCH = 3

try:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
except ImportError as e:
    print(
        f"ddp_train.py: PyTorch is not installed for {sys.executable} ({e}). "
        "Point the job at a Python that has it: run.env.PATH with the venv's "
        "bin first (e.g. /opt/venv/bin:/usr/local/bin:/usr/bin:/bin), in a "
        "directory the rank's account can enter (docs/JOB_ENV.md, "
        '"PyTorch from a venv").',
        file=sys.stderr,
        flush=True,
    )
    sys.exit(NO_TORCH)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gangway_checkpoint as gc  # noqa: E402

STEPS = int(os.environ.get("STEPS", "200"))
CKPT_EVERY = int(os.environ.get("CKPT_EVERY", "50"))
STEP_SECONDS = float(os.environ.get("STEP_SECONDS", "0.05"))

stop_requested = False


def on_signal(signum, _frame):
    global stop_requested
    stop_requested = True


def main():
    signal.signal(signal.SIGTERM, on_signal)
    dist.init_process_group(backend="gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    path = gc.resume_from()
    if path and os.path.exists(path):
        state = torch.load(path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"rank {rank}: resuming from {path} at step {start}", flush=True)
    print(
        f"rank {rank}/{world} on {os.environ.get('GANGWAY_NODE')} "
        f"rendezvous {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
        f"attempt {os.environ.get('GANGWAY_ATTEMPT')}",
        flush=True,
    )

    def save(step, final=False):
        state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
        p = gc.save(step, lambda tmp: torch.save(state, tmp), final=final)
        print(f"rank 0: checkpoint at step {step}: {p}", flush=True)

    step = start
    g = torch.Generator().manual_seed(1000 + rank)
    while step < STEPS:
        x = torch.randn(32, 16, generator=g)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        time.sleep(STEP_SECONDS)
        # Everyone learns that some rank got the checkpoint signal.
        flag = torch.tensor([1.0 if stop_requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            if rank == 0:
                save(step)
            dist.barrier()
            print(f"rank {rank}: stopping at step {step} for the checkpoint signal", flush=True)
            dist.destroy_process_group()
            return
        if rank == 0 and step % CKPT_EVERY == 0:
            save(step)
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        save(step, final=True)
    dist.barrier()
    print(f"rank {rank}: done at step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""One rank of the equivalence test: 30 SGD steps of a small MLP on fixed data through Poseidon.
Rank r trains on rows [r*K, (r+1)*K) of each global batch of P*K (P workers, 4 unless told);
rank 0 writes the parameters (on the CPU).

    equivalence_worker.py OUT [MODE[,MODE...]]

modes: overlap (overlap_forward, SGD with momentum), momentum (SGD with momentum, the DDP
contract), server-adam (the servers run Adam), switch
(steps of ~20 ms until 0.weight's scheme has changed twice, the plan changes forced from outside
by `poseidon plan --set`; every rank sees the same switches, so all stop at the same step;
rank 0 writes the step count and the switches too),
cuda (the model and data on cuda:0: the CUDA arena path), tensor-hook / post-accumulate (the
PS gradient hook, instead of the default for this torch), workers=P (the expected world size),
kill-server=I@S (rank 0 SIGKILLs the I-th started KV server of its job before step S, one or more, in
a job's first run: the job must go on at the keys' backups and train exactly the same), freeze-server=I@S (the same with
SIGSTOP: a hung server, given up after the agents' peer_timeout), crash-at=S (rank 1 exits with code
3 before step S, in a job's first run: a job that dies; crash-always-at=S in every run too;
crash-rank=R: rank R instead, and rank 1 writes the parameters when R is 0; writer=R: rank R
writes them; crash-after-forward: the crash comes after step S's forwards, before its backward), buffer-probe (an
identity module in front whose buffer each forward sets to 100 * rank + its forward count, so
that the value a forward finds there says whose buffers DDP's broadcast_buffers installed; rank 2
prints the senders it saw and the values, a rank that took up the job the values its forwards
found), ddp-wrapper (poseidon.torch.DistributedDataParallel and a plain
torch SGD, registered at the first forward, instead of distribute(); with register-early:
registered by batch_size=K; with state-optimizer: the ElasticState knows the SGD), elastic-state (a
poseidon.torch.ElasticState of epochs of EPOCH_STEPS steps: every rank checks at every step
that it holds that step's epoch and batch, and a rank that took up the running job prints the
position it learnt; state-skew: rank 1's loop moves one batch further at step 3, which the
job must refuse), lazy-register (no batch_size: the model is registered at its first forward),
forget-min-workers (the training process is not told the job may shrink: no
$POSEIDON_MIN_WORKERS), crash-before-broadcast (rank 0 exits once its model is registered,
before it sends its parameters),
report-world (every rank prints the world it ends in, poseidon.world(): a job that shrank),
world-hook (every rank prints each world change poseidon.torch.on_world_change reports, with the
step it came at), steps=N (N steps instead of 30), step-sleep=S (each step sleeps S seconds more: a job that runs
long enough for a restarted rank to come back while it runs), find-unused
(find_unused_parameters=True), skip-bias (the last Linear's bias is left out of the forward
at every step s with s % 3 == 2: unused by every rank there), eval-at=S (every rank runs a forward
without gradient before step S's: DDP broadcasts buffers in it, and not in step S's forward),
two-forwards (each step runs the model on the two halves of its rows before one backward, the
mean of the two losses: DDP broadcasts buffers in both forwards). A job
resumed by `poseidon run --resume` starts at
poseidon.torch.resumed_steps() (with server-adam the servers hold the rest of the state)."""
import os
import signal
import sys
import time

import torch

import poseidon
import poseidon.torch

K, STEPS = 8, 30
EPOCH_STEPS = 5  # elastic-state: steps per epoch


class BufferProbe(torch.nn.Module):
    """Identity; its buffer tells whose buffers the last broadcast installed (buffer-probe)."""

    def __init__(self, rank):
        super().__init__()
        self.register_buffer("seen", torch.zeros(1))
        self.rank = rank
        self.found = []

    def forward(self, x):
        self.found.append(int(self.seen.item()))
        self.seen.fill_(100 * self.rank + len(self.found))
        return x


SWITCH_STEPS = 2000  # at most, in switch mode (it stops 5 steps after the third switch)


def model_and_data(seed=0, workers=4, device="cpu", steps=STEPS):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    g = torch.Generator().manual_seed(99)
    x = torch.randn(steps, workers * K, 20, generator=g)
    y = torch.randint(0, 5, (steps, workers * K), generator=g)
    return model.to(device), x.to(device), y.to(device)


def skips_bias(step):
    """skip-bias: the steps whose forward leaves the last layer's bias out (unused by every
    rank: its .grad stays as it was, which find_unused_parameters must allow)."""
    return step % 3 == 2


def switchable_bias(model):
    """skip-bias: the model's last Linear gets a switch (`.skip`) that leaves its bias out of
    the forward; returns that module."""
    last = model[-1]
    last.skip = False
    last.forward = lambda x: torch.nn.functional.linear(x, last.weight,
                                                        None if last.skip else last.bias)
    return last


def job_servers():
    """This job's poseidon-server pids (the launcher's, whose command lines name the job id of
    this rank's segment /poseidon-<job>-<rank>), in the order they were started."""
    job = os.environ["POSEIDON_SEGMENT"].split("-")[1]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                started = int(f.read().rsplit(")", 1)[1].split()[19])
        except OSError:
            continue
        if argv[0].endswith(b"poseidon-server") and f"--job_id={job}".encode() in argv:
            found.append((started, int(pid)))
    return [pid for _, pid in sorted(found)]


def main(out, modes=()):
    modes = set(modes)
    workers = next((int(m.split("=", 1)[1]) for m in modes if m.startswith("workers=")), 4)
    overlap, server = "overlap" in modes, "server-adam" in modes
    grad_hook = ("tensor" if "tensor-hook" in modes else
                 "post_accumulate" if "post-accumulate" in modes else "auto")
    device = "cpu"
    if "cuda" in modes:
        device = "cuda:0"  # every rank on the same GPU
        torch.backends.cuda.matmul.allow_tf32 = False  # (the default) full float32 matmuls
    poseidon.init()
    if "forget-min-workers" in modes:
        os.environ.pop("POSEIDON_MIN_WORKERS", None)
    if "crash-before-broadcast" in modes and poseidon.rank() == 0:
        poseidon.torch._Engine._initial_broadcast = lambda *args: os._exit(3)
    rank, world = poseidon.rank(), poseidon.size()
    assert world == workers, f"world {world}, expected {workers}"
    # Different seeds on every rank: the initial broadcast must make the replicas equal.
    switch = "switch" in modes
    total = next((int(m.split("=", 1)[1]) for m in modes if m.startswith("steps=")), STEPS)
    pause = next((float(m.split("=", 1)[1]) for m in modes if m.startswith("step-sleep=")), 0.0)
    model, x, y = model_and_data(seed=rank, workers=workers, device=device,
                                 steps=SWITCH_STEPS if switch else total)
    bias_switch = switchable_bias(model) if "skip-bias" in modes else None
    probe = None
    if "buffer-probe" in modes:
        probe = BufferProbe(rank)
        model = torch.nn.Sequential(probe, model)
    wrapper = "ddp-wrapper" in modes
    state = poseidon.torch.ElasticState(epoch=0, batch=0) if "elastic-state" in modes else None
    if wrapper:  # the DDP contract as a torch DDP script has it: the user's own optimizer
        model = poseidon.torch.DistributedDataParallel(
            model, grad_hook=grad_hook, state=state,
            batch_size=K if "register-early" in modes else None,
            find_unused_parameters="find-unused" in modes)
        opt = torch.optim.SGD(model.parameters(), lr=0.1,
                              momentum=0.9 if "momentum" in modes else 0.0)
        if "state-optimizer" in modes:
            state.optimizer = opt  # a rank taking up the job gets its state too
    elif server:  # the KV servers run Adam; no local optimizer
        opt = poseidon.torch.distribute(model, None,
                                        batch_size=None if "lazy-register" in modes else K,
                                        server_optimizer=dict(rule="adam", lr=0.01),
                                        grad_hook=grad_hook, state=state)
    else:
        opt = poseidon.torch.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if overlap or "momentum" in modes else torch.optim.SGD(model.parameters(), lr=0.1),
            batch_size=K, overlap_forward=overlap, grad_hook=grad_hook, state=state,
            find_unused_parameters="find-unused" in modes)
    if device != "cpu" and not wrapper:  # the buffers are views of the CUDA arena
        for layer in opt._layers:
            for buf in (layer.grad, layer.u, layer.v):
                assert buf is None or buf.device == torch.device(device), (layer.name, buf.device)
    # kill-server=I@S, one or more: by step, the index among the servers started (read at the
    # first kill, before any of them is gone).
    kills = {int(step): (int(index), signal.SIGKILL) for index, step in
             (m.split("=", 1)[1].split("@") for m in modes if m.startswith("kill-server="))}
    kills.update({int(step): (int(index), signal.SIGSTOP) for index, step in
                  (m.split("=", 1)[1].split("@") for m in modes
                   if m.startswith("freeze-server="))})
    started_servers = None
    crash_at = next((int(m.split("=", 1)[1]) for m in modes if m.startswith("crash-at=")), None)
    eval_at = next((int(m.split("=", 1)[1]) for m in modes if m.startswith("eval-at=")), None)
    crash_rank = next((int(m.split("=", 1)[1]) for m in modes if m.startswith("crash-rank=")), 1)
    crash_after_forward = "crash-after-forward" in modes
    writer = next((int(m.split("=", 1)[1]) for m in modes if m.startswith("writer=")),
                  1 if crash_rank == 0 else 0)
    if os.environ.get("POSEIDON_RESTART_COUNT", "0") != "0":
        crash_at = None  # restarted by poseidon run --max_restarts: it went away
        kills = {}  # and so did whatever killed the servers
    crash_at = next((int(m.split("=", 1)[1]) for m in modes if m.startswith("crash-always-at=")),
                    crash_at)
    start = poseidon.torch.resumed_steps()
    if "world-hook" in modes:
        poseidon.torch.on_world_change(lambda old, new: print(
            f"rank {rank} after step {step}: world {old} -> {new}", flush=True))
    step = start
    if start:
        print(f"resumed at step {start} at {time.time():.3f}", flush=True)
    steps, switches, last, stop_at = total, [], None, None
    for step in range(start, SWITCH_STEPS if switch else total):
        if state is not None:
            if state.batch == EPOCH_STEPS:
                state.next_epoch()
            if step == start and start:
                print(f"rank {rank} takes up at step {step}: {state}", flush=True)
            if "lazy-register" not in modes:  # (there the library must catch it)
                assert (state.epoch, state.batch) == divmod(step, EPOCH_STEPS), (rank, step, state)
            if "state-skew" in modes and rank == 1 and step == 3:
                state.batch += 1
        if rank == crash_rank and step == crash_at and not crash_after_forward:
            print(f"step {step}: rank {rank} crashes at {time.time():.3f}", flush=True)
            os._exit(3)
        if rank == 0 and step in kills:
            started_servers = started_servers or job_servers()
            index, sig = kills[step]
            victim = started_servers[index]
            os.kill(victim, sig)
            print(f"step {step}: {'killed' if sig == signal.SIGKILL else 'froze'} KV server pid "
                  f"{victim}", flush=True)
        if switch:
            # The scheme 0.weight runs at this iteration (the agent's schedule).
            scheme = dict((n, s) for n, s, _ in poseidon.torch.plan_summary(opt))["0.weight"]
            if last is not None and scheme != last:
                switches.append((step, scheme))
                print(f"step {step}: 0.weight runs {scheme}", flush=True)
                if len(switches) == 3:
                    stop_at = step + 5
            last = scheme
            if step == stop_at:
                break
            time.sleep(0.02)
        time.sleep(pause)
        mine = slice(rank * K, (rank + 1) * K)
        if bias_switch is not None:
            bias_switch.skip = skips_bias(step)
        if step == eval_at:
            with torch.no_grad():
                model(x[step, mine])
        if "two-forwards" in modes:  # two halves, the mean of their losses: the same gradient
            half = [slice(rank * K, rank * K + K // 2), slice(rank * K + K // 2, (rank + 1) * K)]
            loss = sum(torch.nn.functional.cross_entropy(model(x[step, h]), y[step, h])
                       for h in half) / 2
        else:
            loss = torch.nn.functional.cross_entropy(model(x[step, mine]), y[step, mine])
        if rank == crash_rank and step == crash_at and crash_after_forward:
            print(f"step {step}: rank {rank} crashes after its forwards", flush=True)
            os._exit(3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == start and start:
            print(f"first resumed step done at {time.time():.3f}", flush=True)
        steps = step + 1
    if not wrapper:
        opt.synchronize()  # with overlap_forward the last step waits for a forward: apply it
    if "report-world" in modes:
        # The world shrank mid-run (poseidon run --min_workers): the agent learns it from the
        # coordinator's heartbeat answers, which may come after this rank's last step.
        deadline = time.time() + 15
        while poseidon.world()[2] == 0 and time.time() < deadline:
            time.sleep(0.1)
        print(f"rank {rank} ends in world {poseidon.world()}", flush=True)
    if probe is not None and rank == 2:
        # The forward of step s found what the broadcast before it installed: the buffer set by
        # the sender's forward of step s - 1 (100 * its rank + s).
        # (DistributedDataParallel registers at the first forward: its probe ran one more.)
        found = probe.found[2:] if wrapper else probe.found[1:]
        print("rank 2 found buffers of ranks", [v // 100 for v in found], flush=True)
        print("rank 2 found buffer values", probe.found, flush=True)
    if probe is not None and start and rank != 2:  # a rank that took up the job: from there
        print(f"rank {rank} found buffer values from step {start}", probe.found, flush=True)
    if rank == writer:
        torch.save([p.detach().cpu().clone() for p in model.parameters()], out)
        local = opt if wrapper else opt._optimizer
        if local is not None:  # (overlap_forward's per-layer steps: the wrapped optimizer's)
            state = opt.state_dict()["state"]
            buffers = [state.get(i, {}).get("momentum_buffer") for i in
                       range(len(list(model.parameters())))]
            torch.save([None if b is None else b.cpu().clone() for b in buffers],
                       out + ".optimizer")
        print("schemes:", ",".join(s for _, s, _ in
                                   poseidon.torch.plan_summary(model if wrapper else opt)))
        if switch:
            torch.save({"steps": steps, "switches": switches}, out + ".switches")
        if not wrapper:
            print(f"device: {opt.device}, grad hook: {opt.grad_hook}, torch {torch.__version__}")
    poseidon.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else ())

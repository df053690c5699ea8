"""The model zoo of the PyTorch tests and of bench/zoo: models people train today, each with its
data, optimizer and training-loop quirks, and one training loop shared by every way of running it
(Poseidon, torch DDP over gloo, one process), so that the three differ only in how gradients are
averaged.

    spec = zoo.SPECS["gpt"]
    model = spec.model(seed)                 # same seed everywhere: DDP needs equal replicas
    train(spec, model, wrapped, opt, rank, world, steps)   # wrapped: DDP-like module or None

Every rank trains on rows [r*K, (r+1)*K) of each global batch of P*K rows (K = spec.batch).
`reference(spec, world, steps)` is one process on the whole global batch: the P-times larger
batch with a mean loss (spec.shardwise: per shard with loss/P, for models whose forward depends
on the shard, BatchNorm's batch statistics or a rank-dependent branch; BatchNorm's running
statistics then follow shard 0, as DDP's broadcast_buffers makes every rank follow rank 0).
"""
import contextlib
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from train_chargpt import TinyGpt, adamw_groups  # noqa: E402  (the example's model)


class Spec:
    name = ""
    batch = 8  # per-worker rows of the global batch
    steps = 20
    micro = 1  # micro-batches per step (the first micro-1 under no_sync())
    clip = None  # clip_grad_norm_ max norm
    autocast = None  # e.g. torch.bfloat16 (CPU autocast)
    shardwise = False
    teacher_forced = False  # see ResNet18
    ddp = True  # torch DDP over gloo can train it (the second reference)
    ddp_kwargs = {}
    tolerance = 1e-5  # relative (per tensor, to its norm) against the reference; see the tests

    def model(self, seed):
        raise NotImplementedError

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def data(self, step, world):
        """The global batch of `step` for `world` workers: (inputs, targets)."""
        raise NotImplementedError

    def loss(self, model, x, y, step, shard):
        return F.cross_entropy(model(x), y)


def _gen(step, salt):
    return torch.Generator().manual_seed(1000 * salt + step)


class ResNet18(Spec):
    """torchvision's ResNet-18 (BatchNorm everywhere) on 32x32 images, SGD with momentum and
    weight decay. Its trajectory is chaotic at this size (a 1e-7 relative change of the initial
    weights grows ~20x per step: after 20 steps two runs of one process differ as much as they
    moved), so no two ways of summing agree after 20 steps, DDP included: it is checked teacher-
    forced instead, every step's averaged gradient against one process's on the same parameters
    (teacher_forced), and every rank's final parameters and buffers against rank 0's."""
    name, batch, steps, shardwise, teacher_forced = "resnet18", 4, 20, True, True
    tolerance = 1e-4

    def model(self, seed):
        import torchvision
        torch.manual_seed(seed)
        return torchvision.models.resnet18(num_classes=10)

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def data(self, step, world):
        g = _gen(step, 1)
        return (torch.randn(world * self.batch, 3, 32, 32, generator=g),
                torch.randint(0, 10, (world * self.batch,), generator=g))


class Gpt(Spec):
    """examples/train_chargpt.py's TinyGpt, AdamW with parameter groups and clip_grad_norm_
    (which clips on every step here: the gradient norm starts near 3 and stays above 0.5)."""
    name, batch, steps, clip = "gpt", 4, 20, 0.5
    vocab, context = 48, 16
    tolerance = 2e-4  # Adam divides by sqrt(v): rounding differences grow step by step

    def model(self, seed):
        torch.manual_seed(seed)
        return TinyGpt(self.vocab, width=64, heads=4, layers=2, context=self.context, ff=128)

    def optimizer(self, model):
        return adamw_groups(model, lr=3e-3)

    def data(self, step, world):
        g = _gen(step, 2)
        seq = torch.randint(0, self.vocab, (world * self.batch, self.context + 1), generator=g)
        return seq[:, :-1], seq[:, 1:]

    def loss(self, model, x, y, step, shard):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class GptLong(Gpt):
    """Gpt with 256 tokens per sequence: 1,024 rows per worker at every Linear."""
    name, context = "gpt-long", 256


class TiedLstm(nn.Module):
    """An LSTM language model whose decoder shares the embedding's weight (weight tying)."""

    def __init__(self, vocab=40, width=32):
        super().__init__()
        self.encoder = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.decoder = nn.Linear(width, vocab)
        self.decoder.weight = self.encoder.weight

    def forward(self, idx):
        out, _ = self.lstm(self.encoder(idx))
        return self.decoder(out)


class Lstm(Spec):
    """TiedLstm, SGD and clip_grad_norm_ as in PyTorch's word language model example."""
    name, batch, steps, clip = "lstm", 4, 20, 0.25
    vocab, context = 40, 12

    def model(self, seed):
        torch.manual_seed(seed)
        return TiedLstm(self.vocab)

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=1.0)

    def data(self, step, world):
        g = _gen(step, 3)
        seq = torch.randint(0, self.vocab, (world * self.batch, self.context + 1), generator=g)
        return seq[:, :-1], seq[:, 1:]

    def loss(self, model, x, y, step, shard):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class BranchNet(nn.Module):
    """A Conv3d stem (a 5-d weight), then a trunk and two optional branches: `a` runs on steps
    not divisible by 3 (unused on every rank otherwise), `b` only on shard 0's even steps (unused
    on the other ranks)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(1, 4, kernel_size=2)
        self.trunk = nn.Linear(4 * 27, 24)
        self.a = nn.Linear(24, 24)
        self.b = nn.Linear(24, 24)
        self.out = nn.Linear(24, 5)

    def forward(self, x, use_a=True, use_b=False):
        h = torch.tanh(self.trunk(F.relu(self.stem(x)).flatten(1)))
        if use_a:
            h = h + torch.tanh(self.a(h))
        if use_b:
            h = h + torch.tanh(self.b(h))
        return self.out(h)


class Branch(Spec):
    """BranchNet with find_unused_parameters, SGD with momentum and weight decay (a parameter
    given a zero gradient instead of none would decay: the test tells the two apart)."""
    name, batch, steps, shardwise = "branch", 6, 20, True
    ddp_kwargs = dict(find_unused_parameters=True)

    def model(self, seed):
        torch.manual_seed(seed)
        return BranchNet()

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)

    def data(self, step, world):
        g = _gen(step, 4)
        return (torch.randn(world * self.batch, 1, 4, 4, 4, generator=g),
                torch.randint(0, 5, (world * self.batch,), generator=g))

    def loss(self, model, x, y, step, shard):
        return F.cross_entropy(model(x, use_a=step % 3 != 0, use_b=shard == 0 and step % 2 == 0), y)


class Mlp(nn.Module):
    def __init__(self, inputs=20, hidden=32, classes=5, norm=True):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        # torch 1.13's CPU autocast has no bf16 layer_norm: the bf16 specs go without.
        self.norm = nn.LayerNorm(hidden) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class Accumulate(Spec):
    """Gradient accumulation: two micro-batches per step, the first under no_sync(); SGD with
    momentum."""
    name, batch, steps, micro = "accumulate", 8, 20, 2

    def model(self, seed):
        torch.manual_seed(seed)
        return Mlp()

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def data(self, step, world):
        g = _gen(step, 5)
        return (torch.randn(world * self.batch, 20, generator=g),
                torch.randint(0, 5, (world * self.batch,), generator=g))


class Bf16(Accumulate):
    """CPU autocast to bfloat16 around the forward (parameters and gradients stay float32), one
    micro-batch, AdamW."""
    name, micro, autocast = "bf16", 1, torch.bfloat16
    # bf16 products: a rounding difference is 2^-8 of a term. SFB rebuilds a weight's gradient
    # in float32 from its factors where autocast's backward rounds it to bfloat16 (up to 2^-8
    # relative a step), and AdamW's normalisation carries that into every update: 20 steps of
    # that differ by ~1e-2 from DDP and from one process (measured 9.1e-3 at fc1.weight, 2
    # workers, auto, on an AMD EPYC host; the earlier hosts stayed within 3x DDP's own 2.4e-3).
    tolerance = 1.5e-2

    def model(self, seed):
        torch.manual_seed(seed)
        return Mlp(norm=False)

    def optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2)


class Bf16Params(Accumulate):
    """The model itself in bfloat16 (parameters and gradients), plain SGD. torch DDP over gloo
    refuses bf16 ("Invalid scalar type"): compared with one process only."""
    name, micro, ddp = "bf16-params", 1, False
    # Every gradient and update is rounded to bf16 (8 significant bits, 4e-3 relative), and the
    # one process rounds its gradient over the whole batch where the workers round theirs per
    # shard: 20 steps of that differ by ~1e-2.
    tolerance = 3e-2

    def model(self, seed):
        torch.manual_seed(seed)
        return Mlp(norm=False).to(torch.bfloat16)

    def data(self, step, world):
        x, y = super().data(step, world)
        return x.to(torch.bfloat16), y


SPECS = {s.name: s for s in (ResNet18(), Gpt(), GptLong(), Lstm(), Branch(), Accumulate(), Bf16(),
                             Bf16Params())}


def train(spec, model, wrapped, opt, rank, world, steps=None, on_step=None, start=0,
          on_backward=None):
    """Trains `model` (through `wrapped`, a DDP-like module with no_sync(), or the model itself)
    on rank `rank`'s shard of each global batch, steps [start, steps). on_step(step, grad_norm)
    after each step; on_backward(step, state before the step, global inputs, global targets)
    after the backward, before clipping and the step."""
    wrapped = wrapped if wrapped is not None else model
    steps = spec.steps if steps is None else steps
    k = spec.batch
    for step in range(start, steps):
        device = next(model.parameters()).device
        xg, yg = (t.to(device) for t in spec.data(step, world))
        x, y = xg[rank * k:(rank + 1) * k], yg[rank * k:(rank + 1) * k]
        before = ({n: t.detach().clone() for n, t in model.state_dict().items()}
                  if on_backward else None)
        opt.zero_grad(set_to_none=True)
        for i, (xm, ym) in enumerate(zip(x.chunk(spec.micro), y.chunk(spec.micro))):
            last = i == spec.micro - 1
            ctx = contextlib.nullcontext() if last else wrapped.no_sync()
            with ctx:
                with (torch.autocast("cpu", dtype=spec.autocast) if spec.autocast
                      else contextlib.nullcontext()):
                    loss = spec.loss(wrapped, xm, ym, step, rank) / spec.micro
                loss.backward()
        if on_backward:
            on_backward(step, before, xg, yg)
        norm = None
        if spec.clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip))
        opt.step()
        if on_step:
            on_step(step, norm)


def reference(spec, world, steps=None, seed=0, device="cpu"):
    """One process on the whole global batch (see the module doc); returns the model."""
    model = spec.model(seed).to(device)
    opt = spec.optimizer(model)
    steps = spec.steps if steps is None else steps
    for step in range(steps):
        x, y = (t.to(device) for t in spec.data(step, world))
        opt.zero_grad(set_to_none=True)
        _backward(spec, model, x, y, step, world)
        if spec.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
    return model


def _backward(spec, model, x, y, step, world):
    """The reference's gradient of one step (see the module doc) into model's .grad."""
    k = spec.batch
    ctx = (torch.autocast("cpu", dtype=spec.autocast) if spec.autocast
           else contextlib.nullcontext())
    if not spec.shardwise:
        with ctx:
            loss = spec.loss(model, x, y, step, None)
        loss.backward()
        return
    saved = [b.detach().clone() for b in model.buffers()]
    for shard in list(range(1, world)) + [0]:
        with torch.no_grad():
            for b, s in zip(model.buffers(), saved):
                b.copy_(s)
        rows = slice(shard * k, (shard + 1) * k)
        with ctx:
            loss = spec.loss(model, x[rows], y[rows], step, shard) / world
        loss.backward()


def gradient_error(spec, model, before, x, y, step, world):
    """Teacher forcing: the largest relative difference (to each tensor's norm) between
    `model`'s averaged gradients and one process's on the same parameters and global batch."""
    ref = spec.model(0).to(x.device)
    ref.load_state_dict(before)
    _backward(spec, ref, x, y, step, world)
    worst, where = 0.0, None
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        g = grads[name].grad
        d = ((g.float() - p.grad.float()).norm() / p.grad.float().norm().clamp(min=1e-12)).item()
        if d >= worst:
            worst, where = d, name
    return worst, where


def state(model):
    """The model's state dict (parameters and persistent buffers) as float32 on the CPU."""
    return {n: t.detach().float().cpu().clone() for n, t in model.state_dict().items()
            if t.is_floating_point()}


def difference(got, want):
    """The largest relative difference of a tensor to its norm, and its name."""
    worst, where = 0.0, None
    if set(got) != set(want):
        return math.inf, f"different tensors: {sorted(set(got) ^ set(want))[:4]}"
    for name, w in want.items():
        d = ((got[name] - w).norm() / w.norm().clamp(min=1e-6)).item()
        if d > worst or where is None:
            worst, where = d, name
    return worst, where

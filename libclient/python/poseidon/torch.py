"""PyTorch integration: torch DDP's contract, synchronised layer by layer through the local
poseidon-agent (wait-free backpropagation).

The form users know, a two-line change from torch's DistributedDataParallel:

    poseidon.init()                                   # instead of dist.init_process_group(...)
    model = poseidon.torch.DistributedDataParallel(model)   # instead of torch's DDP(model, ...)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()          # returns with every .grad averaged over the workers
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # sees the averaged gradients
        optimizer.step()

The contract (docs/pytorch.md, "What each mode guarantees"): when `loss.backward()` returns, every
parameter's `.grad` holds the gradient averaged over the workers, exactly what DDP leaves there,
so clipping, GradScaler/autocast, any optimizer, LR schedulers and code that reads gradients work
unchanged. As backward produces each parameter's gradient it is written into the agent's shared
buffer and posted at once (WFBP): synchronisation overlaps the rest of backward, and a callback
queued on the autograd engine (as DDP's own) waits for the layers when backward ends.

The model is registered at its first forward: a probe forward (buffers and RNG state restored
afterwards, so training is unchanged) measures every nn.Linear's rows (batch x tokens for a
sequence model), the K of sufficient-factor broadcasting, and finds the Linear modules whose
forward actually runs; then rank 0's parameters and buffers are broadcast. Only those Linear
weights, used by exactly one module's forward once per iteration, may be planned SFB; every
other parameter (shared/tied weights, MultiheadAttention's out_proj, F.linear(x, w)) goes by PS.

`distribute(model, optimizer, ...)` is the older form: the same contract by default, returning
the optimizer to step with; it also offers `overlap_forward=True` (each layer's step waits for
the next forward to reach it, so synchronisation overlaps the next forward too) and server-side
update rules (`server_optimizer=`).

A model on a CUDA device keeps its gradients there: the agent shares a device arena laid out like
the host buffers (psd_cuda_enable) and every buffer above is a torch tensor on that device (no
copy). Writes, ready events (psd_cuda_layer_ready) and waits (psd_cuda_wait_layer) are ordered on
the current CUDA stream.

Element types: float32, bfloat16 and float16 parameters and buffers; the shared buffers and the
wire carry float32 (bf16/fp16 widen exactly, the sum is float32, the average is rounded once to
the parameter's type).
"""
import contextlib
import ctypes
import json
import os
import re
import struct

import numpy as np
import torch

import poseidon
from ._capi import (LayerDesc, LayerInfo, PoseidonError, ServerRule, PSD_FLOAT32, PSD_LAYER_BIAS,
                    PSD_LAYER_AVERAGE, PSD_LAYER_CONV, PSD_LAYER_COUNTERS, PSD_LAYER_FC,
                    PSD_LAYER_OWN_CLOCK, PSD_LAYER_BY_SERVERS,
                    PSD_LAYER_FUSABLE, PSD_LAYER_OTHER, PSD_SYNC_ALLREDUCE, PSD_SYNC_SFB,
                    PSD_TIMEOUT, check, lib)

BROADCAST_LAYER = "__poseidon_broadcast__"
BUFFERS_LAYER = "__poseidon_buffers__"
USED_LAYER = "__poseidon_used__"
STATE_LAYER = "__poseidon_state__"
FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_DIMS = 4  # psd_layer_desc: 1..4 dimensions
MAX_ROWS = 1 << 20  # the agent's limit on K


def _view(pointer, count):
    if count == 0:
        return torch.empty(0)
    array = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(count,))
    return torch.from_numpy(array)


class _DeviceArray:
    """`count` float32s at a device address of libposeidon's CUDA arena, in the CUDA array
    interface (version 2: no stream, the caller orders accesses) so that torch.as_tensor wraps it
    without a copy; the tensor holds a reference to this object (and it to its owner)."""

    def __init__(self, pointer, count, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"version": 2, "typestr": "<f4", "shape": (count,),
                                         "strides": None, "data": (pointer, False)}


def _device_view(pointer, count, device, owner):
    if count == 0:
        return torch.empty(0, device=device)
    if not pointer:
        raise PoseidonError(9, f"libposeidon returned no device buffer for {count} floats")
    tensor = torch.as_tensor(_DeviceArray(pointer, count, owner), device=device)
    if tensor.data_ptr() != pointer or tensor.device != device:  # a copy would break everything
        raise PoseidonError(9, "torch copied the CUDA arena instead of viewing it")
    return tensor


WAIT_SLICE_MS = 200  # a wait that may have to hand the state over checks this often


def _wait(call, timeout_ms, what, idle):
    """`call(ms)` (a psd wait) until it is done or `timeout_ms` passed; with `idle`, in slices
    of WAIT_SLICE_MS with idle() between them (a rank taking up the job may need this rank's
    state while it waits for that rank)."""
    if idle is None:
        check(call(timeout_ms), what)
        return
    left = timeout_ms
    while True:
        ms = min(WAIT_SLICE_MS, left)
        status = call(ms)
        left -= ms
        if status != PSD_TIMEOUT:
            check(status, what)
            return
        if left <= 0:
            why = re.sub(r"within \d+ ms", f"within {timeout_ms} ms",
                         lib().psd_last_error().decode(errors="replace"))
            raise PoseidonError(status, f"{what}: {why}")
        idle()


class _HostSync:
    """Ready and wait on the host buffers (psd_layer_ready / psd_wait_layer)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.idle = None  # called between slices of a wait (_wait)

    def ready(self, index, iteration, what):
        check(lib().psd_layer_ready(self.ctx, index, iteration), what)

    def wait(self, index, iteration, timeout_ms, what):
        _wait(lambda ms: lib().psd_wait_layer(self.ctx, index, iteration, ms), timeout_ms, what,
              self.idle)


class _CudaSync:
    """Ready and wait on the device arena, ordered on the current stream of `device`: ready
    records the layer's event on it and returns; wait returns once the agent's result copy is
    queued and makes the stream wait for it on the device (no host synchronisation)."""

    def __init__(self, ctx, device):
        self.ctx, self.device = ctx, device
        self.idle = None  # called between slices of a wait (_wait)

    def _stream(self):
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream or None)

    def ready(self, index, iteration, what):
        # The current device matters for the legacy default stream (handle 0): make it ours.
        with torch.cuda.device(self.device):
            check(lib().psd_cuda_layer_ready(self.ctx, index, iteration, self._stream()), what)

    def wait(self, index, iteration, timeout_ms, what):
        with torch.cuda.device(self.device):
            _wait(lambda ms: lib().psd_cuda_wait_layer(self.ctx, index, iteration, ms,
                                                       self._stream()), timeout_ms, what, self.idle)


class _Layer:
    def __init__(self, index, name, param, kind, module, rows=0):
        self.index, self.name, self.param, self.kind, self.module = index, name, param, kind, module
        self.rows = rows  # FC layers: K, the rows of the SFB factors
        self.scheme = None  # the first plan's; per iteration: _Engine.scheme(layer)
        self.sfb_capable = False  # the agent laid out factor buffers: a plan may switch it to SFB
        self.grad = None  # flat float32 view of the shared gradient buffer (host, or CUDA arena)
        self.u = self.v = None


def _wire_shape(shape):
    """The registered shape: 1..4 dimensions (a 0-d parameter is [1]; a 5-d Conv3d weight keeps
    its first three dimensions and folds the rest into the fourth)."""
    shape = tuple(int(s) for s in shape) or (1,)
    if len(shape) > MAX_DIMS:
        folded = 1
        for s in shape[MAX_DIMS - 1:]:
            folded *= s
        shape = shape[:MAX_DIMS - 1] + (folded,)
    return shape


def _describe(model, rows=None, allow_sfb=True):
    """The model's trainable parameters as layers, one per distinct tensor, in definition order.

    rows: None (eager registration: every nn.Linear weight may go SFB, with K from the caller) or
    {id(linear module): rows} from the probe forward (only those Linear modules may go SFB)."""
    owners = {}  # id(param) -> [(module name, parameter name, module)]
    order = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            if id(param) not in owners:
                owners[id(param)] = []
                order.append(param)
            owners[id(param)].append((module_name, pname, module))
    layers = []
    for param in order:
        if not param.requires_grad or param.numel() == 0:
            continue
        uses = owners[id(param)]
        module_name, pname, module = uses[0]
        name = f"{module_name}.{pname}" if module_name else pname
        if param.dtype not in FLOAT_TYPES:
            raise PoseidonError(1, f"{name}: parameters of type {param.dtype} are not supported "
                                   "(float32, bfloat16 or float16)")
        shared = len({id(m) for _, _, m in uses}) > 1 or len(uses) > 1
        k = 0
        if (allow_sfb and not shared and pname == "weight" and isinstance(module, torch.nn.Linear)
                and param.dim() == 2):
            k = -1 if rows is None else rows.get(id(module), 0)
        if k != 0:
            kind = PSD_LAYER_FC
        elif pname == "bias" and not shared:
            kind = PSD_LAYER_BIAS
        elif isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) and not shared:
            kind = PSD_LAYER_CONV
        else:
            kind = PSD_LAYER_OTHER
        layers.append(_Layer(len(layers), name, param, kind, module, rows=k))
    if not layers:
        raise PoseidonError(1, "the model has no trainable parameters")
    devices = {l.param.device for l in layers}
    if len(devices) > 1:
        raise PoseidonError(1, "the model's parameters are on several devices "
                               f"({', '.join(sorted(str(d) for d in devices))}): put them on one")
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise PoseidonError(1, f"parameters on {device} are not supported (CPU or one CUDA device)")
    return layers, device


def _float_buffers(model):
    """The buffers broadcast from rank 0 (DDP's broadcast_buffers): floating ones, e.g.
    BatchNorm's running statistics. Integer buffers (num_batches_tracked) count forwards, the same
    on every rank by construction."""
    seen, out = set(), []
    for b in model.buffers():
        if b.dtype in FLOAT_TYPES and id(b) not in seen and b.numel() > 0:
            seen.add(id(b))
            out.append(b)
    return out


class _Probe:
    """The probe forward: which nn.Linear modules run, how often, and with how many rows."""

    def __init__(self, model):
        self.calls = {}
        self.rows = {}
        self.handles = []
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                self.handles.append(module.register_forward_hook(self._record))

    def _record(self, module, inputs, output):
        self.calls[id(module)] = self.calls.get(id(module), 0) + 1
        x = inputs[0] if inputs else None
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == module.in_features:
            self.rows[id(module)] = x.numel() // max(1, x.shape[-1])

    def result(self):
        for h in self.handles:
            h.remove()
        # Only a Linear whose forward ran exactly once may go SFB: its factors then capture the
        # weight's whole gradient (a second call would need both calls' rows).
        return {m: r for m, r in self.rows.items() if self.calls.get(m) == 1 and 0 < r <= MAX_ROWS}


class _Engine:
    """One registered model: its layers, the hooks, and the iteration state. Modes:
    "ddp" (the default: backward ends with every .grad averaged), "overlap" (step() returns at
    once, each layer steps when the next forward reaches it) and "server" (the KV servers apply
    the update; step() installs the parameters)."""

    def __init__(self, model, *, mode, batch_size=None, timeout_ms=120000, broadcast_buffers=True,
                 find_unused_parameters=False, server_rule=None, grad_hook="auto", sfb=True,
                 state=None):
        poseidon._context()  # raises before anything else if init() was not called
        if state is not None and not isinstance(state, ElasticState):
            raise PoseidonError(1, f"state must be a poseidon.torch.ElasticState, not "
                                   f"{type(state).__name__}")
        if state is not None and state._engine is not None:
            raise PoseidonError(1, "this ElasticState already belongs to a distributed model")
        has_post_accumulate = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
        if grad_hook == "auto":
            grad_hook = "post_accumulate" if has_post_accumulate else "tensor"
        if grad_hook not in ("post_accumulate", "tensor"):
            raise PoseidonError(1, f"grad_hook must be 'auto', 'post_accumulate' or 'tensor', "
                                   f"not {grad_hook!r}")
        if grad_hook == "post_accumulate" and not has_post_accumulate:
            raise PoseidonError(1, f"grad_hook='post_accumulate' needs PyTorch >= 2.1 "
                                   f"(this is {torch.__version__})")
        if batch_size is not None and not 0 < int(batch_size) <= MAX_ROWS:
            raise PoseidonError(1, f"batch_size must be in [1, {MAX_ROWS}], not {batch_size}")
        self.model = model
        self.mode = mode
        self.batch_size = batch_size
        self.timeout_ms = timeout_ms
        self.broadcast_buffers = broadcast_buffers
        self.find_unused = find_unused_parameters
        self.server_rule = server_rule
        self.grad_hook = grad_hook
        self.allow_sfb = sfb
        self.world = poseidon.size()
        # The job may shrink (poseidon run --min_workers): see register.
        self.elastic = os.environ.get("POSEIDON_MIN_WORKERS", "0") not in ("", "0")
        # What a layer's synchronised sum is divided by for .grad: the world size, or 1 where
        # the KV servers answer the mean over the ranks each clock summed (PSD_LAYER_AVERAGE).
        self.divisor = self.world
        self.counted = False  # set at registration (see there)
        self.rank = poseidon.rank()
        self.layers = None
        self.device = None
        self.sync = None
        self.buffers = []
        self.buffers_layer = self.used_layer = None
        # The training loop's position (ElasticState); with a server-side rule also a layer
        # the KV servers hold it in, and the values they hold (see _settle_state).
        self.state = state
        if state is not None:
            object.__setattr__(state, "_engine", self)
        self.state_layer = None
        self.state_held = None
        # A job whose ranks may take it up (poseidon-agent --rejoin_timeout) with a local
        # optimizer: the model's and optimizer's state are the ranks', so a live rank hands them
        # to a rank taking up the job, through the broadcast layer (_hand_over).
        self.hands_over = False
        self.takeovers_served = 0  # the job's takeovers handed their state (psd_takeovers)
        self.broadcast = None  # (layer index, view) of the broadcast layer
        self.broadcast_posts = 0  # this process's iterations of it
        self.clock_offset = 0  # the job's iteration of this process's iteration i: i + this
        self.handing_over = False
        self.pending_take_up = None  # the job's iteration to take up once the optimizer is known
        self.registering_in_forward = False  # the model is registered at its first forward
        self.iteration = 2  # 1 was the initial broadcast
        self.buffer_iteration = 2
        # The first forward of the iteration being computed: (iteration, its buffer_iteration
        # and require_forward_param_sync before it) — where a rank taking up the job from this
        # iteration on starts broadcasting buffers.
        self.forward_at = None
        # A job whose ranks hand over: the results of this iteration's buffer broadcasts but
        # the last (None where nobody sent), which a rank taking up the job cannot re-send (the
        # servers answer a retransmission of the last completed one only). Each is copied out
        # of the buffers layer only when the next broadcast of the iteration is about to
        # overwrite it (result_in_view): one forward per iteration copies nothing. A rank
        # taking up the job installs those handed over instead of posting them (replay).
        self.broadcasts = []
        self.result_in_view = False
        self.replay = []
        self.posted = {}  # layer index -> True, in posting order
        self.zeroed = set()  # SFB weights whose local gradient the hook replaced by zeros
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # DDP: buffers sync in a forward after a sync one
        self.sync_this_backward = False
        self.callback_queued = False
        self.pending = {}  # overlap: layer index -> iteration whose step waits for the forward
        # overlap: the last step() — (its iteration, the ElasticState's fields and the first
        # forward (forward_at) of that iteration) — and how many layers have stepped since: a
        # rank waiting inside the next forward before any did hands over the state before it.
        self.overlap_post = None
        self.stepped = 0
        self.optimizer = None  # overlap: DistributedOptimizer
        self.sfb_inputs = set()  # SFB layers whose input this forward has saved
        self.schemes = {}  # layer index -> (iteration, scheme): psd_layer_scheme's answers

    # ---- registration --------------------------------------------------------------------
    @property
    def registered(self):
        return self.layers is not None

    def register(self, rows=None):
        """rows: None (eager: K = batch_size for every Linear weight) or the probe's result."""
        if self.registered:
            raise PoseidonError(5, "the model is already registered")
        ctx = poseidon._context()
        allow_sfb = self.allow_sfb and self.server_rule is None
        layers, device = _describe(self.model, rows, allow_sfb)
        for layer in layers:
            if layer.rows == -1:
                layer.rows = int(self.batch_size)
        self.buffers = _float_buffers(self.model) if self.broadcast_buffers else []
        if self.server_rule is not None:
            if self.find_unused:
                raise PoseidonError(1, "find_unused_parameters is for local optimizers "
                                       "(a server-side rule needs every gradient every iteration)")
            if self.buffers and self.mode == "server":
                names = [n for n, b in self.model.named_buffers() if b.dtype in FLOAT_TYPES]
                raise PoseidonError(1, f"buffers ({', '.join(names[:3])}) cannot be broadcast "
                                       "under a server-side rule: pass broadcast_buffers=False")
            check(lib().psd_set_server_rule(ctx, ctypes.byref(self.server_rule)), "server rule")
        # A job that may shrink with a local optimizer: in the iteration a rank dies some keys
        # may sum its gradient and others not, and only the KV servers know which, so they
        # answer each key's mean over the ranks its clock summed (as a server-side rule
        # averages) and .grad is that, undivided.
        # The same job's sum layers that one rank sends (the broadcast, the buffers) carry one
        # element more counting the senders (_send_counted): a sender removed before it sent
        # would leave the others the zeros they sent.
        self.counted = self.elastic and self.server_rule is None
        if self.counted:
            self.divisor = 1
        total = sum(l.param.numel() for l in layers) + sum(b.numel() for b in self.buffers)
        extra = [(BROADCAST_LAYER, total + int(self.counted))]
        if self.buffers and self.mode != "server":
            extra.append((BUFFERS_LAYER, sum(b.numel() for b in self.buffers) + int(self.counted)))
        if self.find_unused:
            extra.append((USED_LAYER, len(layers)))
        if self.state is not None and self.server_rule is not None:
            extra.append((STATE_LAYER, len(self.state._fields)))
        names = [l.name.encode() for l in layers] + [n.encode() for n, _ in extra]
        shapes = [(ctypes.c_uint64 * len(_wire_shape(l.param.shape)))(*_wire_shape(l.param.shape))
                  for l in layers]
        shapes += [(ctypes.c_uint64 * 1)(n) for _, n in extra]
        descs = (LayerDesc * len(names))()
        for i, layer in enumerate(layers):
            descs[i] = LayerDesc(names[i], layer.kind, PSD_FLOAT32, len(shapes[i]),
                                 ctypes.cast(shapes[i], ctypes.POINTER(ctypes.c_uint64)),
                                 layer.rows if layer.kind == PSD_LAYER_FC else 0,
                                 # Every gradient is posted during backward, so layers may be
                                 # fused; the agent fuses host-memory layers only.
                                 (PSD_LAYER_FUSABLE if device.type == "cpu" else 0) |
                                 (PSD_LAYER_AVERAGE if self.counted else 0))
        # The extra layers are posted alone (and waited for before other layers are posted):
        # not fusable. In a job that takes ranks back a rank taking up the job posts again what
        # the others completed on them, which only a KV server answers: never SFB or ring.
        by_servers = PSD_LAYER_BY_SERVERS if _takeovers()[1] > 0 or self.elastic else 0
        for j in range(len(extra)):
            i = len(layers) + j
            descs[i] = LayerDesc(names[i], PSD_LAYER_OTHER, PSD_FLOAT32, 1,
                                 ctypes.cast(shapes[i], ctypes.POINTER(ctypes.c_uint64)), 0,
                                 # The buffers' broadcasts are not the iterations: a forward
                                 # without backward adds one, a no_sync() one has none.
                                 by_servers |
                                 (PSD_LAYER_COUNTERS if extra[j][0] == STATE_LAYER else
                                  PSD_LAYER_OWN_CLOCK if extra[j][0] == BUFFERS_LAYER else 0))
        check(lib().psd_register_layers(ctx, descs, len(names), self.timeout_ms), "register layers")
        start = ctypes.c_uint64()
        check(lib().psd_start_iteration(ctx, ctypes.byref(start)), "start iteration")
        _, rejoin_ms = _takeovers()
        why_not = self._why_no_hand_over(total)
        # A rank comes back to a job whose agents wait for it (--rejoin_timeout), or, in a job
        # that may shrink, after it was removed (readmitted: the world grows again).
        self.hands_over = (self.server_rule is None and (rejoin_ms > 0 or self.elastic) and
                           why_not is None)
        global _rejoined_at
        # With a server-side optimizer the servers hold the state: iteration 1 re-reads the
        # parameters the job's iteration in flight is computed from (resumed_steps() says which).
        # With a local optimizer a live rank hands it over (below): resumed_steps() follows it.
        _rejoined_at = start.value if start.value > 1 else None
        taking_up = start.value > 1 and self.server_rule is None
        if taking_up and not self.hands_over:
            why_not = why_not or ("in a job whose agents wait for a rank that died "
                                  "(--rejoin_timeout) or that may shrink (--min_workers)")
            raise PoseidonError(5, f"this rank's agent rejoined the running job at iteration "
                                   f"{start.value} (poseidon-agent --rejoin), and with a local "
                                   f"optimizer the model's and optimizer's state are the other "
                                   f"ranks', which they hand over only {why_not}: use a "
                                   f"server-side optimizer (server_optimizer=), or restart the "
                                   f"whole job (poseidon run --max_restarts, with "
                                   f"--checkpoint_dir to go on from a checkpoint)")
        if not taking_up and start.value == 1:
            self.clock_offset = poseidon.resumed_iteration()
        views = self._buffer_views(ctx, device)
        for layer in layers:
            info = LayerInfo()
            check(lib().psd_get_layer_info(ctx, layer.index, ctypes.byref(info)), "layer info")
            layer.scheme = info.scheme
            view = views(layer.index, info)
            layer.grad = view("grad", info.elements)
            layer.sfb_capable = bool(info.u)
            if layer.sfb_capable:
                m, n = layer.param.shape
                layer.u = view("u", layer.rows * m).view(layer.rows, m)
                layer.v = view("v", layer.rows * n).view(layer.rows, n)
        extra_views = {}
        for j, (name, count) in enumerate(extra):
            info = LayerInfo()
            check(lib().psd_get_layer_info(ctx, len(layers) + j, ctypes.byref(info)), name)
            extra_views[name] = (len(layers) + j, views(len(layers) + j, info)("grad", count))
        self.layers, self.device = layers, device
        self.buffers_layer = extra_views.get(BUFFERS_LAYER)
        self.used_layer = extra_views.get(USED_LAYER)
        self.state_layer = extra_views.get(STATE_LAYER)
        self.broadcast = extra_views[BROADCAST_LAYER]
        if self.hands_over:
            self.sync.idle = self._serve_takeovers
        if taking_up:
            self._check_take_up_registered(start.value)
            self.pending_take_up = start.value
            if self._local_optimizer() is not None:  # else once it is known (take_up_now)
                self.take_up_now()
            else:
                _taking_up.append(self)
        else:
            self._initial_broadcast(*self.broadcast)
            self.broadcast_posts = 1
        self._install_hooks()

    def _buffer_views(self, ctx, device):
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            # psd_cuda_enable sets the thread's current device: the guard restores the caller's.
            with torch.cuda.device(device):
                check(lib().psd_cuda_enable(ctx, device.index, self.timeout_ms),
                      f"enabling CUDA on {device}")
            self.sync = _CudaSync(ctx, device)

            def views(index, info):
                grad, u, v = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
                check(lib().psd_cuda_layer_buffers(ctx, index, ctypes.byref(grad), ctypes.byref(u),
                                                   ctypes.byref(v)), "CUDA layer buffers")
                # The arena belongs to the context (freed by poseidon.shutdown()).
                return lambda which, count: _device_view({"grad": grad, "u": u, "v": v}[which].value,
                                                         count, device, ctx)
        else:
            self.sync = _HostSync(ctx)

            def views(index, info):
                return lambda which, count: _view(getattr(info, which), count)
        return views

    def _initial_broadcast(self, index, buffer):
        """Iteration 1: rank 0's parameters and buffers through `buffer` (layer `index`), then
        every other layer takes iteration 1 too, so that training starts at 2 everywhere. With a
        server-side rule iteration 1 is each table's initial value (rank 0's, as above)."""
        tensors = [l.param for l in self.layers] + self.buffers
        values = self._send_counted(buffer, self.rank == 0, tensors)
        self.sync.ready(index, 1, "broadcast")
        self.sync.wait(index, 1, self.timeout_ms, "broadcast")
        if self._senders(buffer) != 1:
            raise PoseidonError(5, "rank 0 left the job before its parameters reached the "
                                   "others (the initial broadcast), and the ranks left have "
                                   "nothing to start from: start the job again")
        self._unpack(values, tensors)
        server = self.server_rule is not None
        for layer in self.layers:
            if server:
                layer.grad.copy_(layer.param.detach().reshape(-1))
            else:
                layer.grad.zero_()
            if self.scheme(layer, 1) == PSD_SYNC_SFB:
                layer.u.zero_()
                layer.v.zero_()
            self.sync.ready(layer.index, 1, "initial sync")
        extra = [x for x in (self.buffers_layer, self.used_layer, self.state_layer)
                 if x is not None]
        for idx, view in extra:
            if (idx, view) == self.state_layer:  # rank 0's values start the job's
                view.copy_(torch.tensor(list(self.state._fields.values()), dtype=torch.float32))
            else:
                view.zero_()
            self.sync.ready(idx, 1, "initial sync")
        for layer in self.layers:
            self.sync.wait(layer.index, 1, self.timeout_ms, "initial sync")
            if server:  # the servers' parameters: rank 0's, or a resumed job's restored ones
                with torch.no_grad():
                    layer.param.copy_(layer.grad.view(layer.param.shape))
        for idx, _ in extra:
            self.sync.wait(idx, 1, self.timeout_ms, "initial sync")
        if self.state_layer is not None:
            self._take_up_state()

    # ---- a rank taking up the job with a local optimizer ----------------------------------
    # The model's and optimizer's state are the ranks' own (the servers sum gradients), so a
    # live rank hands them to a rank that takes up the running job (poseidon run --rejoin),
    # through the broadcast layer (a sum table every rank posts: one sends, the others zeros),
    # in rounds every rank posts alike:
    #  1. the census: every live rank says so, with the takeovers it served and the takeovers
    #     its agent heard of; every rank taking up the job says so;
    #  2. the lowest live rank's state — the job's iteration it is after, the model's and the
    #     optimizer's state dicts, the ElasticState — as bytes, 3 per float32 (exact in a sum
    #     with zeros), after two floats of length, in as many rounds as it takes (only that
    #     rank encodes its state).
    # A live rank hands over from inside a wait (_wait's idle), once its agent heard of a
    # takeover (psd_takeovers): the rank taking up the job is what it waits for, and there its
    # state is that after the iteration before the one it waits for. The rank taking up the job
    # then re-sends the iterations the job completed since the clock its agent starts from (the
    # KV servers take them as retransmissions) and trains from the next one.
    def _why_no_hand_over(self, elements):
        """None where a live rank can hand its state to a rank taking up the job, else what is
        missing (the same on every rank)."""
        if elements < CENSUS_SLOTS * self.world:
            return f"for a model of {CENSUS_SLOTS * self.world} elements or more"
        return None

    def _local_optimizer(self):
        """distribute()'s optimizer, else the ElasticState's (DistributedDataParallel)."""
        if self.optimizer is not None:
            return self.optimizer._optimizer
        return None if self.state is None else self.state.optimizer

    def _broadcast_round(self, values, what, keep=True):
        """One iteration of the broadcast layer: `values` (a CPU float32 tensor no longer than
        the layer, or None: zeros) summed over the ranks; returns the sum on the CPU (with
        `keep`; a live rank passing on the state needs none)."""
        index, view = self.broadcast
        view.zero_()
        if values is not None and values.numel():
            view[:values.numel()].copy_(values)
        self.broadcast_posts += 1
        self.sync.ready(index, self.broadcast_posts, what)
        self.sync.wait(index, self.broadcast_posts, self.timeout_ms, what)
        return view.detach().cpu().clone() if keep else None

    def _census(self, taking_up):
        """Round 1: every live rank says so, with the takeovers it served and the takeovers its
        agent heard of; every rank taking up the job says so. Returns (the sender: the lowest
        live rank, the takeovers served after this hand-over)."""
        w, r = self.world, self.rank
        mine = torch.zeros(CENSUS_SLOTS * w)
        if taking_up:
            mine[2 * w + r] = 1
        else:
            mine[r] = 1
            mine[w + r] = self.takeovers_served
            mine[3 * w + r] = _takeovers()[0]
        raw = self._broadcast_round(mine, "the census of a hand-over to a rank taking up the job")
        got = raw[:CENSUS_SLOTS * w].view(CENSUS_SLOTS, w)
        live = [i for i in range(w) if got[0, i] == 1]
        taking = [i for i in range(w) if got[2, i] == 1]
        flags = torch.cat([got[0], got[2]])
        if not live or not bool(((flags == 0) | (flags == 1)).all()) or set(live) & set(taking):
            raise PoseidonError(5, "the census of a hand-over to a rank taking up the job is "
                                   f"garbled (live ranks {got[0].tolist()}, ranks taking up the "
                                   f"job {got[2].tolist()}): another rank took up the job in "
                                   "the same iterations; restart the job")
        sender = live[0]
        served = int(got[1, sender])
        if any(int(got[1, i]) != served for i in live):
            raise PoseidonError(5, f"the ranks handing over disagree on the takeovers served "
                                   f"({[int(got[1, i]) for i in live]} on ranks {live})")
        heard = int(got[3].max())
        return sender, served + len(taking) if taking else max(served, heard)

    def _state_rounds(self, sender, data=None, keep=False):
        """Rounds 2...: the sender's `data` (its packed state) after two floats of length;
        with `keep` (a rank taking up the job) returns what arrived."""
        size = self.broadcast[1].numel()
        if self.rank == sender:
            n = data.numel()
            data = torch.cat([torch.tensor([n % LENGTH_SPLIT, n // LENGTH_SPLIT],
                                           dtype=torch.float32), data])
        total, at, parts = None, 0, []
        while total is None or at < total:
            mine = data[at:at + size] if self.rank == sender else None
            got = self._broadcast_round(mine, "handing the state over to a rank taking up the job",
                                        keep or total is None)
            if total is None:  # every rank learns the length from the first round
                lo, hi = float(got[0]), float(got[1])
                if not (0 <= lo < LENGTH_SPLIT and 0 <= hi < LENGTH_SPLIT and lo.is_integer()
                        and hi.is_integer()):
                    raise PoseidonError(5, f"rank {sender}'s hand-over says its state is "
                                           f"{lo} + {hi} x 2^22 floats long (garbled)")
                total = 2 + int(lo) + int(hi) * LENGTH_SPLIT
            if keep:
                parts.append(got[:min(size, total - at)])
            at += size
        return torch.cat(parts)[2:] if keep else None

    def _serve_takeovers(self):
        """A live rank, waiting: hands its state over once its agent heard of a takeover."""
        if self.handing_over or _takeovers()[0] <= self.takeovers_served:
            return
        self.handing_over = True
        try:
            sender, served = self._census(taking_up=False)
            data = None
            if sender == self.rank:  # only the sender's state travels: only it encodes one
                data = _pack_bytes(_encode_state(self._state_to_hand_over()))
            self._state_rounds(sender, data)
            self.takeovers_served = served
        finally:
            self.handing_over = False

    def _state_to_hand_over(self):
        """The sender's state: after the iteration before the one this rank waits for — with
        overlap_forward, waiting inside the next forward before any layer stepped, the one
        before that (its last step() is pending) — or, with overlap_forward once some layers
        stepped and others wait, {"refused": why}."""
        iteration, fields, forward_at, broadcasts = (
            self.iteration, None if self.state is None else self.state._fields, self.forward_at,
            self.broadcasts)
        if self.mode == "overlap" and self.overlap_post is not None and \
                self.stepped < len(self.layers):
            if self.stepped > 0:
                return {"refused": f"it waits inside a forward with {self.stepped} of its "
                                   f"{len(self.layers)} layers stepped (overlap_forward): no "
                                   "whole state to hand over"}
            iteration, fields, forward_at, broadcasts = self.overlap_post
        return {
            "iteration": iteration - 1 + self.clock_offset,
            "model": self.model.state_dict(),
            "optimizer": (None if self._local_optimizer() is None
                          else self._local_optimizer().state_dict()),
            "state": None if fields is None else dict(fields),
            # Which parameters hold a .grad: one no rank uses in an iteration keeps its .grad
            # (as DDP leaves it), and an optimizer steps a zero gradient (momentum goes on) but
            # skips a missing one.
            "grads": [p.grad is not None for p in self.model.parameters()],
            "buffers": self._buffers_position(iteration, forward_at, broadcasts)}

    def _buffers_position(self, iteration, forward_at, broadcasts):
        """A live rank handing over: where the rank taking up the job broadcasts buffers from
        (None without broadcast_buffers): [its buffer iteration, require_forward_param_sync,
        replay] for its first forward, the first of `iteration` (`forward_at`: this rank's,
        where it ran one; `broadcasts`: the results of that iteration's broadcasts). Its
        buffers layer goes on from the key's last completed clock (PSD_LAYER_OWN_CLOCK: its
        iteration 1), which is this rank's buffer_iteration - 1 (the key cannot pass it without
        the rank taken up); a first one before that (two forwards with broadcasts completed)
        takes the results of those before it from `replay` instead."""
        if self.buffers_layer is None:
            return None
        first, sync = self.buffer_iteration, self.require_forward_param_sync
        if forward_at is not None and forward_at[0] == iteration:
            _, first, sync = forward_at
        first -= self.buffer_iteration - 2
        return [first, bool(sync), list(broadcasts[:1 - first]) if first < 1 else []]

    def _take_up_buffers(self, sender, position):
        """A rank taking up the job: its buffers layer re-sends the key's last completed clock
        (iteration 1, a retransmission) where the live ranks' first forward of the iteration it
        trains broadcast at a later one, and its first forward goes on where theirs did; where
        theirs broadcast before that clock, its first forwards install the results handed over
        (replay) and the next one re-sends that clock."""
        if (self.buffers_layer is None) != (position is None):
            mine = "broadcasts" if self.buffers_layer is not None else "does not broadcast"
            raise PoseidonError(5, f"rank {sender} handed over a buffers position {position}, "
                                   f"and this rank {mine} buffers: every rank passes the same "
                                   "broadcast_buffers")
        if position is None:
            return
        if (not isinstance(position, list) or len(position) != 3 or
                not isinstance(position[0], int) or not isinstance(position[1], bool) or
                not isinstance(position[2], list) or position[0] > 2):
            raise PoseidonError(5, f"rank {sender} handed over a garbled buffers position "
                                   f"{str(position)[:200]}")
        first, sync, replay = position
        size = sum(b.numel() for b in self.buffers)
        if len(replay) != max(0, 1 - first) or not all(
                v is None or (isinstance(v, torch.Tensor) and v.dtype == torch.float32 and
                              v.dim() == 1 and v.numel() == size) for v in replay):
            raise PoseidonError(5, f"rank {sender} handed over {len(replay)} results of buffer "
                                   f"broadcasts for the {max(0, 1 - first)} this rank cannot "
                                   f"re-send, or ones not of its {size} buffer values")
        for it in range(1, first):
            self._resend([(*self.buffers_layer, "the buffers' broadcast")], it)
        self.replay = replay
        self.buffer_iteration = max(first, 1)
        self.require_forward_param_sync = sync

    def _resend(self, layers, iteration):
        """A rank taking up the job posts `iteration` of `layers` ((index, values, name)),
        which every other rank completed: zeros, a retransmission the servers answer with that
        iteration's result (they keep the first push)."""
        for index, values, name in layers:
            values.zero_()
            self.sync.ready(index, iteration, f"re-sending {name}")
        for index, _, name in layers:
            self.sync.wait(index, iteration, self.timeout_ms,
                           f"re-sending {name} (this process's iteration {iteration}, which "
                           "the job completed)")

    def _check_take_up_registered(self, start):
        if self.registering_in_forward:
            raise PoseidonError(5, f"this rank's agent took up the running job at iteration "
                                   f"{start}, whose state a live rank hands over when the model "
                                   "is registered, and this model was registered at its first "
                                   "forward, after the loop had picked its batch: register it "
                                   "before the loop (batch_size=K to distribute() or "
                                   "DistributedDataParallel)")

    def take_up_now(self):
        """A rank taking up the running job whose optimizer was not known at registration
        (DistributedDataParallel: ElasticState.optimizer set since) gets the state now:
        resumed_steps() or the first forward calls this."""
        if self.pending_take_up is None:
            return
        if self._local_optimizer() is None:
            raise PoseidonError(5, f"this rank's agent took up the running job at iteration "
                                   f"{self.pending_take_up}, and a live rank hands over the "
                                   "model's and optimizer's state, but this process's optimizer "
                                   "is unknown: pass an ElasticState (state=) and set its "
                                   "optimizer (state.optimizer = opt) before the training loop, "
                                   "or distribute(model, optimizer, batch_size=K)")
        start, self.pending_take_up = self.pending_take_up, None
        self._take_up(start)

    def _take_up(self, start):
        """This rank's agent took up the running job at the job's iteration `start`: the state
        comes from a live rank, then the iterations the job completed since start - 1 are
        re-sent; training goes on from the iteration after the state's."""
        global _rejoined_at
        self.clock_offset = start - 1  # this process's iteration 1 is the job's `start`
        self.handing_over = True
        try:
            sender, served = self._census(taking_up=True)
            got = _decode_state(_unpack_bytes(self._state_rounds(sender, keep=True)))
            if isinstance(got, dict) and set(got) == {"refused"}:
                raise PoseidonError(5, f"rank {sender} cannot hand its state over to this rank "
                                       f"taking up the job: {got['refused']}; restart the job")
            keys = {"iteration", "model", "optimizer", "state", "grads", "buffers"}
            if (not isinstance(got, dict) or set(got) != keys or
                    not isinstance(got["iteration"], int) or not isinstance(got["model"], dict)):
                raise PoseidonError(5, f"rank {sender} handed over a state that is not one "
                                       f"(keys {sorted(got) if isinstance(got, dict) else got!r})")
            if got["optimizer"] is None:
                raise PoseidonError(5, f"rank {sender} handed over its model's state but not its "
                                       "optimizer's, which it does not know: every rank sets "
                                       "ElasticState.optimizer (or passes it to distribute())")
            self.model.load_state_dict(got["model"])
            self._local_optimizer().load_state_dict(got["optimizer"])
            if self.state is not None:
                if got["state"] is None or set(got["state"]) != set(self.state._fields):
                    raise PoseidonError(5, f"rank {sender} handed over the ElasticState "
                                           f"{got['state']}, this rank's has "
                                           f"{sorted(self.state._fields)}")
                self.state._fields.update(got["state"])
            self._take_up_buffers(sender, got["buffers"])
            params = list(self.model.parameters())
            grads = got["grads"]
            if (not isinstance(grads, list) or len(grads) != len(params) or
                    not all(isinstance(g, bool) for g in grads)):
                raise PoseidonError(5, f"rank {sender} handed over .grad flags for "
                                       f"{len(grads) if isinstance(grads, list) else grads} "
                                       f"parameters, this model has {len(params)}")
            for p, held in zip(params, grads):
                # The live ranks' .grad at the start of the iteration: zeroed (zero_grad) or
                # none (zero_grad(set_to_none=True), or never used).
                p.grad = torch.zeros_like(p) if held else None
            after = int(got["iteration"])
            again = after - self.clock_offset  # completed iterations this agent re-sends
            if again < 0:
                raise PoseidonError(5, f"rank {sender} handed over its state after iteration "
                                       f"{after}, before the iteration {start} the job is at")
            # Every layer posted once an iteration goes: the model's, and with
            # find_unused_parameters the used-parameter map.
            again_layers = [(l.index, l.grad, l.name) for l in self.layers]
            if self.used_layer is not None:
                again_layers.append((*self.used_layer, "the used-parameter map"))
            for it in range(1, again + 1):
                self._resend(again_layers, it)
            self.iteration = again + 1
            self.takeovers_served = served
            _rejoined_at = after  # resumed_steps(): the steps the state holds
        finally:
            self.handing_over = False

    # ---- the training loop's position (ElasticState) --------------------------------------
    # With a server-side rule the KV servers hold it as a table of counters (PSD_LAYER_COUNTERS:
    # plain SGD with learning rate 1 on the ranks' mean push, whatever the job's rule): each
    # step every rank pushes (held - next), so the servers then hold `next` — rank 0's values at
    # the start, a checkpoint's at a resume — and a rank taking up the running job (a rejoin, a
    # readmission) re-reads them with the parameters, as of the step it takes up.
    def _take_up_state(self):
        _, view = self.state_layer
        values = [int(round(v)) for v in view.tolist()]
        names = list(self.state._fields)
        mine = list(self.state._fields.values())
        if values != mine and self.registering_in_forward:
            # This forward's batch was picked from the position the state had before.
            raise PoseidonError(5, f"the job is at {dict(zip(names, values))} (its servers' "
                                   f"ElasticState) and this rank's loop at {dict(zip(names, mine))}"
                                   ": the model was registered at its first forward, after the "
                                   "loop had picked its batch; register it before the loop "
                                   "(distribute(..., batch_size=K)) and read the state then")
        for name, value in zip(names, values):
            self.state._fields[name] = value
        self.state_held = values

    def _post_state(self, iteration):
        """The step's end: the position after it (batch + 1) goes to the servers."""
        if self.state_layer is None:
            return
        index, view = self.state_layer
        view.copy_(torch.tensor(self.state_held, dtype=torch.float32) -
                   torch.tensor(self._next_position(), dtype=torch.float32))
        self.sync.ready(index, iteration, "posting the training loop's position")

    def _next_position(self):
        """The state's values once this step is done: batch + 1."""
        return [v + (name == "batch") for name, v in self.state._fields.items()]

    def _settle_state(self, iteration):
        """The step is done: batch + 1 (with a server-side rule, what the servers hold now,
        which must be every rank's own)."""
        if self.state_layer is None:
            if self.state is not None:
                self.state._fields["batch"] += 1
            return
        index, view = self.state_layer
        self.sync.wait(index, iteration, self.timeout_ms,
                       f"waiting for the training loop's position (iteration {iteration})")
        names = list(self.state._fields)
        after = self._next_position()
        held = [int(round(v)) for v in view.tolist()]
        if held != after:
            raise PoseidonError(5, f"iteration {iteration}: the ranks' training loops are at "
                                   f"different positions: this rank goes to "
                                   f"{dict(zip(names, after))}, the ranks' mean is "
                                   f"{dict(zip(names, view.tolist()))} (every rank must "
                                   "advance its ElasticState alike)")
        for name, value in zip(names, after):
            self.state._fields[name] = value
        self.state_held = held

    @staticmethod
    def _unpack(flat, tensors):
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view(t.shape))
                offset += n

    def probe_and_register(self, run):
        """The first forward: `run()` once with the Linear modules watched, buffers and RNG state
        restored afterwards (as if it never ran), then registration and the initial broadcast."""
        probe = _Probe(self.model)
        saved = [b.detach().clone() for b in self.model.buffers()]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            run()
        finally:
            rows = probe.result()
            with torch.no_grad():
                for b, s in zip(self.model.buffers(), saved):
                    b.copy_(s)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        if not self.require_backward_grad_sync:
            # The first forward is inside no_sync(): the job accumulates gradients, which SFB
            # cannot carry (its factors are one backward's). Plan without it.
            self.allow_sfb = False
        if self.find_unused:
            # The graph changes between iterations (or ranks): which Linear modules ran in this
            # rank's probe says nothing of the others', and every rank must register the same
            # model. Plan without SFB.
            self.allow_sfb = False
        self.register(rows)
        # Under autocast the probe cached low-precision casts of the parameters as they were
        # before rank 0's were broadcast into them: the real forward must cast them anew.
        torch.clear_autocast_cache()

    # ---- forward -------------------------------------------------------------------------
    def before_forward(self, run):
        if not self.registered:
            self.registering_in_forward = True
            try:
                if self.batch_size is not None:
                    self.register(None)
                else:
                    self.probe_and_register(run)
            finally:
                self.registering_in_forward = False
        elif self.optimizer is None:
            # The iteration boundary DDP's wrapper has (its optimizer is the user's own): the
            # world-change hooks run here, before this forward; distribute()'s step() does it.
            _check_world(self)
        self.take_up_now()
        grad = torch.is_grad_enabled()
        if self.forward_at is None or self.forward_at[0] != self.iteration:
            self.forward_at = (self.iteration, self.buffer_iteration,
                               self.require_forward_param_sync)
            self.broadcasts = []  # (a new list: overlap_post keeps the last iteration's)
            self.result_in_view = False
        if self.require_forward_param_sync and self.buffers_layer is not None:
            self._sync_buffers()
        self.sync_this_backward = grad and self.require_backward_grad_sync
        if grad and not self.require_backward_grad_sync:
            sfb = [l.name for l in self.layers if self.scheme(l) == PSD_SYNC_SFB]
            if sfb:
                raise PoseidonError(5, f"no_sync(): {', '.join(sfb[:3])} is synchronised by SFB, "
                                       "whose factors carry one backward's gradient, not an "
                                       "accumulated one; start training inside no_sync() (the "
                                       "first forward then plans without SFB) or pass sfb=False")
        self.sfb_inputs.clear()

    def after_forward(self):
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync

    def _send_counted(self, view, send, tensors):
        """Fills a layer one rank sends: `tensors` if `send`, else zeros; with self.counted its
        last element says whether this rank sent. Returns the values' part of `view`."""
        values = view[:-1] if self.counted else view
        if send:
            torch.cat([t.detach().reshape(-1).float() for t in tensors], out=values)
        else:
            values.zero_()
        if self.counted:
            view[-1] = 1.0 if send else 0.0
        return values

    def _senders(self, view):
        """How many ranks sent a synchronised _send_counted layer (1 where it is not counted)."""
        return int(round(view[-1].item())) if self.counted else 1

    def _sync_buffers(self):
        """DDP's broadcast_buffers: rank 0's buffers to every rank — in a job that may shrink,
        the lowest rank left's (poseidon.world()), and one element more counts the senders: in
        the iteration rank 0 is removed, the others may not know yet (none sends: each keeps its
        own buffers for that iteration) or two may believe they are first (their mean)."""
        if self.replay:  # a broadcast the job completed before this rank took it up
            values = self.replay.pop(0)
            if values is not None:
                self._unpack(values.to(self.device), self.buffers)
            return
        index, view = self.buffers_layer
        if self.hands_over and self.result_in_view:  # keep it before this broadcast's post
            held = view[:-1] if self.counted else view
            self.broadcasts.append(held.detach().clone() if self._senders(view) > 0 else None)
        source = poseidon.world()[0] == 0 if self.counted else self.rank == 0
        values = self._send_counted(view, source, self.buffers)
        it = self.buffer_iteration
        self.sync.ready(index, it, "broadcasting buffers")
        self.sync.wait(index, it, self.timeout_ms, f"waiting for rank 0's buffers (iteration {it})")
        self.buffer_iteration += 1
        senders = self._senders(view)
        if senders > 1:
            values.div_(senders)
        if senders > 0:
            self._unpack(values, self.buffers)
        self.result_in_view = True

    # ---- backward ------------------------------------------------------------------------
    def _post(self, layer):
        if layer.index in self.posted:
            raise PoseidonError(5, f"{layer.name}: a second gradient in iteration {self.iteration} "
                                   "(one backward per forward; accumulate with no_sync())")
        self.posted[layer.index] = True
        self.sync.ready(layer.index, self.iteration, f"posting {layer.name}")
        if self.mode == "ddp" and not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _post_gradient(self, layer, before, g):
        """A PS layer's input: the local gradient this backward adds to .grad (DDP reduces the
        accumulated .grad: under no_sync() that is every micro-batch's)."""
        if before is None:
            layer.grad.copy_(g.reshape(-1))
        else:
            torch.add(before.reshape(-1), g.reshape(-1), out=layer.grad)
        self._post(layer)

    def _post_factors(self, layer, g, saved):
        rows = saved.shape[0]
        layer.u[:rows].copy_(g.reshape(rows, -1))
        layer.v[:rows].copy_(saved)
        if rows < layer.rows:  # a smaller batch: zero rows add nothing to sum U^T V
            layer.u[rows:].zero_()
            layer.v[rows:].zero_()
        self._post(layer)

    def scheme(self, layer, iteration=None):
        """The layer's scheme at `iteration` (default: the one being computed). A plan change
        moves a layer between PS and SFB at an iteration every rank agrees on (the agent's
        schedule); asked once per layer and iteration."""
        if not layer.sfb_capable:
            return layer.scheme
        it = self.iteration if iteration is None else iteration
        cached = self.schemes.get(layer.index)
        if cached is not None and cached[0] == it:
            return cached[1]
        out = ctypes.c_uint32()
        check(lib().psd_layer_scheme(self.sync.ctx, layer.index, it, ctypes.byref(out)),
              f"scheme of {layer.name}")
        self.schemes[layer.index] = (it, out.value)
        return out.value

    def _install_hooks(self):
        for layer in self.layers:
            if layer.sfb_capable:
                # Iterations this layer runs by SFB save its input in forward and post the
                # factors from the output's gradient; the others take the PS hooks below.
                layer.module.register_forward_hook(
                    lambda module, inputs, output, layer=layer: self._sfb_forward(layer, inputs,
                                                                                  output))
                if self.mode == "ddp":
                    # The factors carry this layer's gradient; the local one autograd computes
                    # must not be added to .grad (which keeps what it held before backward).
                    def zero_local(g, layer=layer):
                        if not self.sync_this_backward or self.scheme(layer) != PSD_SYNC_SFB:
                            return None
                        self.zeroed.add(layer.index)
                        return torch.zeros_like(g)

                    layer.param.register_hook(zero_local)
            if layer.sfb_capable or layer.scheme != PSD_SYNC_SFB:
                self._install_ps_hook(layer)
        self._install_overlap_hooks()

    def _install_ps_hook(self, layer):
        def posts(layer):
            return self.sync_this_backward and (not layer.sfb_capable
                                                or self.scheme(layer) != PSD_SYNC_SFB)

        if self.grad_hook == "post_accumulate":
            # PyTorch >= 2.1: called once the parameter's .grad is complete for this backward.
            def accumulated_hook(param, layer=layer):
                if posts(layer):
                    self._post_gradient(layer, None, param.grad)

            layer.param.register_post_accumulate_grad_hook(accumulated_hook)
        else:
            # PyTorch 1.13 (or grad_hook="tensor"): the hook sees the gradient autograd adds to
            # the parameter's .grad (a leaf's incoming gradients are summed first, so a
            # parameter used several times in one forward gets one call).
            def tensor_hook(g, layer=layer):
                if posts(layer):
                    self._post_gradient(layer, layer.param.grad, g)

            layer.param.register_hook(tensor_hook)
    def _install_overlap_hooks(self):
        if self.mode == "overlap":
            by_module = {}
            for layer in self.layers:
                by_module.setdefault(id(layer.module), (layer.module, []))[1].append(layer)
            for module, owned in by_module.values():
                def pre_hook(module, inputs, owned=owned):
                    for layer in owned:
                        self.optimizer._step_layer(layer)

                module.register_forward_pre_hook(pre_hook)

    def _sfb_forward(self, layer, inputs, output):
        if not (self.sync_this_backward and torch.is_grad_enabled()
                and isinstance(output, torch.Tensor) and output.requires_grad
                and self.scheme(layer) == PSD_SYNC_SFB):
            return
        x = inputs[0]
        m, n = layer.param.shape
        if x.dim() < 1 or x.shape[-1] != n:
            raise PoseidonError(1, f"{layer.name}: input of shape {tuple(x.shape)} for a {m}x{n} "
                                   "weight")
        rows = x.numel() // n
        if rows > layer.rows:
            raise PoseidonError(1, f"{layer.name} is synchronised by SFB with K = {layer.rows} "
                                   f"rows (measured at the first forward), got input of shape "
                                   f"{tuple(x.shape)} = {rows} rows; keep the first batch the "
                                   "largest (or pass sfb=False)")
        if layer.index in self.sfb_inputs:
            raise PoseidonError(5, f"{layer.name} ran twice in one iteration; it is synchronised "
                                   "by SFB, whose factors are one call's (pass sfb=False)")
        saved = x.detach().reshape(rows, n)
        self.sfb_inputs.add(layer.index)
        output.register_hook(lambda g, layer=layer, saved=saved: self._post_factors(layer, g, saved))

    def _finalize(self):
        """End of backward (queued on the autograd engine by the first post, as DDP's reducer
        does): post what got no gradient, wait for every layer, install the averages."""
        self.callback_queued = False
        it = self.iteration
        missing = [l for l in self.layers if l.index not in self.posted]
        for layer in missing:  # zeros keep every rank's iteration going, even before an error
            if self.scheme(layer, it) == PSD_SYNC_SFB:
                layer.u.zero_()
                layer.v.zero_()
            else:
                layer.grad.zero_()
            self.posted[layer.index] = True
            self.sync.ready(layer.index, it, f"posting {layer.name}")
        # An SFB weight that got a gradient (its hook zeroed the local part) but no factors: it
        # was used without its module's forward.
        lost = [l.name for l in missing if l.index in self.zeroed]
        used = None
        if self.used_layer is not None:
            index, view = self.used_layer
            flags = torch.ones(len(self.layers))
            for layer in missing:
                flags[layer.index] = 0.0
            view.copy_(flags)
            self.sync.ready(index, it, "posting the used-parameter map")
            self.sync.wait(index, it, self.timeout_ms, "waiting for the used-parameter map")
            used = view.detach().cpu().tolist()
        try:
            for index in list(self.posted):
                layer = self.layers[index]
                self.sync.wait(index, it, self.timeout_ms,
                               f"waiting for {layer.name} (iteration {it})")
                if used is not None and used[index] == 0:
                    continue  # unused on every rank: .grad stays as it was (as DDP leaves it)
                self._install_average(layer, it)
            self._settle_state(it)
        finally:
            self.posted.clear()
            self.zeroed.clear()
            self.iteration += 1
        if lost:
            raise PoseidonError(5, f"iteration {it}: {', '.join(lost[:3])} got a gradient without "
                                   "its module's forward; it is synchronised by SFB (pass sfb=False)")
        if missing and not self.find_unused:
            raise PoseidonError(5, f"iteration {it}: no gradient was produced for "
                                   f"{', '.join(l.name for l in missing[:5])}: pass "
                                   "find_unused_parameters=True if parameters may go unused")

    def _install_average(self, layer, iteration):
        """.grad = the summed result / world (in DDP mode an SFB weight's .grad kept what it held
        before backward, its local part zeroed by the hook: the average is added to it)."""
        p = layer.param
        total = layer.grad.view(p.shape)
        if p.grad is None:
            p.grad = (total / self.divisor).to(p.dtype)
        elif self.mode == "ddp" and self.scheme(layer, iteration) == PSD_SYNC_SFB:
            p.grad.add_(total, alpha=1.0 / self.divisor)
        elif p.grad.dtype == torch.float32 and p.grad.shape == p.shape:
            torch.div(total, self.divisor, out=p.grad)  # no allocation on the common path
        else:
            p.grad.copy_(total / self.divisor)

    def wait_all(self, install):
        """overlap/server modes: waits for every layer of this iteration (forward order)."""
        self.check_posted()
        self._post_state(self.iteration)
        for layer in self.layers:
            install(layer, self.iteration)
        self._settle_state(self.iteration)
        self.iteration += 1

    def check_posted(self):
        missing = [l.name for l in self.layers if l.index not in self.posted]
        if missing:
            raise PoseidonError(5, f"iteration {self.iteration}: no gradient was produced for "
                                   f"{', '.join(missing[:5])} (did backward run?)")
        self.posted.clear()

    def plan(self):
        if not self.registered:
            raise PoseidonError(5, "the plan is made at the first forward pass")
        names = {PSD_SYNC_SFB: "SFB", PSD_SYNC_ALLREDUCE: "AR"}
        return [(l.name, names.get(self.scheme(l), "PS"), l.param.numel()) for l in self.layers]

    @contextlib.contextmanager
    def no_sync(self):
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old


class DistributedDataParallel(torch.nn.Module):
    """torch.nn.parallel.DistributedDataParallel's contract through Poseidon (module doc).

    DDP's arguments are accepted: broadcast_buffers (rank 0's floating buffers, e.g. BatchNorm
    statistics, before each forward that follows a synchronised one, as DDP), and
    find_unused_parameters (parameters that get no gradient in an iteration are synchronised as
    zeros; one unused on every rank keeps its .grad, as DDP leaves it). device_ids,
    output_device, bucket_cap_mb, gradient_as_bucket_view and static_graph are accepted and do
    not change anything (the agent plans fusion and placement). Poseidon's own: sfb (False:
    every layer by PS), timeout_ms (every wait), grad_hook (see distribute), state (an
    ElasticState: the training loop's position, for a rank that takes up the running job; its
    `optimizer`, set before the loop, lets a live rank hand that optimizer's state over too),
    batch_size (as distribute's: the model is registered now instead of at its first forward,
    which a rank taking up the running job needs to learn its step before the loop)."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False, *,
                 sfb=True, timeout_ms=120000, grad_hook="auto", state=None, batch_size=None):
        super().__init__()
        if process_group is not None:
            raise PoseidonError(1, "process_group: Poseidon synchronises over its own job "
                                   "(poseidon.init()), not a torch.distributed group")
        if dim != 0:
            raise PoseidonError(1, "dim: only the batch dimension 0 is supported")
        self.module = module
        self._engine = _Engine(module, mode="ddp", timeout_ms=timeout_ms,
                               broadcast_buffers=broadcast_buffers,
                               find_unused_parameters=find_unused_parameters, grad_hook=grad_hook,
                               sfb=sfb, state=state, batch_size=batch_size)
        if batch_size is not None:
            self._engine.register(None)

    def forward(self, *inputs, **kwargs):
        self._engine.before_forward(lambda: self.module(*inputs, **kwargs))
        out = self.module(*inputs, **kwargs)
        self._engine.after_forward()
        return out

    def no_sync(self):
        """Gradient accumulation: backwards of forwards inside this context add to the local
        .grad without synchronising; the first backward outside it averages the sum."""
        return self._engine.no_sync()

    @property
    def plan(self):
        """[(parameter name, 'SFB' or 'PS', elements)] as the agent planned them."""
        return self._engine.plan()

    @property
    def device(self):
        return self._engine.device


class DistributedOptimizer:
    """Wraps a torch.optim optimizer; see distribute()."""

    def __init__(self, optimizer, engine):
        self._optimizer = optimizer
        self._engine = engine
        engine.optimizer = self
        self._per_param = None

    @property
    def _layers(self):
        return self._engine.layers

    @property
    def iteration(self):
        return self._engine.iteration

    @property
    def device(self):
        return self._engine.device

    @property
    def grad_hook(self):
        return self._engine.grad_hook

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_optimizer", "_engine", "_per_param"):
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def zero_grad(self, set_to_none=True):
        if self._optimizer is None:
            for layer in self._engine.layers or ():
                layer.param.grad = None
            return
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def no_sync(self):
        """See DistributedDataParallel.no_sync."""
        return self._engine.no_sync()

    # overlap_forward: one optimizer per parameter, stepped by the forward pre-hooks ---------
    def _per_param_optimizers(self):
        if self._per_param is None:
            # One optimizer per parameter with its group's hyperparameters, so that each layer
            # can step on its own when the next forward reaches it. Per-element rules (SGD,
            # momentum, Adam, ...) give exactly the same result as one step over all parameters.
            # Their state is the wrapped optimizer's (one dict), so state_dict() has it all.
            self._per_param = {}
            for group in self._optimizer.param_groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                for p in group["params"]:
                    opt = type(self._optimizer)([dict(params=[p], **hyper)])
                    opt.state = self._optimizer.state
                    self._per_param[id(p)] = (opt, group)
        return self._per_param

    def _install(self, layer, iteration):
        e = self._engine
        e.sync.wait(layer.index, iteration, e.timeout_ms, f"waiting for {layer.name}")
        if e.mode == "server":
            with torch.no_grad():
                layer.param.copy_(layer.grad.view(layer.param.shape))
            return
        e._install_average(layer, iteration)  # overlap mode: replaces the local .grad

    def _step_layer(self, layer):
        iteration = self._engine.pending.pop(layer.index, None)
        if iteration is None:
            return
        self._install(layer, iteration)
        opt, group = self._per_param_optimizers()[id(layer.param)]
        for k, v in group.items():  # the user's LR schedule (or any change) applies
            if k != "params":
                opt.param_groups[0][k] = v
        opt.state = self._optimizer.state  # load_state_dict replaces the dict
        opt.step()
        self._engine.stepped += 1

    def synchronize(self):
        """Applies every step still waiting for a forward pass (overlap_forward); in the other
        modes the gradients are in place already and this does nothing."""
        if self._engine.mode == "overlap" and self._engine.registered:
            for layer in self._engine.layers:
                self._step_layer(layer)

    def step(self, closure=None):
        e = self._engine
        if e.mode == "server":
            e.wait_all(self._install)  # the servers stepped: the parameters are installed
            _check_world(e)
            return None
        if e.mode == "ddp":
            loss = self._optimizer.step(closure)  # backward left the averages in .grad
            _check_world(e)
            return loss
        if closure is not None:
            raise PoseidonError(1, "closures are not supported with overlap_forward")
        e.check_posted()
        for layer in e.layers:  # each layer steps when the next forward reaches it
            e.pending[layer.index] = e.iteration
        e.overlap_post = (e.iteration, None if e.state is None else dict(e.state._fields),
                          e.forward_at, e.broadcasts)
        e.stepped = 0
        e._settle_state(e.iteration)
        e.iteration += 1
        _check_world(e)
        return None

    def state_dict(self):
        self.synchronize()  # overlap: the pending steps belong to the state
        return self._optimizer.state_dict()

    def load_state_dict(self, state):
        self._optimizer.load_state_dict(state)


SERVER_RULES = {"sgd": 2, "momentum": 3, "adam": 4}

STATE_LIMIT = 1 << 24  # every value travels as float32: integers below this are exact
CENSUS_SLOTS = 4  # a hand-over's census: per rank live, served, taking up, heard
LENGTH_SPLIT = 1 << 22  # a state's length travels as two floats: below and above this


def _takeovers():
    """(the job's takeovers this rank's agent heard of, its --rejoin_timeout in ms):
    psd_takeovers, a shared-memory read."""
    count, rejoin_ms = ctypes.c_uint64(), ctypes.c_uint32()
    check(lib().psd_takeovers(poseidon._context(), ctypes.byref(count), ctypes.byref(rejoin_ms)),
          "takeovers")
    return count.value, rejoin_ms.value


def _pack_bytes(data):
    """bytes -> float32, 3 bytes per value (integers below 2^24: exact, also in a sum with
    zeros), after 8 bytes of length."""
    data = struct.pack("<Q", len(data)) + data
    raw = torch.frombuffer(bytearray(data) + bytes(-len(data) % 3), dtype=torch.uint8)
    b = raw.to(torch.int32).view(-1, 3)
    return (b[:, 0] + b[:, 1] * 256 + b[:, 2] * 65536).to(torch.float32)


def _encode_state(obj):
    """A state (dicts, lists, tuples, numbers, strings, None and tensors: state dicts) -> bytes:
    its skeleton as JSON, then every tensor's bytes (no pickle: a peer's bytes run no code)."""
    tensors = []

    def skeleton(o):
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            tensors.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            return {"tensor": len(tensors) - 1, "dtype": str(t.dtype).split(".")[-1],
                    "shape": list(t.shape), "grad": o.requires_grad}
        if isinstance(o, dict):
            return {"dict": [[skeleton(k), skeleton(v)] for k, v in o.items()]}
        if isinstance(o, tuple):
            return {"tuple": [skeleton(v) for v in o]}
        if isinstance(o, list):
            return [skeleton(v) for v in o]
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        raise PoseidonError(5, f"a {type(o).__name__} in the model's or optimizer's state "
                               "cannot be handed to a rank taking up the job")

    head = json.dumps(skeleton(obj)).encode()
    sizes = [len(t) for t in tensors]
    return struct.pack("<QQ", len(head), len(sizes)) + head + struct.pack(
        f"<{len(sizes)}Q", *sizes) + b"".join(tensors)


def _decode_state(data):
    """_encode_state's inverse (a peer's bytes: every size checked)."""
    def garbled(why):
        return PoseidonError(5, f"a hand-over's state is garbled: {why}")

    if len(data) < 16:
        raise garbled(f"{len(data)} bytes")
    head_len, count = struct.unpack("<QQ", data[:16])
    at = 16 + head_len + 8 * count
    if at > len(data):
        raise garbled(f"{head_len} bytes of skeleton and {count} tensors in {len(data)} bytes")
    try:
        head = json.loads(data[16:16 + head_len])
    except ValueError as e:
        raise garbled(f"its skeleton: {e}") from None
    sizes = struct.unpack(f"<{count}Q", data[16 + head_len:at])
    offsets = [at]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    if offsets[-1] != len(data):
        raise garbled(f"tensors of {offsets[-1] - at} bytes in {len(data) - at}")

    def build(o):
        if isinstance(o, list):
            return [build(v) for v in o]
        if not isinstance(o, dict):
            return o
        if "dict" in o:
            return {build(k): build(v) for k, v in o["dict"]}
        if "tuple" in o:
            return tuple(build(v) for v in o["tuple"])
        i, dtype = o["tensor"], getattr(torch, o["dtype"], None)
        if not isinstance(dtype, torch.dtype) or not 0 <= i < count:
            raise garbled(f"tensor {i} of dtype {o['dtype']}")
        raw = bytearray(data[offsets[i]:offsets[i + 1]])
        numel = 1
        for s in o["shape"]:
            numel *= s
        if len(raw) != numel * torch.tensor([], dtype=dtype).element_size():
            raise garbled(f"tensor {i}: {len(raw)} bytes for shape {o['shape']} of {dtype}")
        t = (torch.frombuffer(raw, dtype=dtype) if raw else torch.zeros(0, dtype=dtype))
        return t.reshape(o["shape"]).requires_grad_(bool(o["grad"]) and dtype.is_floating_point)

    try:
        return build(head)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise garbled(f"{type(e).__name__}: {e}") from None


def _unpack_bytes(values):
    """_pack_bytes's inverse."""
    v = values.to(torch.int64)
    b = torch.stack([v & 255, (v >> 8) & 255, (v >> 16) & 255], 1).to(torch.uint8)
    data = b.reshape(-1).numpy().tobytes()
    if len(data) < 8 or struct.unpack("<Q", data[:8])[0] > len(data) - 8:
        raise PoseidonError(5, f"a hand-over's state is garbled ({len(data)} bytes)")
    return data[8:8 + struct.unpack("<Q", data[:8])[0]]


class ElasticState:
    """Where the training loop is — `epoch`, `batch` (the synchronised steps done in this epoch)
    and any other counters you name — the same on every rank, so that a rank taking up the
    running job (`poseidon run --rejoin`, or readmitted once the world grows again) starts where
    the others are, as torch.distributed.elastic's and Horovod's state objects restore it:

        state = poseidon.torch.ElasticState(epoch=0, batch=0)
        opt = poseidon.torch.distribute(model, None, batch_size=K, state=state,
                                        server_optimizer=dict(rule="adam", lr=1e-3))
        while state.epoch < EPOCHS:
            for i, (x, y) in enumerate(loader):   # shard it by poseidon.world()
                if i < state.batch:
                    continue                         # done before this rank took the job up
                loss_fn(model(x), y).backward()
                opt.step()                           # state.batch += 1
            state.next_epoch()

    With a local optimizer under DistributedDataParallel (your own optimizer), set
    `state.optimizer = opt` (or ElasticState(optimizer=opt)) before the loop: a rank that takes
    up the running job gets the model's and that optimizer's state, and this state's values,
    from a live rank when it calls resumed_steps() (or at its first forward), as Horovod's
    TorchState(model, optimizer) restores them; distribute(model, optimizer) knows it already.

    `batch` goes up by one at every synchronised step (the end of the iteration); next_epoch()
    sets `epoch` + 1 and `batch` 0; other counters are yours to set. Integers in [0, 2^24).
    With a server-side optimizer the KV servers hold the values with the parameters: every
    step() sends them and checks the servers then hold this rank's own (a rank whose loop went
    elsewhere stops, naming both); a rank that takes up a running job learns the position of
    the step it takes up when the model is registered (pass batch_size to distribute(): at the
    first forward the loop has picked its batch already, and the rank stops saying so); a job
    resumed from a checkpoint (`poseidon run --resume`) restores them. With a local optimizer
    the state is each rank's own, counted the same way, and a live rank hands it (with the model
    and the optimizer) to a rank taking up the job."""

    def __init__(self, epoch=0, batch=0, optimizer=None, **counters):
        fields = dict(epoch=epoch, batch=batch, **counters)
        for name, value in fields.items():
            _check_counter(name, value)
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_engine", None)
        object.__setattr__(self, "optimizer", None)
        if optimizer is not None:
            self.optimizer = optimizer

    def __getattr__(self, name):
        fields = self.__dict__.get("_fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name == "optimizer":
            if value is not None and not (hasattr(value, "state_dict") and
                                          hasattr(value, "load_state_dict")):
                raise PoseidonError(1, f"ElasticState.optimizer must be an optimizer (with "
                                       f"state_dict and load_state_dict), not {value!r}")
            object.__setattr__(self, name, value)
            return
        if name not in self._fields:
            raise AttributeError(f"ElasticState has no counter {name!r} (name every counter "
                                 "when creating it: every rank sends the same ones)")
        _check_counter(name, value)
        self._fields[name] = int(value)

    def next_epoch(self):
        """The epoch ended: `epoch` + 1, `batch` 0."""
        self._fields["epoch"] += 1
        self._fields["batch"] = 0

    def as_dict(self):
        return dict(self._fields)

    def __repr__(self):
        return "ElasticState(" + ", ".join(f"{k}={v}" for k, v in self._fields.items()) + ")"


def _check_counter(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < STATE_LIMIT:
        raise PoseidonError(1, f"ElasticState.{name} must be an integer in [0, 2^24), not "
                               f"{value!r}")


_world_hooks = []  # on_world_change's callbacks
_world_seen = None  # the world (rank, size, generation) they were last told of


def on_world_change(callback):
    """Registers `callback(old, new)`, called at the end of the optimizer's step() (the
    iteration boundary; with DistributedDataParallel and the user's own optimizer, at the start
    of the next forward) once the world this process trains in has changed since the last call:
    `old` and `new` are poseidon.world() tuples (rank, size, generation) — a dead rank removed
    (`poseidon run --min_workers`), or a removed rank readmitted (the world grows again). Reshard
    the data by `new` there; raise from it to unwind the training loop, as with Horovod's
    HostsUpdatedInterrupt. Returns `callback` (usable as a decorator)."""
    _world_hooks.append(callback)
    return callback


def _check_world(engine):
    global _world_seen
    if not _world_hooks and (engine.divisor == 1 or engine.server_rule is not None):
        return
    now = poseidon.world()
    if now[1] < engine.world and engine.divisor != 1 and engine.server_rule is None:
        # The agent runs with --min_workers but this process was not told: its .grad would
        # divide the sums of the ranks left by the whole world.
        raise PoseidonError(5, f"the world shrank to {now[1]} of {engine.world} ranks (the "
                               "agents run with --min_workers) but this process was not told "
                               "the job may shrink, so its .grad divides the sums by "
                               f"{engine.world}: set POSEIDON_MIN_WORKERS in the training "
                               "process's environment (poseidon run does)")
    if not _world_hooks:
        return
    if _world_seen is None:
        _world_seen = (poseidon.rank(), poseidon.size(), 0)
    if now[2] == _world_seen[2]:
        return
    old, _world_seen = _world_seen, now
    for callback in list(_world_hooks):
        callback(old, now)


_rejoined_at = None  # the job's iteration a rank that rejoined took up (psd_start_iteration)
_taking_up = []  # engines whose rank takes up the job once the optimizer is known


def resumed_steps():
    """The optimizer steps a resumed job's checkpoint holds (`poseidon run --resume`; 0 for a new
    job), or, in a rank that rejoined the running job (`poseidon run --rejoin`, a server-side
    optimizer; known once the model is registered), the steps the job has taken: a training loop
    starts at this step, and with a server-side optimizer the servers' parameters and optimizer
    state are those after it. Iteration 1 of this integration is the initial broadcast, so a
    checkpoint after iteration N holds N - 1 steps."""
    for engine in _taking_up:  # a rank taking up the job gets its state first
        engine.take_up_now()
    if _rejoined_at is not None:
        return _rejoined_at - 1
    return max(0, poseidon.resumed_iteration() - 1)


def _server_rule(server_optimizer):
    cfg = dict(server_optimizer)
    name = cfg.pop("rule", None)
    if name not in SERVER_RULES:
        raise PoseidonError(1, f"server rule must be one of {sorted(SERVER_RULES)}, not {name!r}")
    betas = cfg.pop("betas", (0.9, 0.999))
    rule = ServerRule(ctypes.sizeof(ServerRule), SERVER_RULES[name], float(cfg.pop("lr")),
                      float(cfg.pop("momentum", 0.0)), float(cfg.pop("dampening", 0.0)),
                      float(betas[0]), float(betas[1]), float(cfg.pop("eps", 1e-8)),
                      float(cfg.pop("weight_decay", 0.0)), int(bool(cfg.pop("nesterov", False))))
    if cfg:
        raise PoseidonError(1, f"unknown server_optimizer settings: {sorted(cfg)}")
    return rule


def distribute(model, optimizer, batch_size=None, timeout_ms=120000, overlap_forward=False,
               server_optimizer=None, grad_hook="auto", broadcast_buffers=True,
               find_unused_parameters=False, sfb=True, state=None):
    """Registers `model` with the agent and returns the optimizer to train with.

    By default the contract is DDP's (module doc): backward() returns with every .grad averaged
    over the workers, and step() is your optimizer's step. batch_size: the per-worker rows of
    every nn.Linear input (K for SFB layers; a smaller batch is padded with zero rows); then the
    model is registered now. Without it (None) the model is registered at its first forward,
    which measures the rows (batch x tokens for sequence models) and which Linear modules run.

    overlap_forward=True: step() returns at once and each module's parameters are updated by a
    forward pre-hook when the next forward pass reaches it, so synchronisation also overlaps the
    next forward; .grad is not averaged when backward returns (call optimizer.synchronize()
    before reading the parameters outside a forward pass; state_dict() does it).

    server_optimizer, e.g. dict(rule="adam", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0) or dict(rule="momentum", lr=0.1, momentum=0.9, nesterov=False): the KV
    servers apply the update (torch.optim's definitions, gradients averaged over the workers),
    every layer goes by PS, and step() installs the updated parameters; `optimizer` may be None.

    grad_hook: how a PS layer's gradient is caught. "auto" (the default): "post_accumulate" where
    torch.Tensor.register_post_accumulate_grad_hook exists (PyTorch >= 2.1; the hook sees the
    parameter's complete .grad), else "tensor" (a hook on the parameter, which sees the gradient
    autograd adds: PyTorch 1.13). broadcast_buffers, find_unused_parameters, sfb, state: as for
    DistributedDataParallel."""
    if server_optimizer is not None and overlap_forward:
        raise PoseidonError(1, "overlap_forward is for local optimizers")
    mode = "server" if server_optimizer is not None else "overlap" if overlap_forward else "ddp"
    rule = _server_rule(server_optimizer) if server_optimizer is not None else None
    if getattr(model, "_poseidon_engine", None) is not None:
        raise PoseidonError(5, "this model is already distributed")
    engine = _Engine(model, mode=mode, batch_size=batch_size, timeout_ms=timeout_ms,
                     broadcast_buffers=broadcast_buffers,
                     find_unused_parameters=find_unused_parameters, server_rule=rule,
                     grad_hook=grad_hook, sfb=sfb, state=state)
    wrapped = DistributedOptimizer(optimizer, engine)
    if batch_size is not None:
        engine.register(None)
    original = model.forward

    def forward(*inputs, **kwargs):
        engine.before_forward(lambda: original(*inputs, **kwargs))
        out = original(*inputs, **kwargs)
        engine.after_forward()
        return out

    model.forward = forward  # every call of the model goes through the engine
    model._poseidon_engine = engine
    if mode == "overlap":
        # The model's state dict is read after the pending steps are applied (not by a rank
        # handing its state over from inside a wait for them).
        model._register_state_dict_hook(
            lambda module, state, prefix, meta: None if engine.handing_over
            else wrapped.synchronize())
    return wrapped


def plan_summary(obj):
    """[(layer name, 'SFB' or 'PS', parameters)] as the agent planned them, for the optimizer
    distribute() returned or a DistributedDataParallel model."""
    return obj._engine.plan()

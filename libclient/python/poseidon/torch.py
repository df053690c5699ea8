"""PyTorch integration: wait-free backpropagation through the local poseidon-agent.

    optimizer = poseidon.torch.distribute(model, optimizer, batch_size=32)

registers every parameter of `model` as a layer (in definition order: the order the forward pass
needs them), broadcasts rank 0's initial parameters so every replica starts equal, and installs
the hooks: as backward produces each parameter's gradient, it is written into the agent's shared
buffer and posted ready at once (WFBP), so synchronisation overlaps the rest of backward. For an
nn.Linear whose weight the plan syncs by SFB, the layer's input (forward hook) and output gradient
(backward hook) are handed over instead: the agent broadcasts these sufficient factors and rebuilds
the summed weight gradient. The returned optimizer's step() waits for each layer's summed
gradient, averages it over the workers (the gradient of the P-times larger batch with a mean
loss) and then runs your optimizer: its learning-rate schedule, momentum, etc. work unchanged.

A model on a CUDA device keeps its gradients there: the agent shares a device arena laid out like
the host buffers (psd_cuda_enable) and every buffer above is a torch tensor on that device (no
copy). Writes, ready events (psd_cuda_layer_ready) and waits (psd_cuda_wait_layer) are ordered on
the current CUDA stream, so neither backward nor step() synchronises the device.
"""
import ctypes

import numpy as np
import torch

import poseidon
from ._capi import (LayerDesc, LayerInfo, PoseidonError, ServerRule, PSD_FLOAT32, PSD_LAYER_BIAS,
                    PSD_LAYER_CONV, PSD_LAYER_FC, PSD_LAYER_FUSABLE, PSD_LAYER_OTHER, PSD_SYNC_SFB,
                    check, lib)

BROADCAST_LAYER = "__poseidon_broadcast__"


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


class _HostSync:
    """Ready and wait on the host buffers (psd_layer_ready / psd_wait_layer)."""

    def __init__(self, ctx):
        self.ctx = ctx

    def ready(self, index, iteration, what):
        check(lib().psd_layer_ready(self.ctx, index, iteration), what)

    def wait(self, index, iteration, timeout_ms, what):
        check(lib().psd_wait_layer(self.ctx, index, iteration, timeout_ms), what)


class _CudaSync:
    """Ready and wait on the device arena, ordered on the current stream of `device`: ready
    records the layer's event on it and returns; wait returns once the agent's result copy is
    queued and makes the stream wait for it on the device (no host synchronisation)."""

    def __init__(self, ctx, device):
        self.ctx, self.device = ctx, device

    def _stream(self):
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream or None)

    def ready(self, index, iteration, what):
        # The current device matters for the legacy default stream (handle 0): make it ours.
        with torch.cuda.device(self.device):
            check(lib().psd_cuda_layer_ready(self.ctx, index, iteration, self._stream()), what)

    def wait(self, index, iteration, timeout_ms, what):
        with torch.cuda.device(self.device):
            check(lib().psd_cuda_wait_layer(self.ctx, index, iteration, timeout_ms,
                                            self._stream()), what)


class _Layer:
    def __init__(self, index, name, param, kind, module):
        self.index, self.name, self.param, self.kind, self.module = index, name, param, kind, module
        self.scheme = None
        self.grad = None  # flat view of the shared gradient buffer (host, or the CUDA arena)
        self.u = self.v = None


def _describe(model):
    layers = []
    seen = set()
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                raise PoseidonError(1, f"parameter {module_name}.{pname} is shared between modules")
            seen.add(id(param))
            if not param.requires_grad:
                continue
            if param.dtype != torch.float32:
                raise PoseidonError(1, f"{module_name}.{pname}: only float32 parameters are supported")
            name = f"{module_name}.{pname}" if module_name else pname
            if isinstance(module, torch.nn.Linear) and pname == "weight":
                kind = PSD_LAYER_FC
            elif pname == "bias":
                kind = PSD_LAYER_BIAS
            elif isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
                kind = PSD_LAYER_CONV
            else:
                kind = PSD_LAYER_OTHER
            layers.append(_Layer(len(layers), name, param, kind, module))
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


class DistributedOptimizer:
    """Wraps a torch.optim optimizer; see distribute()."""

    def __init__(self, optimizer, layers, ctx, world, timeout_ms, overlap_forward=False,
                 server=False, sync=None):
        self._optimizer = optimizer
        self._sync = sync or _HostSync(ctx)  # host buffers, or the CUDA arena
        self._server = server  # the servers apply the update: results are parameters
        self._layers = layers
        self._ctx = ctx
        self._world = world
        self._timeout_ms = timeout_ms
        self.iteration = 2  # 1 was the initial broadcast
        self.posted = set()
        self._overlap = overlap_forward
        self._pending = {}  # layer index -> iteration whose step waits for the next forward
        if overlap_forward:
            # One optimizer per parameter with its group's hyperparameters, so that each layer
            # can step on its own when the next forward reaches it. Per-element rules (SGD,
            # momentum, Adam, ...) give exactly the same result as one step over all parameters.
            self._per_param = {}
            for group in optimizer.param_groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                for p in group["params"]:
                    self._per_param[id(p)] = (type(optimizer)([dict(params=[p], **hyper)]), group)

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def zero_grad(self, set_to_none=True):
        if self._optimizer is None:
            for layer in self._layers:
                layer.param.grad = None
            return
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def _check_posted(self):
        missing = [l.name for l in self._layers if l.index not in self.posted]
        if missing:
            raise PoseidonError(5, f"iteration {self.iteration}: no gradient was produced for "
                                   f"{', '.join(missing[:5])} (did backward run?)")
        self.posted.clear()

    def _install(self, layer, iteration):
        self._sync.wait(layer.index, iteration, self._timeout_ms, f"waiting for {layer.name}")
        if self._server:
            with torch.no_grad():
                layer.param.copy_(layer.grad.view_as(layer.param))
            return
        layer.param.grad = (layer.grad / self._world).view_as(layer.param).clone()

    def synchronize(self):
        """Applies every step still waiting for a forward pass (overlap_forward); without
        overlap_forward, step() has already waited and this does nothing."""
        if self._overlap:
            for layer in self._layers:
                self._step_layer(layer)

    def _wait_all(self):
        """Waits for every layer of this iteration and installs the averaged gradients."""
        self._check_posted()
        for layer in self._layers:  # forward order: the next forward needs layer 0 first
            self._install(layer, self.iteration)
        self.iteration += 1

    def _step_layer(self, layer):
        iteration = self._pending.pop(layer.index, None)
        if iteration is None:
            return
        self._install(layer, iteration)
        opt, group = self._per_param[id(layer.param)]
        for k, v in group.items():  # the user's LR schedule (or any change) applies
            if k != "params":
                opt.param_groups[0][k] = v
        opt.step()

    def step(self, closure=None):
        if self._server:
            self._wait_all()  # the servers stepped: the parameters are installed
            return None
        if not self._overlap:
            self._wait_all()
            return self._optimizer.step(closure)
        if closure is not None:
            raise PoseidonError(1, "closures are not supported with overlap_forward")
        self._check_posted()
        for layer in self._layers:  # each layer steps when the next forward reaches it
            self._pending[layer.index] = self.iteration
        self.iteration += 1
        return None

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state):
        self._optimizer.load_state_dict(state)


SERVER_RULES = {"sgd": 2, "momentum": 3, "adam": 4}


def distribute(model, optimizer, batch_size, timeout_ms=120000, overlap_forward=False,
               server_optimizer=None, grad_hook="auto"):
    """Registers `model` with the agent and returns the optimizer to train with (see module doc).

    batch_size is the per-worker batch: SFB layers need every batch to have exactly this many
    rows (use drop_last=True in the DataLoader). With overlap_forward, step() returns at once and
    each module's parameters are updated by a forward pre-hook when the next forward pass reaches
    it, so synchronisation also overlaps the next forward (call optimizer.synchronize() before
    reading the parameters outside a forward pass, e.g. to save them).

    server_optimizer, e.g. dict(rule="adam", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0) or dict(rule="momentum", lr=0.1, momentum=0.9, nesterov=False): the KV
    servers apply the update (torch.optim's definitions, gradients averaged over the workers),
    every layer goes by PS, and step() installs the updated parameters; `optimizer` may be None.

    A model on a CUDA device (every parameter on the same one) is synchronised through a device
    arena: no host copies, ordered on the current CUDA stream (see docs/pytorch.md).

    grad_hook: how a PS layer's gradient is caught. "auto" (the default): "post_accumulate" where
    torch.Tensor.register_post_accumulate_grad_hook exists (PyTorch >= 2.1; the hook sees the
    parameter's complete .grad), else "tensor" (a hook on the parameter, which sees the gradient
    autograd produces for it: PyTorch 1.13)."""
    ctx = poseidon._context()
    world = poseidon.size()
    has_post_accumulate = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
    if grad_hook == "auto":
        grad_hook = "post_accumulate" if has_post_accumulate else "tensor"
    if grad_hook not in ("post_accumulate", "tensor"):
        raise PoseidonError(1, f"grad_hook must be 'auto', 'post_accumulate' or 'tensor', "
                               f"not {grad_hook!r}")
    if grad_hook == "post_accumulate" and not has_post_accumulate:
        raise PoseidonError(1, f"grad_hook='post_accumulate' needs PyTorch >= 2.1 "
                               f"(this is {torch.__version__})")
    layers, device = _describe(model)
    if server_optimizer is not None:
        if overlap_forward:
            raise PoseidonError(1, "overlap_forward is for local optimizers")
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
        check(lib().psd_set_server_rule(ctx, ctypes.byref(rule)), "server rule")
    total = sum(l.param.numel() for l in layers)
    # The last layer is the broadcast buffer: every parameter, sent by rank 0 once.
    names = [l.name.encode() for l in layers] + [BROADCAST_LAYER.encode()]
    shapes = [(ctypes.c_uint64 * max(1, l.param.dim()))(*(l.param.shape or (1,))) for l in layers]
    shapes.append((ctypes.c_uint64 * 1)(total))
    descs = (LayerDesc * (len(layers) + 1))()
    for i, layer in enumerate(layers):
        descs[i] = LayerDesc(names[i], layer.kind, PSD_FLOAT32, max(1, layer.param.dim()),
                             ctypes.cast(shapes[i], ctypes.POINTER(ctypes.c_uint64)),
                             batch_size if layer.kind == PSD_LAYER_FC else 0,
                             # Every gradient is posted during backward, so layers may be fused;
                             # the agent fuses host-memory layers only.
                             PSD_LAYER_FUSABLE if device.type == "cpu" else 0)
    # Not fusable: it is posted alone at start-up and waited for before training starts.
    descs[len(layers)] = LayerDesc(names[-1], PSD_LAYER_OTHER, PSD_FLOAT32, 1,
                                   ctypes.cast(shapes[-1], ctypes.POINTER(ctypes.c_uint64)), 0)
    check(lib().psd_register_layers(ctx, descs, len(layers) + 1, timeout_ms), "register layers")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        # psd_cuda_enable sets the thread's current device: the guard restores the caller's.
        with torch.cuda.device(device):
            check(lib().psd_cuda_enable(ctx, device.index, timeout_ms), f"enabling CUDA on {device}")
        sync = _CudaSync(ctx, device)
        # The arena belongs to the context (freed by poseidon.shutdown()); each view's wrapper
        # holds the context handle as its owner.
        arena = ctx

        def views(index, info):
            grad, u, v = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            check(lib().psd_cuda_layer_buffers(ctx, index, ctypes.byref(grad), ctypes.byref(u),
                                               ctypes.byref(v)), "CUDA layer buffers")
            return lambda which, count: _device_view({"grad": grad, "u": u, "v": v}[which].value,
                                                     count, device, arena)
    else:
        sync = _HostSync(ctx)

        def views(index, info):
            return lambda which, count: _view(getattr(info, which), count)
    for layer in layers:
        info = LayerInfo()
        check(lib().psd_get_layer_info(ctx, layer.index, ctypes.byref(info)), "layer info")
        layer.scheme = info.scheme
        view = views(layer.index, info)
        layer.grad = view("grad", info.elements)
        if info.scheme == PSD_SYNC_SFB:
            m, n = layer.param.shape
            layer.u = view("u", batch_size * m).view(batch_size, m)
            layer.v = view("v", batch_size * n).view(batch_size, n)
    info = LayerInfo()
    check(lib().psd_get_layer_info(ctx, len(layers), ctypes.byref(info)), "broadcast buffer")
    broadcast = views(len(layers), info)("grad", total)
    _broadcast(sync, layers, len(layers), broadcast, timeout_ms,
               server=server_optimizer is not None)
    wrapped = DistributedOptimizer(optimizer, layers, ctx, world, timeout_ms, overlap_forward,
                                   server=server_optimizer is not None, sync=sync)
    _install_hooks(layers, wrapped, sync, batch_size, grad_hook)
    if overlap_forward:
        by_module = {}
        for layer in layers:
            by_module.setdefault(id(layer.module), (layer.module, []))[1].append(layer)
        for module, owned in by_module.values():
            def pre_hook(module, inputs, owned=owned):
                for layer in owned:
                    wrapped._step_layer(layer)

            module.register_forward_pre_hook(pre_hook)
    model._poseidon_layers = layers  # keep the views alive with the model
    wrapped.device = device
    wrapped.grad_hook = grad_hook
    return wrapped


def plan_summary(optimizer):
    """[(layer name, 'SFB' or 'PS', parameters)] as the agent planned them."""
    return [(l.name, "SFB" if l.scheme == PSD_SYNC_SFB else "PS", l.param.numel())
            for l in optimizer._layers]


def _broadcast(sync, layers, index, buffer, timeout_ms, server=False):
    """Iteration 1: rank 0's parameters through `buffer` (layer `index`), then every layer."""
    if poseidon.rank() == 0:
        buffer.copy_(torch.cat([l.param.detach().reshape(-1) for l in layers]))
    else:
        buffer.zero_()
    sync.ready(index, 1, "broadcast")
    sync.wait(index, 1, timeout_ms, "broadcast")
    offset = 0
    with torch.no_grad():
        for layer in layers:
            n = layer.param.numel()
            layer.param.copy_(buffer[offset:offset + n].view_as(layer.param))
            offset += n
    # Every other layer takes iteration 1 as well, so that training starts at 2 everywhere.
    # With a server-side rule iteration 1 is each table's initial value (rank 0's, as above).
    for layer in layers:
        if server:
            layer.grad.copy_(layer.param.detach().reshape(-1))
        else:
            layer.grad.zero_()
        if layer.u is not None:
            layer.u.zero_()
            layer.v.zero_()
        sync.ready(layer.index, 1, "initial sync")
    for layer in layers:
        sync.wait(layer.index, 1, timeout_ms, "initial sync")


def _install_hooks(layers, opt, sync, batch_size, grad_hook):
    """The ready hooks. Each writes the layer's input into its buffers (host, or the CUDA arena
    on the current stream, the one autograd runs the layer's backward on) and posts it."""
    def post(layer):
        if layer.index in opt.posted:
            raise PoseidonError(5, f"{layer.name}: a second gradient in iteration {opt.iteration} "
                                   "(call optimizer.step() after every backward)")
        opt.posted.add(layer.index)
        sync.ready(layer.index, opt.iteration, f"posting {layer.name}")

    for layer in layers:
        if layer.scheme == PSD_SYNC_SFB:
            def forward_hook(module, inputs, output, layer=layer):
                x = inputs[0]
                if not torch.is_grad_enabled() or not output.requires_grad:
                    return
                if x.dim() != 2 or x.shape[0] != batch_size:
                    raise PoseidonError(1, f"{layer.name} is synchronised by SFB with K = {batch_size}"
                                           f" rows, got input of shape {tuple(x.shape)} "
                                           "(use drop_last=True)")
                saved = x.detach()

                def output_grad_hook(g, layer=layer, saved=saved):
                    layer.u.copy_(g)
                    layer.v.copy_(saved)
                    post(layer)

                output.register_hook(output_grad_hook)
            layer.module.register_forward_hook(forward_hook)
        elif grad_hook == "post_accumulate":
            # PyTorch >= 2.1: called once the parameter's .grad is complete for this backward.
            def accumulated_hook(param, layer=layer):
                layer.grad.copy_(param.grad.reshape(-1))
                post(layer)

            layer.param.register_post_accumulate_grad_hook(accumulated_hook)
        else:
            # PyTorch 1.13 (or grad_hook="tensor"): the tensor hook sees the parameter's
            # gradient as autograd makes it (a parameter used once per forward gets exactly one).
            def tensor_hook(g, layer=layer):
                layer.grad.copy_(g.reshape(-1))
                post(layer)

            layer.param.register_hook(tensor_hook)

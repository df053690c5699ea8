"""Poseidon for Python: attach a training process to its poseidon-agent.

    import poseidon
    poseidon.init()                       # reads POSEIDON_SEGMENT (set by `poseidon run`)
    poseidon.rank(), poseidon.size()
    model = ...; optimizer = ...
    optimizer = poseidon.torch.distribute(model, optimizer, batch_size=32)
    ...
    poseidon.shutdown()

See docs/pytorch.md.
"""
import ctypes
import os

from ._capi import PoseidonError, check, lib, Config

_ctx = None
_rank = None
_size = None


def init(segment=None, attach_timeout_ms=60000, agent_timeout_ms=5000):
    """Attaches to the local agent (segment: $POSEIDON_SEGMENT by default). Once per process."""
    global _ctx, _rank, _size
    if _ctx is not None:
        raise PoseidonError(5, "poseidon.init() was already called")
    segment = segment or os.environ.get("POSEIDON_SEGMENT")
    if not segment:
        raise PoseidonError(1, "no agent segment: run under `poseidon run` or set POSEIDON_SEGMENT")
    config = Config()
    lib().psd_config_init(ctypes.byref(config))
    config.segment = segment.encode()
    config.attach_timeout_ms = attach_timeout_ms
    config.agent_timeout_ms = agent_timeout_ms
    ctx = ctypes.c_void_p()
    check(lib().psd_attach(ctypes.byref(config), ctypes.byref(ctx)), "attach")
    r, s = ctypes.c_uint32(), ctypes.c_uint32()
    check(lib().psd_rank(ctx, ctypes.byref(r), ctypes.byref(s)), "rank")
    _ctx, _rank, _size = ctx, r.value, s.value


def _context():
    if _ctx is None:
        raise PoseidonError(5, "call poseidon.init() first")
    return _ctx


def rank():
    _context()
    return _rank


def size():
    _context()
    return _size


def world():
    """(rank, size, generation): this process's rank among the ranks the job goes on with, their
    number, and how many times that changed — (rank(), size(), 0) until the world shrinks (a dead
    rank removed, `poseidon run --min_workers`). From then on the synchronised results sum the
    ranks left: shard the data by these. Cheap (one load from shared memory)."""
    r, s, g = ctypes.c_uint32(), ctypes.c_uint32(), ctypes.c_uint64()
    check(lib().psd_world(_context(), ctypes.byref(r), ctypes.byref(s), ctypes.byref(g)), "world")
    return r.value, s.value, g.value


def local_rank():
    return int(os.environ.get("POSEIDON_LOCAL_RANK", rank()))


def resumed_iteration():
    """The iteration the job's KV servers were restored at (`poseidon run --resume` sets
    $POSEIDON_RESUMED_ITERATION; 0 for a new job). See poseidon.torch.resumed_steps."""
    value = os.environ.get("POSEIDON_RESUMED_ITERATION", "0")
    if not value.isdigit():
        raise PoseidonError(1, f"POSEIDON_RESUMED_ITERATION={value!r} is not an iteration")
    return int(value)


def shutdown():
    """Detaches from the agent (which then exits cleanly)."""
    global _ctx
    if _ctx is not None:
        lib().psd_detach(_ctx)
        _ctx = None


from . import torch  # noqa: E402,F401  (poseidon.torch)

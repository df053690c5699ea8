"""ctypes bindings to libposeidon (libclient/include/poseidon/poseidon.h).

The library is found through $POSEIDON_LIB, else next to this package in a build tree
(<build>/libclient/python/libposeidon.so), else by the loader's search path (libposeidon.so.1, as
the libposeidon1 package installs it).
"""
import ctypes
import os

PSD_OK = 0
PSD_TIMEOUT = 2  # a wait's timeout passed; the agent is alive
STATUS_NAMES = {
    0: "ok", 1: "invalid argument", 2: "timeout", 3: "agent lost", 4: "not found",
    5: "failed precondition", 6: "already attached", 7: "synchronisation failed",
    8: "version mismatch", 9: "internal error",
}
PSD_LAYER_FC, PSD_LAYER_CONV, PSD_LAYER_BIAS, PSD_LAYER_OTHER = 1, 2, 3, 4
PSD_LAYER_FUSABLE = 1  # psd_layer_desc.flags
PSD_LAYER_AVERAGE = 2  # the KV servers answer the mean over the ranks each clock summed
PSD_LAYER_COUNTERS = 4  # server-side rule jobs: SGD with learning rate 1 (ElasticState)
PSD_LAYER_OWN_CLOCK = 8  # iterations of its own (the buffers' broadcasts), not the job's
PSD_LAYER_BY_SERVERS = 16  # PS whatever the plan says (a retransmission only a server answers)
PSD_FLOAT32 = 1
PSD_SYNC_PS, PSD_SYNC_SFB, PSD_SYNC_ALLREDUCE = 1, 2, 3
ABI_VERSION = 3


class PoseidonError(RuntimeError):
    """A failed libposeidon call; `status` is the psd_status name."""

    def __init__(self, status, message):
        self.status = STATUS_NAMES.get(status, str(status))
        super().__init__(f"{self.status}: {message}")


class Config(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("abi_version", ctypes.c_uint32),
                ("segment", ctypes.c_char_p), ("attach_timeout_ms", ctypes.c_uint32),
                ("agent_timeout_ms", ctypes.c_uint32)]


class LayerDesc(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("kind", ctypes.c_uint32), ("dtype", ctypes.c_uint32),
                ("ndim", ctypes.c_uint32), ("shape", ctypes.POINTER(ctypes.c_uint64)),
                ("batch_k", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


class ServerRule(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("rule", ctypes.c_uint32),
                ("lr", ctypes.c_double), ("momentum", ctypes.c_double),
                ("dampening", ctypes.c_double), ("beta1", ctypes.c_double),
                ("beta2", ctypes.c_double), ("eps", ctypes.c_double),
                ("weight_decay", ctypes.c_double), ("nesterov", ctypes.c_uint32)]


class LayerInfo(ctypes.Structure):
    _fields_ = [("scheme", ctypes.c_uint32), ("priority", ctypes.c_uint32),
                ("elements", ctypes.c_uint64), ("grad", ctypes.POINTER(ctypes.c_float)),
                ("u", ctypes.POINTER(ctypes.c_float)), ("v", ctypes.POINTER(ctypes.c_float))]


def _find_library():
    explicit = os.environ.get("POSEIDON_LIB")
    if explicit:
        return explicit
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.join(here, "..", "libposeidon.so")]
    root = os.path.abspath(os.path.join(here, "..", "..", ".."))
    for build in (os.environ.get("POSEIDON_BUILD_DIR", ""), "build/release", "build/asan"):
        if build:
            candidates.append(os.path.join(build if os.path.isabs(build) else os.path.join(root, build),
                                           "libclient", "python", "libposeidon.so"))
    for c in candidates:
        if os.path.exists(c):
            return c
    return "libposeidon.so.1"  # installed (libposeidon1): the loader's search path


_lib = None


def lib():
    global _lib
    if _lib is None:
        path = _find_library()
        try:
            _lib = ctypes.CDLL(path)
        except OSError as e:
            raise PoseidonError(4, f"cannot load libposeidon ({path}): {e}; build it "
                                   "(./scripts/demo.sh) or set POSEIDON_LIB") from None
        s = ctypes.c_int
        _lib.psd_config_init.argtypes = [ctypes.POINTER(Config)]
        _lib.psd_attach.argtypes = [ctypes.POINTER(Config), ctypes.POINTER(ctypes.c_void_p)]
        _lib.psd_attach.restype = s
        _lib.psd_register_layers.argtypes = [ctypes.c_void_p, ctypes.POINTER(LayerDesc),
                                             ctypes.c_uint32, ctypes.c_uint32]
        _lib.psd_register_layers.restype = s
        _lib.psd_get_layer_info.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                            ctypes.POINTER(LayerInfo)]
        _lib.psd_get_layer_info.restype = s
        _lib.psd_layer_scheme.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64,
                                          ctypes.POINTER(ctypes.c_uint32)]
        _lib.psd_layer_scheme.restype = s
        _lib.psd_set_server_rule.argtypes = [ctypes.c_void_p, ctypes.POINTER(ServerRule)]
        _lib.psd_set_server_rule.restype = s
        _lib.psd_layer_ready.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64]
        _lib.psd_layer_ready.restype = s
        _lib.psd_wait_layer.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64,
                                        ctypes.c_uint32]
        _lib.psd_wait_layer.restype = s
        # CUDA: streams are cudaStream_t (c_void_p; None/0 is the legacy default stream).
        _lib.psd_cuda_enable.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
        _lib.psd_cuda_enable.restype = s
        _lib.psd_cuda_layer_buffers.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                                ctypes.POINTER(ctypes.c_void_p),
                                                ctypes.POINTER(ctypes.c_void_p),
                                                ctypes.POINTER(ctypes.c_void_p)]
        _lib.psd_cuda_layer_buffers.restype = s
        _lib.psd_cuda_layer_ready.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64,
                                              ctypes.c_void_p]
        _lib.psd_cuda_layer_ready.restype = s
        _lib.psd_cuda_wait_layer.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64,
                                             ctypes.c_uint32, ctypes.c_void_p]
        _lib.psd_cuda_wait_layer.restype = s
        _lib.psd_rank.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32),
                                  ctypes.POINTER(ctypes.c_uint32)]
        _lib.psd_rank.restype = s
        _lib.psd_world.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32),
                                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)]
        _lib.psd_world.restype = s
        _lib.psd_takeovers.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                                           ctypes.POINTER(ctypes.c_uint32)]
        _lib.psd_takeovers.restype = s
        _lib.psd_start_iteration.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
        _lib.psd_start_iteration.restype = s
        _lib.psd_detach.argtypes = [ctypes.c_void_p]
        _lib.psd_detach.restype = s
        _lib.psd_last_error.restype = ctypes.c_char_p
        _lib.psd_abi_version.restype = ctypes.c_uint32
        if _lib.psd_abi_version() != ABI_VERSION:
            raise PoseidonError(8, f"libposeidon speaks ABI {_lib.psd_abi_version()}, "
                                   f"this package {ABI_VERSION}")
    return _lib


def check(status, what):
    if status != PSD_OK:
        raise PoseidonError(status, f"{what}: {lib().psd_last_error().decode(errors='replace')}")

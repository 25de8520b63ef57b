"""The few CUDA driver calls kvcompile's own CUDA kernels need, through ctypes.

Kernels are compiled by nvcc into cubins (build.py) and launched with `cuLaunchKernel` on torch's
current stream, so they are captured by CUDA graphs like any torch kernel. No torch C++ extension
is built: a cubin loads in milliseconds and needs no compiler at run time once cached.
"""

from __future__ import annotations

import ctypes
import threading

import torch

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

_lib = None
_lock = threading.RLock()  # function() holds it while _driver() may take it again


class CudaDriverError(RuntimeError):
    pass


def _driver():
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                lib = ctypes.CDLL("libcuda.so.1")
                for name, args in (
                        ("cuInit", [ctypes.c_uint]),
                        ("cuCtxGetCurrent", [ctypes.POINTER(ctypes.c_void_p)]),
                        ("cuCtxSetCurrent", [ctypes.c_void_p]),
                        ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                        ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p),
                                                      ctypes.c_int]),
                        ("cuModuleLoadData", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]),
                        ("cuModuleGetFunction", [ctypes.POINTER(ctypes.c_void_p),
                                                 ctypes.c_void_p, ctypes.c_char_p]),
                        ("cuFuncSetAttribute", [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]),
                        ("cuLaunchKernel", [ctypes.c_void_p] + [ctypes.c_uint] * 6 +
                         [ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                          ctypes.c_void_p]),
                        ("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])):
                    fn = getattr(lib, name)
                    fn.argtypes = args
                    fn.restype = ctypes.c_int
                _check(lib, lib.cuInit(0), "cuInit")
                _lib = lib
    return _lib


def _check(lib, rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else f"error {rc}"
        raise CudaDriverError(f"{what} failed: {text}")


def _ensure_context(device_index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    lib = _driver()
    cur = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if cur.value:
        return
    dev = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class Kernel:
    """One kernel of a cubin, loaded into the primary context of each device it runs on."""

    def __init__(self, cubin: bytes, name: str, smem_bytes: int):
        self.cubin, self.name, self.smem = cubin, name.encode(), int(smem_bytes)
        self._fn: dict[int, ctypes.c_void_p] = {}
        self._keep = []

    def function(self, device_index: int):
        fn = self._fn.get(device_index)
        if fn is None:
            with _lock:
                torch.cuda.init()
                with torch.cuda.device(device_index):
                    torch.cuda.current_stream()  # the runtime makes the primary context current
                    _ensure_context(device_index)
                    lib = _driver()
                    mod = ctypes.c_void_p()
                    _check(lib, lib.cuModuleLoadData(ctypes.byref(mod), self.cubin),
                           "cuModuleLoadData")
                    fn = ctypes.c_void_p()
                    _check(lib, lib.cuModuleGetFunction(ctypes.byref(fn), mod, self.name),
                           "cuModuleGetFunction")
                    if self.smem > 48 * 1024:
                        _check(lib, lib.cuFuncSetAttribute(
                            fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem),
                            "cuFuncSetAttribute(max dynamic shared memory)")
                    self._keep.append(mod)
                    self._fn[device_index] = fn
        return fn

    def launch(self, grid: tuple[int, int, int], block: int, params: ctypes.Structure,
               device: torch.device) -> None:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        fn = self.function(idx)
        _ensure_context(idx)
        stream = torch.cuda.current_stream(device).cuda_stream
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(params), ctypes.c_void_p))
        lib = _driver()
        _check(lib, lib.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1, self.smem,
                                       ctypes.c_void_p(stream), args, None),
               f"cuLaunchKernel({self.name.decode()})")

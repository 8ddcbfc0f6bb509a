"""megatron-core on a machine without CUDA (every supported release, 0.16.1 to 0.19.2): the ONE place where we
bend torch for it.

megatron-core hard-codes CUDA in code paths a CPU run (the tests, ``make train``) goes through:
tensors created with ``device=torch.cuda.current_device()`` or ``device="cuda"`` (parameter and gradient
buffers, the sequence-parallel memory buffer, the optimizer, the pipeline schedules, p2p), ``Tensor.cuda()``,
type checks such as ``param.type() == "torch.cuda.FloatTensor"`` (optimizers, grad clipping), and the RNG
tracker and checkpoint code calling ``torch.cuda.{current_device, get_rng_state, synchronize}``.

:func:`enable_cpu_compat` makes those calls work on CPU, and is applied only when no CUDA device exists:

1. a ``TorchFunctionMode`` (:class:`CudaAsCpu`) that maps a CUDA ``device=`` argument (and a CUDA
   device given to ``Tensor.to``) to the CPU, makes ``Tensor.cuda()`` return the tensor itself, and reports
   ``Tensor.type()`` with the ``torch.cuda.`` prefix megatron's type checks expect;
2. a few ``torch.cuda`` functions (:data:`CUDA_FUNCTIONS`) replaced by CPU equivalents: ``current_device``
   returns 0, ``synchronize`` and ``empty_cache`` do nothing, ``get_rng_state``/``set_rng_state`` use the
   CPU generator, ``current_stream`` (megatron-core >= 0.19) is a stream whose waits do nothing.

Nothing in megatron-core itself is modified. ``tests/mcore_compat/test_cuda_on_cpu.py`` scans the installed
megatron-core for every ``torch.cuda.<name>`` it uses in the modules we run and fails when an upgrade adds
one this module does not know (handled here, harmless on CPU, or never reached by our code paths).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaAsCpu", "CUDA_FUNCTIONS", "enable_cpu_compat", "cpu_compat_active", "needs_cpu_compat"]


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    return False


def _device_arg(dev):
    """A device argument as megatron passes it: ``"cuda"``, ``torch.device("cuda")`` or an int (cuda index)."""
    if _is_cuda_device(dev) or (isinstance(dev, int) and not isinstance(dev, bool)):
        return torch.device("cpu")
    return dev


class CudaAsCpu(TorchFunctionMode):
    """Runs code written for CUDA on the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _device_arg(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_arg(args[1]), *args[2:])
        return func(*args, **kwargs)


def _to_arg(a):
    # Tensor.to(device) / Tensor.to(int) with a CUDA device; a dtype or a tensor passes unchanged
    if _is_cuda_device(a) or (isinstance(a, int) and not isinstance(a, bool)):
        return torch.device("cpu")
    return a


def _noop(*_args, **_kwargs) -> None:
    return None


def _current_device() -> torch.device:
    # megatron passes this as ``device=``. A TorchFunctionMode is thread-local state that autograd does not
    # carry into backward, so tensors created in a backward pass (e.g. the column layer's reduce-scatter
    # buffer) would see a raw 0 (= cuda:0); the CPU device itself works with or without the mode.
    return torch.device("cpu")


def _get_rng_state(device="cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
    torch.set_rng_state(new_state)


class _CpuStream:
    """What ``torch.cuda.current_stream()`` gives on CPU: a stream whose waits do nothing (CPU ops run in
    order)."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _current_stream(device=None) -> _CpuStream:
    # megatron-core >= 0.19: DDP's start_grad_sync waits on the current stream for CUDA-graph replay events
    # (there are none on CPU) before every gradient reduction
    return _CpuStream()


CUDA_FUNCTIONS: dict[str, object] = {
    "current_device": _current_device,
    "synchronize": _noop,
    "empty_cache": _noop,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "current_stream": _current_stream,
}
"""``torch.cuda`` attributes replaced on CPU (also in ``torch.cuda.random`` where it defines them)."""

_mode: CudaAsCpu | None = None


def needs_cpu_compat() -> bool:
    return not torch.cuda.is_available()


def cpu_compat_active() -> bool:
    return _mode is not None


def enable_cpu_compat() -> bool:
    """Apply the compatibility layer once per process when no CUDA device exists. Returns whether it is
    active. On a CUDA machine this does nothing (megatron-core runs as written)."""
    global _mode
    if _mode is not None:
        return True
    if not needs_cpu_compat():
        return False
    for name, fn in CUDA_FUNCTIONS.items():
        setattr(torch.cuda, name, fn)
        if hasattr(torch.cuda.random, name):
            setattr(torch.cuda.random, name, fn)
    _mode = CudaAsCpu()
    _mode.__enter__()  # stays active for the life of the process
    return True


@contextlib.contextmanager
def cpu_compat():
    """``with cpu_compat():`` — the same, scoped (for tests that want it only around one block)."""
    active = enable_cpu_compat()
    yield active

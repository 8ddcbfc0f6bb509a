"""Which aten operators launch a GPU kernel: one list for everything that counts kernel launches with a
``TorchDispatchMode`` (``scripts/launch_inventory.py``, ``scripts/op_census.py``, the tests that assert a launch
count). A dispatch mode sees operators below autograd by overload-packet name (``func.overloadpacket.__name__``);
views, reshapes, allocations, metadata queries and the host read of a scalar launch none."""

from __future__ import annotations

import re

from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = re.compile(
    r"^(view|_unsafe_view|as_strided|empty\w*|new_empty\w*|t|transpose|permute|slice|select|unsqueeze|squeeze"
    r"|expand|reshape|detach|alias|split\w*|unflatten|narrow|unbind|_reshape_alias|set_|is_\w+|size|stride"
    r"|_local_scalar_dense|result_type|record_stream|diagonal|view_as|unfold|lift_fresh|_to_copy_noop"
    r"|_has_compatible_shallow_copy_type|sym_\w+)$"
)


def launches_kernel(op: str) -> bool:
    """Whether the aten operator named ``op`` (an overload packet's name) launches a kernel on the GPU."""
    return not NO_KERNEL.match(op)


class AtenOps(TorchDispatchMode):
    """Records the name of every aten operator issued under it (``ops``, below autograd); ``kernels`` are those
    that launch a kernel (:func:`launches_kernel`), less the names in ``ignore`` (e.g. the Triton interpreter's
    ``copy_`` of a kernel's arguments, which a CUDA launch does not issue)."""

    def __init__(self, ignore: frozenset[str] = frozenset()):
        super().__init__()
        self.ops: list[str] = []
        self.ignore = ignore

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self) -> list[str]:
        return [op for op in self.ops if launches_kernel(op) and op not in self.ignore]

"""Running our Triton kernels on CPU, through Triton's interpreter.

Call `use_interpreter_without_cuda()` at the top of a kernel test module, before anything imports
triton: without CUDA it sets TRITON_INTERPRET=1 (read when kernels are decorated) and fixes one
interpreter incompatibility (below); with CUDA it does nothing and the kernels compile natively.
Returns whether the interpreter is in use. Skips the module if triton is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch


def use_interpreter_without_cuda() -> bool:
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if getattr(original, "_pdserve_patched", False):
        return True

    def patched(tensor, scope):
        original(tensor, scope)
        # The interpreter holds scalars as 1-element arrays and converts them with int(array), which
        # NumPy >= 2.4 refuses for ndim > 0 (a loop bound read from memory, `range(lo, hi)`, fails).
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pdserve_patched = True
    interp._patch_lang_tensor = patched
    return True

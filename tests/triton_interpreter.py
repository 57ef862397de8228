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
    interp.np = _numpy_with_total_nanarg()
    return True


def _numpy_with_total_nanarg():
    """NumPy as the interpreter sees it, with nanargmax/nanargmin defined on all-NaN slices.

    Newer interpreters (triton >= 3.7) reduce `tl.max(..., return_indices=True)` with
    np.nanargmax, which raises on a slice that is all NaN or NaN and -inf, where the compiled kernel
    returns an index. Our kernels must not hang on such rows (a NaN row of logits), so the tests feed
    them; the NaNs are ranked lowest, as the index the kernel may return is any in-range one.
    """
    import types

    import numpy

    def total(arg):
        def reduce(a, axis=None, out=None, *, keepdims=numpy._NoValue):
            a = numpy.asarray(a)
            if numpy.issubdtype(a.dtype, numpy.floating):
                fill = -numpy.inf if arg is numpy.argmax else numpy.inf
                a = numpy.where(numpy.isnan(a), fill, a)
            kw = {} if keepdims is numpy._NoValue else {"keepdims": keepdims}
            return arg(a, axis=axis, out=out, **kw)

        return reduce

    shim = types.ModuleType("numpy_for_triton_interpreter")
    shim.__getattr__ = lambda name: getattr(numpy, name)  # PEP 562 module __getattr__
    shim.nanargmax = total(numpy.argmax)
    shim.nanargmin = total(numpy.argmin)
    return shim

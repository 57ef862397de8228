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
    interp._convert_float = _exact_fp8_conversions(interp._convert_float, interp.tl)
    interp.InterpreterBuilder.create_dot = _bf16_dot(interp.InterpreterBuilder.create_dot, interp)
    return True


def _bf16_dot(create_dot, interp):
    """The interpreter holds bfloat16 as uint16 bit patterns and matmuls those as integers; widen
    bfloat16 operands to float32 first (exact), as the tensor cores do."""
    import numpy as np

    tl = interp.tl

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            a, b = (interp.TensorHandle(interp._convert_float(t.data, tl.bfloat16, tl.float32, None).view(np.float32),
                                        tl.float32) if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    return dot


def _exact_fp8_conversions(convert, tl):
    """The interpreter's float -> float8e4nv conversion drops the carry of a rounded-up mantissa (126 ->
    64 instead of 128) and rounds half away from zero, and its float32 -> bfloat16 truncates; the GPU's
    cvt.rn.satfinite.e4m3x2 and cvt.rn.bf16.f32 round to nearest even, as torch does. Conversions to and
    from e4m3, and float32 -> bfloat16, go through torch here; the rest as before."""
    import numpy as np

    widths = {tl.float32: (torch.float32, np.float32), tl.bfloat16: (torch.bfloat16, np.uint16),
              tl.float16: (torch.float16, np.float16)}

    def exact(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            src = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return src.to(torch.bfloat16).view(torch.uint16).numpy()
        if tl.float8e4nv not in (input_dtype, output_dtype) or not {input_dtype, output_dtype} - {tl.float8e4nv} <= set(
                widths):
            return convert(data, input_dtype, output_dtype, rounding_mode)
        if input_dtype == tl.float8e4nv:
            src = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy()).view(torch.float8_e4m3fn)
            out = src.to(widths[output_dtype][0])
            return out.view(torch.uint16).numpy() if output_dtype == tl.bfloat16 else out.numpy()
        arr = np.ascontiguousarray(data)
        src = torch.from_numpy(arr.view(np.uint16).copy()).view(torch.bfloat16) if input_dtype == tl.bfloat16 \
            else torch.from_numpy(arr.copy())
        return src.to(torch.float8_e4m3fn).view(torch.uint8).numpy()

    return exact


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

"""Operator performance models: how long an operator takes at shapes never traced.

Following the DLRM performance model (Lin et al., 2022; ``shared/seeds/002``), operators are
grouped into families and each family gets a model from input shapes to duration on one device:

- a heuristic roofline for the regular ones (GEMM-like, convolution, element-wise, normalisation,
  attention): ``t = overhead + max(FLOPs / (peak * e_compute), bytes / (bandwidth * e_memory))``,
  with the device's peak compute and memory bandwidth measured by the microbenchmark sweep
  (``collectors/microbench.py``) and the overhead and the two efficiencies fitted per operator
  (per family where an operator has too few samples) by least squares in log space, so a 5 us
  operator weighs as much as a 5 ms one. GEMMs and convolutions, which move their operands
  before computing on them, add the two terms instead of taking their max. Normalisations,
  reductions, pooling, batched GEMMs and PyTorch's own convolution kernel add
  ``loops * per_loop``: their kernels restart a loop per row, channel, image plane, matrix or
  image, and a layer norm over rows of 32 values spends as long starting rows as reading them;
- then, in every family, gradient-boosted trees (LightGBM) learn the roofline's residual
  ``log(measured / roofline)`` from the shapes: what FLOPs and bytes do not say (a GEMM with a
  narrow side, a batch norm over 1 x 1 images, a working set larger than the last-level cache,
  an embedding's index pattern). They are kept where they beat the roofline on training samples
  they were not fitted on (each quarter predicted from the other three; on a few noisy samples
  trees learn the noise).
  Learning the residual rather than the duration keeps the roofline's scaling outside the
  shapes the trees saw, where trees alone would predict a constant.

Shapes are what the PyTorch profiler records with ``record_shapes=True`` (Kineto's ``Input
Dims`` and ``Input type``): per positional input a tensor's shape, ``[]`` for a scalar or a
missing tensor, a list of shapes for a tensor list. Its ``Concrete Inputs`` (torch 2.1 on) add
the scalar arguments, here ``args``: a convolution's stride, padding and which gradients its
backward computes, the dimensions a sum or mean reduces. Without them (older traces),
convolutions are taken as stride 1 with "same" padding and reductions as over every dimension.

One operator can run different kernels by its arguments, and a roofline fitted across them
fits neither: a sum along rows reads memory in order, one down columns adds whole rows at a
time, and a batch norm over 1 x 1 images runs PyTorch's channels-last kernel, which has no
per-channel loop (models fitted across both kernels predicted such a batch norm up to 3 times
its time, and its backward down to a quarter of it); a convolution runs oneDNN's kernel or, on
small inputs and 1 x 1 kernels, PyTorch's own, an image at a time. So each operator's calls are
split by kernel path (:func:`kernel_path`), and each path gets a roofline of its own.

Samples come from the microbenchmark sweep and from the durations already in CPU traces (the
outermost operator of each family on the stack, its inclusive CPU time); the repeated calls of
one shape are one sample at their median. A fifth of each family's shapes is held out of the
fit and kept in the models file, so ``whatif perfmodel report`` measures every family's
geometric-mean absolute error on shapes the fit never saw. Fitting each of the five fifths in
turn (``bench/perfmodel_accuracy.py``) predicts every shape once unseen: an estimate that does
not hang on which fifth was drawn (one family's error moved from 6 to 18 % with the draw).

A models file is JSON (the trees as LightGBM's text format, no pickle) and names the device it
was measured on; loading one measured elsewhere warns (:class:`DeviceMismatchWarning`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd

FORMAT = "whatif-perfmodels"
VERSION = 6  # 6: convolutions split by PyTorch's backend, their memory time added; embeddings' distinct rows; 5: scalar arguments, rooflines per kernel path; 4: a roofline may add compute and memory (GEMM); 3: matmul folds one-sided batch dimensions
FOLDS = 5  # a fifth of the shapes held out; the five folds of a cross-validation
_MIN_OP_SAMPLES = 4  # fewer than this and an operator shares its family's roofline
# Families whose kernels move their operands before computing on them, so that memory time adds
# to compute time rather than hiding under it. A CPU GEMM packs its weight into panels first: a
# [32, 2048] x [2048, 2048] product took 0.61 to 0.64 of the [64, 2048] one in the wide MLP's
# profiled steps, while compute bounds it at 0.5 and max(compute, memory) predicted 0.54.
# A CPU convolution does the same: oneDNN reorders a plain NCHW input and the weight into its
# blocked layout and the output back, PyTorch's own kernel unfolds every image into columns
# (im2col), and only then do they compute. On the 7120-shape sweep of bench/out, adding lowered
# the convolutions' held-out error from 11.0 to 8.5 % (from 13.9 to 12.7 % without the split
# by backend of :func:`_conv_backend`).
_ADDITIVE_FAMILIES = frozenset({"gemm", "conv"})

FAMILY_OPS: dict[str, tuple[str, ...]] = {
    "gemm": ("aten::linear", "aten::matmul", "aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm"),
    "conv": (
        "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution", "aten::_convolution",
        "aten::mkldnn_convolution", "aten::convolution_backward",
    ),
    "elementwise": (
        "aten::relu", "aten::relu_", "aten::clamp_min", "aten::clamp_min_", "aten::threshold_backward",
        "aten::gelu", "aten::gelu_backward", "aten::silu", "aten::silu_backward", "aten::sigmoid",
        "aten::sigmoid_backward", "aten::tanh", "aten::tanh_backward", "aten::add", "aten::add_",
        "aten::sub", "aten::sub_", "aten::mul", "aten::mul_", "aten::div", "aten::div_", "aten::neg",
        "aten::exp", "aten::sqrt", "aten::rsqrt", "aten::pow", "aten::clone", "aten::copy_",
        "aten::contiguous", "aten::fill_", "aten::zero_", "aten::zeros_like", "aten::ones_like",
        "aten::masked_fill", "aten::masked_fill_", "aten::where", "aten::cat", "aten::stack",
        "aten::dropout", "aten::native_dropout", "aten::native_dropout_backward", "aten::to",
        "aten::_to_copy",
    ),
    "norm": (
        "aten::batch_norm", "aten::_batch_norm_impl_index", "aten::native_batch_norm",
        "aten::_native_batch_norm_legit", "aten::native_batch_norm_backward", "aten::layer_norm",
        "aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::group_norm",
        "aten::native_group_norm", "aten::native_group_norm_backward",
    ),
    "reduction": (
        "aten::sum", "aten::mean", "aten::amax", "aten::max", "aten::softmax", "aten::_softmax",
        "aten::log_softmax", "aten::_log_softmax", "aten::_softmax_backward_data",
        "aten::_log_softmax_backward_data", "aten::cross_entropy_loss", "aten::nll_loss_nd",
        "aten::nll_loss", "aten::nll_loss_forward", "aten::nll_loss_backward", "aten::mse_loss",
        "aten::mse_loss_backward",
    ),
    "pooling": (
        "aten::max_pool2d", "aten::max_pool2d_with_indices", "aten::max_pool2d_with_indices_backward",
        "aten::avg_pool2d", "aten::avg_pool2d_backward", "aten::adaptive_avg_pool2d",
        "aten::_adaptive_avg_pool2d", "aten::_adaptive_avg_pool2d_backward",
    ),
    "embedding": (
        "aten::embedding", "aten::index_select", "aten::embedding_backward",
        "aten::embedding_dense_backward", "aten::embedding_bag", "aten::_embedding_bag",
        "aten::_embedding_bag_backward", "aten::_embedding_bag_dense_backward",
    ),
    "attention": (
        "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    ),
}
FAMILY_OF: dict[str, str] = {op: family for family, ops in FAMILY_OPS.items() for op in ops}

#: Operators that only make a new view of their input: their time does not depend on its size.
VIEW_OPS = frozenset(
    "aten::" + name
    for name in (
        "view", "reshape", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided",
        "select", "slice", "narrow", "unsqueeze", "squeeze", "flatten", "detach", "unbind",
        "split", "split_with_sizes", "chunk", "alias", "_reshape_alias", "numpy_T", "unflatten",
        "view_as", "expand_as", "resolve_conj", "resolve_neg", "lift_fresh", "empty", "empty_like",
        "empty_strided", "resize_", "as_strided_", "set_",
    )
)

_ELEMENT_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::complex<float>": 8,
}


class PerfModelError(Exception):
    """A models file, or a sample, that cannot be used; the message names the file and field."""


class DeviceMismatchWarning(UserWarning):
    """The models were measured on another device than the one they are used for."""


# -- shapes -> work --------------------------------------------------------------------------

def parse_shapes(dims, types) -> list:
    """Per positional input: a tensor's shape (tuple of ints), a list of shapes (tensor list), or
    None (a scalar, a missing optional tensor, a list of ints), with the element size in bytes."""
    inputs = []
    types = list(types) if types is not None else []
    for i, d in enumerate(dims):
        kind = types[i] if i < len(types) else ""
        size = _ELEMENT_BYTES.get(kind, 4)
        if isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            inputs.append(([tuple(int(v) for v in x) for x in d], size))
        elif isinstance(d, list) and d and all(isinstance(x, (int, float)) for x in d) and kind not in ("ScalarList", ""):
            inputs.append((tuple(int(v) for v in d), size))
        elif isinstance(d, list) and not d and kind in _ELEMENT_BYTES:
            inputs.append(((), size))  # a 0-d tensor
        else:
            inputs.append(None)
    return inputs


def parse_args(args) -> list:
    """Per positional input, the value of a scalar argument as Kineto's ``Concrete Inputs``
    writes it (``'[1, 1]'``, ``'True'``, ``'1e-05'``): an int, float, bool or list of them;
    None for a tensor, an absent argument, or one that is not a number (a string, a dtype)."""
    values = []
    for text in args or ():
        text = str(text).strip()
        try:
            value = json.loads(text.replace("True", "true").replace("False", "false")) if text else None
        except ValueError:
            value = None
        ok = isinstance(value, (int, float)) or (isinstance(value, list) and all(isinstance(v, (int, float)) for v in value))
        values.append(value if ok else None)
    return values


def _arg(args: list, i: int, default):
    """Argument ``i`` (a list for list arguments), or ``default`` where it was not recorded."""
    value = args[i] if i < len(args) else None
    if value is None:
        return default
    if isinstance(default, list) and not isinstance(value, list):
        return [value] * len(default)
    return value


def _numel(shape) -> int:
    if shape and isinstance(shape[0], tuple):
        return sum(_numel(s) for s in shape)
    return int(np.prod(shape, dtype=np.float64)) if shape else 1


def _tensor(inputs, i):
    return inputs[i][0] if i < len(inputs) and inputs[i] is not None else None


def _bytes_in(inputs) -> float:
    return float(sum(_numel(x[0]) * x[1] for x in inputs if x is not None))


def _element_size(inputs) -> int:
    return next((x[1] for x in inputs if x is not None), 4)


def _last_dim(tensors) -> int:
    shapes = [x[0] for x in tensors if x[0] and not isinstance(x[0][0], tuple)]
    return shapes[0][-1] if shapes else 1


def _gemm(op: str, inputs, args: list) -> tuple[float, float, float, list]:
    e = _element_size(inputs)
    if op == "aten::linear":
        x, w = _tensor(inputs, 0), _tensor(inputs, 1)
        batch, m, k, n = 1, _numel(x[:-1]), x[-1], w[0]
    elif op in ("aten::mm", "aten::addmm"):
        a, b = (_tensor(inputs, 1), _tensor(inputs, 2)) if op == "aten::addmm" else (_tensor(inputs, 0), _tensor(inputs, 1))
        batch, m, k, n = 1, a[0], a[1], b[1]
    elif op in ("aten::bmm", "aten::baddbmm"):
        a, b = (_tensor(inputs, 1), _tensor(inputs, 2)) if op == "aten::baddbmm" else (_tensor(inputs, 0), _tensor(inputs, 1))
        batch, m, k, n = a[0], a[1], a[2], b[2]
    else:  # matmul: broadcast batch dimensions, vectors as 1-row or 1-column matrices
        a, b = _tensor(inputs, 0), _tensor(inputs, 1)
        m, k = (a[-2], a[-1]) if len(a) >= 2 else (1, a[0])
        n = b[-1] if len(b) >= 2 else 1
        batch = max(_numel(a[:-2]), _numel(b[:-2]))
        # where only one side has batch dimensions, matmul folds them into one tall GEMM
        if len(b) <= 2:
            m, batch = m * batch, 1
        elif len(a) <= 2:
            n, batch = n * batch, 1
    flops = 2.0 * batch * m * n * k
    params = [batch, m, k, n, min(m, k, n), _alignment(k), _alignment(n)]
    # a batched GEMM runs one small GEMM per matrix, each paying its own set-up
    loops = float(batch) if batch > 1 else 0.0
    return flops, float(e * (batch * m * k + batch * k * n + batch * m * n)), loops, params


# Where each convolution operator records its stride, padding, dilation and groups (Concrete
# Inputs); conv1d, conv2d and conv3d at (3, 4, 5, 6)
_CONV_ARGS = {
    "aten::convolution_backward": (4, 5, 6, 9),
    "aten::mkldnn_convolution": (4, 3, 5, 6),
    "aten::convolution": (3, 4, 5, 8),
    "aten::_convolution": (3, 4, 5, 8),
}


def _conv_operands(op: str, inputs) -> tuple:
    """A convolution's input and weight shapes (a backward's follow its output gradient)."""
    first = 1 if op == "aten::convolution_backward" else 0
    return _tensor(inputs, first), _tensor(inputs, first + 1)


def _conv(op: str, inputs, args: list, native: bool) -> tuple[float, float, float, list]:
    """``native``: PyTorch's own kernel (:func:`_conv_backend`), which runs one image at a time."""
    e = _element_size(inputs)
    loops = float(_tensor(inputs, 0)[0]) if native else 0.0
    x, w = _conv_operands(op, inputs)
    at_stride, at_padding, at_dilation, _ = _CONV_ARGS.get(op, (3, 4, 5, 6))
    if op == "aten::convolution_backward":
        grad = _tensor(inputs, 0)
        out_pixels = _numel(grad[2:])
        # the first layer's backward computes no input gradient: half the work
        wanted = _arg(args, 10, [True, True, False])
        gradients = int(bool(wanted[0])) + int(bool(wanted[1]))
        flops = gradients * 2.0 * grad[0] * w[0] * out_pixels * _numel(w[1:])
        stride = _arg(args, at_stride, [1])[0]
        params = _conv_params(grad[0], x[1], w[0], out_pixels, _numel(w[2:]), stride, gradients)
        return flops, float(gradients * e * (_numel(grad) + _numel(x) + _numel(w))), loops, params
    spatial, kernel = list(x[2:]), list(w[2:])
    stride = _arg(args, at_stride, [1] * len(spatial))
    padding = _arg(args, at_padding, [k // 2 for k in kernel])  # unrecorded: "same"
    dilation = _arg(args, at_dilation, [1] * len(spatial))
    out = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in zip(spatial, kernel, stride, padding, dilation)]
    out_pixels = _numel(tuple(max(o, 1) for o in out))
    flops = 2.0 * x[0] * w[0] * out_pixels * _numel(w[1:])  # w[1] is the channels of one group
    params = _conv_params(x[0], x[1], w[0], out_pixels, _numel(kernel), stride[0] if stride else 1, 1)
    return flops, float(e * (_numel(x) + _numel(w) + x[0] * w[0] * out_pixels)), loops, params


def _conv_backend(op: str, inputs, args: list, threads: int) -> str:
    """Which kernel PyTorch runs a CPU convolution with: oneDNN's, or its own ``slow_conv2d``
    ("native": an im2col and a GEMM per image), by the rule of ``ConvParams::use_mkldnn`` (torch
    2.x): single precision goes to oneDNN unless the kernel is 1 x 1, unstrided and undilated
    with a batch under 16 on one thread, or the batch is one image of at most 20480 values with
    a kernel no wider than 3 in one ungrouped convolution. Half and bfloat16 always go to
    oneDNN, double never. The two cost differently at the same work: fitted as one roofline,
    the native calls were predicted with 29 % error against 12 % for the rest."""
    x, w = _conv_operands(op, inputs)
    e = _element_size(inputs)
    if e != 4:
        return "native" if e == 8 else ""
    spatial = len(x) - 2
    at_stride, _, at_dilation, at_groups = _CONV_ARGS.get(op, (3, 4, 5, 6))
    stride = _arg(args, at_stride, [1] * spatial)
    dilation = _arg(args, at_dilation, [1] * spatial)
    groups = _arg(args, at_groups, 1)
    kh, kw = ([1, 1] + list(w[2:]))[-2:]  # a 1-d convolution runs as a 2-d one of height 1
    batch = x[0]
    one_by_one = kh == 1 and kw == 1
    # "for 1x1 filters, MKLDNN is faster than THNN when multi-threaded" (PyTorch's comment)
    not_a_plain_1x1 = (any(v != 1 for v in stride) or any(v != 1 for v in dilation) or batch >= 16
                       or not one_by_one or threads > 1)
    large_enough = groups > 1 or (kh > 3 and kw > 3) or batch > 1 or _numel(x[:4]) > 20480
    return "" if not_a_plain_1x1 and large_enough else "native"


def _alignment(size: int) -> int:
    """How many of the low bits of a dimension are zero, up to 4: SIMD kernels run full
    vectors only on multiples of 8 or 16 floats."""
    size = int(size)
    return min((size & -size).bit_length() - 1, 4) if size > 0 else 0


def _conv_params(batch, channels, filters, pixels, kernel, stride, gradients) -> list:
    """A convolution's sizes, those of the GEMM it lowers to (rows, depth), its stride and how
    many gradients a backward computes."""
    return [batch, channels, filters, pixels, kernel, batch * pixels, channels * kernel, _alignment(channels),
            _alignment(filters), stride, gradients]


def _elementwise(op: str, inputs, args: list) -> tuple[float, float, float, list]:
    tensors = [x for x in inputs if x is not None]
    if op in ("aten::cat", "aten::stack"):
        out = sum(_numel(x[0]) for x in tensors)
    else:
        out = max((_numel(x[0]) for x in tensors), default=1)
    last = _last_dim(tensors)
    return float(out), _bytes_in(inputs) + out * _element_size(inputs), 0.0, [out, len(tensors), last]


def _norm(op: str, inputs, args: list) -> tuple[float, float, float, list]:
    x = _tensor(inputs, 0) or ()
    n = _numel(x)
    e = _element_size(inputs)
    passes = 3 if op.endswith("_backward") else 2
    # batch norm loops over channels (over images where it runs channels-last), layer and group
    # norm over rows of the normalised size
    if "batch_norm" in op and len(x) > 1:
        loops = x[0] if _norm_path(op, x) else x[1]
    else:
        loops = n / x[-1] if x and x[-1] else 1
    params = [x[0] if x else 1, x[1] if len(x) > 1 else 1, n, x[-1] if x else 1, loops, n / max(loops, 1)]
    return 8.0 * n, float(passes * n * e + _bytes_in(inputs[1:])), float(loops), params


def _norm_path(op: str, x) -> str:
    """PyTorch's CPU batch norm takes an input whose images are 1 x 1 (or a [N, C] one) as
    channels-last, and runs a kernel vectorised across channels instead of one per channel."""
    return "channels_last" if "batch_norm" in op and len(x) > 1 and _numel(x[2:]) == 1 else ""


def _norm_kernel(op: str, inputs, args: list) -> str:
    return _norm_path(op, _tensor(inputs, 0) or ())


_DIM_REDUCTIONS = frozenset({"aten::sum", "aten::mean", "aten::amax", "aten::max"})


def _reduction(op: str, inputs, args: list) -> tuple[float, float, float, list]:
    if op in _DIM_REDUCTIONS:
        x = _tensor(inputs, 0) or ()
        outer, reduced, inner = _reduced_split(x, args)
        # along rows: one loop per row; down columns: one vector pass over the inner
        # elements per reduced index
        loops = outer if inner == 1 else outer * reduced
        n = _numel(x)
        written = outer * inner * _element_size(inputs)
        return float(n), _bytes_in(inputs) + written, float(loops), [n, outer, reduced, inner, loops]
    largest = max((x[0] for x in inputs if x is not None and x[0] and not isinstance(x[0][0], tuple)), key=_numel, default=())
    n = _numel(largest)
    first, last = (largest[0], largest[-1]) if largest else (1, 1)
    rows = n / last if last else 1
    # a softmax or loss pays per row (its maximum, sum and logarithm) as well as per element
    params = [n, first, last, rows, n / max(first, 1)]
    return float(n + 32 * rows), _bytes_in(inputs), float(rows), params


def _reduced_split(x, args: list) -> tuple[int, int, int]:
    """A sum, mean or max over some dimensions of ``x``, as (outer, reduced, inner) element
    counts: the dimensions before the first reduced one, the reduced ones, those after the
    last (every dimension where the call names none)."""
    dims = _arg(args, 1, [])
    dims = sorted({d % len(x) for d in dims}) if x and dims else list(range(len(x)))
    if not dims:
        return 1, 1, 1
    reduced = _numel(tuple(x[d] for d in dims))
    inner = _numel(tuple(x[dims[-1] + 1:]))
    return max(_numel(tuple(x)) // max(reduced * inner, 1), 1), reduced, inner


def _reduction_path(op: str, inputs, args: list) -> str:
    if op not in _DIM_REDUCTIONS:
        return ""
    _, _, inner = _reduced_split(_tensor(inputs, 0) or (), args)
    return "rows" if inner == 1 else "columns"


def _pooling(op: str, inputs, args: list) -> tuple[float, float, float, list]:
    x = _tensor(inputs, 0) or ()
    n = _numel(x)
    planes = _numel(x[:2]) if len(x) >= 2 else 1  # one loop per image and channel
    params = (list(x) + [1, 1, 1, 1])[:4] + [planes, n / max(planes, 1)]
    return float(n), _bytes_in(inputs) + n * _element_size(inputs) / 4.0, float(planes), params


def _embedding(op: str, inputs, args: list) -> tuple[float, float, float, list]:
    """Rows gathered from a table, each added into its bag or copied out. The memory moved is
    the distinct rows read (a row drawn again is read from cache: of ``n`` draws from ``T``
    rows, ``T (1 - exp(-n / T))`` on average are distinct), the output written (one row per
    bag for a bag), and for the dense backward the table-sized gradient it zeroes before adding
    rows into it. Counted as twice the rows gathered, the roofline was off by 28 % on the
    sweep's held-out shapes; counted so, by 19 %."""
    e = 4
    if op in ("aten::embedding", "aten::embedding_bag", "aten::_embedding_bag"):
        w, idx = _tensor(inputs, 0), _tensor(inputs, 1)
        rows, width, table = _numel(idx), w[-1], w[0]
        bags = _tensor(inputs, 2) if op != "aten::embedding" else None
        written, zeroed = (_numel(bags) if bags else rows), 0
    elif op == "aten::index_select":
        w, idx = _tensor(inputs, 0), _tensor(inputs, 2)
        rows, width, table = _numel(idx), w[-1], w[0]
        written, zeroed = rows, 0
    else:  # backward: gradient rows added into the weight's gradient, of the table's size
        grad, idx = _tensor(inputs, 0), _tensor(inputs, 1)
        rows, width = _numel(idx), grad[-1]
        table = int(_arg(args, 2, 0))  # num_weights; 0 where it was not recorded
        written, zeroed = rows, table
    distinct = table * -math.expm1(-rows / table) if table else rows
    moved = (distinct + written + zeroed) * width * e + 8 * rows
    return float(rows * width), float(moved), 0.0, [rows, width, table, distinct, table * width]


def _attention(op: str, inputs, args: list) -> tuple[float, float, float, list]:
    q, k = _tensor(inputs, 0), _tensor(inputs, 1)
    if op.endswith("_backward"):
        q, k = _tensor(inputs, 1), _tensor(inputs, 2)
    batch_heads, length, depth, keys = _numel(q[:-2]), q[-2], q[-1], k[-2]
    flops = 4.0 * batch_heads * length * keys * depth
    bytes_ = _bytes_in(inputs) + batch_heads * length * depth * 4
    params = [batch_heads, length, keys, depth]
    return (2.5 * flops, 2 * bytes_, 0.0, params) if op.endswith("_backward") else (flops, bytes_, 0.0, params)


_WORK = {
    "gemm": _gemm, "elementwise": _elementwise, "norm": _norm, "reduction": _reduction,
    "pooling": _pooling, "embedding": _embedding, "attention": _attention,
}
# Families whose operators run one of several kernels by their shapes or arguments: which one.
_PATHS = {"norm": _norm_kernel, "reduction": _reduction_path}


def work(op: str, dims, types, args=(), threads: int = 1) -> tuple[float, float, float]:
    """FLOPs, bytes moved and inner loops run by ``op`` on inputs of these recorded shapes and
    scalar arguments (the loops: rows, channels or image planes that a normalisation, reduction
    or pooling kernel starts afresh, the matrices of a batched GEMM, each at a cost of its own;
    the images of a convolution that PyTorch's own kernel runs one by one; 0 for the other
    families and plain GEMMs); NaNs when the shapes are not those the family expects (a missing
    tensor, a vector where a matrix goes). ``threads``: torch's intra-op threads, by which
    PyTorch chooses a convolution's kernel."""
    return _work(op, dims, types, args, threads)[:3]


def kernel_path(op: str, dims, types, args=(), threads: int = 1) -> str:
    """The operator, and the kernel it runs where its arguments choose between kernels of
    different cost (``aten::sum/columns``, ``aten::conv2d/native``): the unit a roofline is
    fitted for."""
    return _work(op, dims, types, args, threads)[4]


def _work(op: str, dims, types, args=(), threads: int = 1) -> tuple[float, float, float, list, str]:
    """:func:`work`, the family's shape parameters (GEMM: batch, M, K, N; convolution: N, C,
    O, output pixels, kernel area; ...), the sizes its efficiency depends on, and
    :func:`kernel_path`: one reading of the recorded call for all three."""
    family = FAMILY_OF.get(op)
    if family is None:
        raise KeyError(op)
    try:
        inputs, parsed = parse_shapes(dims, types), parse_args(args)
        if family == "conv":  # its kernel, and so its loops, also depend on the thread count
            path = _conv_backend(op, inputs, parsed, threads)
            flops, bytes_, loops, params = _conv(op, inputs, parsed, native=path == "native")
        else:
            flops, bytes_, loops, params = _WORK[family](op, inputs, parsed)
            path = _PATHS[family](op, inputs, parsed) if family in _PATHS else ""
    except (TypeError, IndexError, ValueError, ZeroDivisionError):
        return math.nan, math.nan, math.nan, [], op
    return max(flops, 1.0), max(bytes_, 1.0), float(loops), params, f"{op}/{path}" if path else op


_PARAMS = 11  # shape parameters the trees see (padded)


def _features(path_code: int, flops: float, bytes_: float, params: list) -> list[float]:
    """What the trees see: the operator's kernel path, its work, and its family's shape
    parameters (:func:`_work`'s)."""
    padded = (list(params) + [0] * _PARAMS)[:_PARAMS]
    return [float(path_code), math.log2(flops + 1), math.log2(bytes_ + 1)] + [math.log2(float(v) + 1) for v in padded]


# -- the models ------------------------------------------------------------------------------

@dataclass
class Roofline:
    """``overhead + max(compute, memory) + loops x per_loop``: the roof, plus what each inner
    loop costs to start (a layer norm over rows of 32 spends as long starting rows as reading
    them). ``additive``: ``compute + memory`` instead of their max, for work that moves its
    operands before computing on them (:data:`_ADDITIVE_FAMILIES`)."""

    overhead_us: float
    compute_efficiency: float
    memory_efficiency: float
    samples: int = 0
    per_loop_us: float = 0.0
    additive: bool = False

    def predict_us(self, flops: np.ndarray, bytes_: np.ndarray, loops: np.ndarray, peak_flops_per_us: float,
                   bytes_per_us: float) -> np.ndarray:
        compute = flops / (peak_flops_per_us * self.compute_efficiency)
        memory = bytes_ / (bytes_per_us * self.memory_efficiency)
        both = compute + memory if self.additive else np.maximum(compute, memory)
        return self.overhead_us + both + loops * self.per_loop_us


@dataclass
class FamilyModel:
    name: str
    pooled: Roofline
    ops: dict[str, Roofline] = field(default_factory=dict)  # by kernel path (:func:`kernel_path`)
    op_codes: list[str] = field(default_factory=list)  # the trees' kernel-path feature: index in this list
    trees: Optional[str] = None  # LightGBM model_to_string() of the residual, None: roofline only
    _booster: object = field(default=None, repr=False, compare=False)

    @property
    def kind(self) -> str:
        return "roofline+gbt" if self.trees else "roofline"

    def booster(self):
        if self._booster is None and self.trees:
            import lightgbm

            self._booster = lightgbm.Booster(model_str=self.trees)
        return self._booster


@dataclass
class PerfModels:
    """Per-family models on one device, with the samples held out of their fit."""

    device: dict
    families: dict[str, FamilyModel]
    held_out: pd.DataFrame  # op, dims, types, args, duration_us, source
    sources: list = field(default_factory=list)
    created: str = ""

    @property
    def threads(self) -> int:
        """Torch's intra-op threads on the device measured: PyTorch picks convolution kernels by it."""
        return int(self.device.get("threads", 1))

    @property
    def peak_flops_per_us(self) -> float:
        return float(self.device["peak_gflops"]) * 1e3

    @property
    def bytes_per_us(self) -> float:
        return float(self.device["bandwidth_gbps"]) * 1e3

    def covers(self, op: str) -> bool:
        return FAMILY_OF.get(op) in self.families

    def predict_us(self, ops: Sequence[str], dims: Sequence, types: Sequence, args: Optional[Sequence] = None,
                   learned: bool = True) -> np.ndarray:
        """Predicted durations; NaN where the operator's family has no model or its shapes do not
        fit it. ``args``: per call its recorded scalar arguments (``Concrete Inputs``), if any."""
        args = list(args) if args is not None else [()] * len(ops)
        out = np.full(len(ops), np.nan)
        frame = pd.DataFrame({"op": list(ops), "family": [FAMILY_OF.get(o) for o in ops]})
        for family, rows in frame.groupby("family", sort=False):
            model = self.families.get(family)
            if model is None:
                continue
            idx = rows.index.to_numpy()
            done = [_work(ops[i], dims[i], types[i], args[i], self.threads) for i in idx]
            flops, bytes_, loops = np.array([d[:3] for d in done], dtype=float).reshape(-1, 3).T
            keys = [d[4] for d in done]
            roof = np.empty(len(idx))
            for key, positions in pd.Series(range(len(idx)), index=keys).groupby(level=0):
                line = model.ops.get(key) or model.ops.get(key.split("/")[0], model.pooled)
                p = positions.to_numpy()
                roof[p] = line.predict_us(flops[p], bytes_[p], loops[p], self.peak_flops_per_us, self.bytes_per_us)
            if learned and model.trees:
                codes = [model.op_codes.index(k) if k in model.op_codes else -1 for k in keys]
                features = np.array([_features(c, *d[:2], d[3]) for c, d in zip(codes, done)])
                finite = np.isfinite(roof)
                if finite.any():
                    roof[finite] = roof[finite] * np.exp(model.booster().predict(features[finite]))
            out[idx] = roof
        return out

    # -- files ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "device": self.device,
            "sources": list(self.sources),
            "families": {
                name: {
                    "kind": m.kind,
                    "pooled": _roofline_doc(m.pooled),
                    "ops": {op: _roofline_doc(r) for op, r in m.ops.items()},
                    "op_codes": list(m.op_codes),
                    "trees": m.trees,
                }
                for name, m in self.families.items()
            },
            "held_out": {
                "op": self.held_out["op"].tolist(),
                "dims": self.held_out["dims"].tolist(),
                "types": self.held_out["types"].tolist(),
                "args": self.held_out["args"].tolist(),
                "duration_us": [round(float(v), 3) for v in self.held_out["duration_us"]],
                "source": self.held_out["source"].tolist(),
            },
        }

    def save(self, path: Union[str, Path]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)


def _roofline_doc(r: Roofline) -> dict:
    return {
        "overhead_us": r.overhead_us,
        "compute_efficiency": r.compute_efficiency,
        "memory_efficiency": r.memory_efficiency,
        "per_loop_us": r.per_loop_us,
        "additive": r.additive,
        "samples": r.samples,
    }


def load_models(path: Union[str, Path], check_device: bool = True) -> PerfModels:
    """Read a models file; raises :class:`PerfModelError` naming the file and the bad field, and
    warns with :class:`DeviceMismatchWarning` when it was measured on another device."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PerfModelError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PerfModelError(f"{path}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
    except json.JSONDecodeError as err:
        raise PerfModelError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    reader = _Reader(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PerfModelError(f"{path}: field 'format' is not {FORMAT!r}: not a whatif performance models file")
    if doc.get("version") != VERSION:
        raise PerfModelError(f"{path}: field 'version' is {doc.get('version')!r}; this whatif reads version {VERSION}")
    device = reader.mapping(doc, "device")
    for key in ("type", "name"):
        reader.text(device, key, f"device.{key}")
    for key in ("peak_gflops", "bandwidth_gbps"):
        reader.positive(device, key, f"device.{key}")
    families = {}
    for name, fdoc in reader.mapping(doc, "families").items():
        where = f"families.{name}"
        if name not in FAMILY_OPS:
            raise PerfModelError(f"{path}: field '{where}' is not a known family ({', '.join(FAMILY_OPS)})")
        fdoc = reader.mapping({name: fdoc}, name, where)
        ops = {op: reader.roofline(r, f"{where}.ops.{op}") for op, r in reader.mapping(fdoc, "ops", f"{where}.ops").items()}
        trees = fdoc.get("trees")
        if trees is not None and not isinstance(trees, str):
            raise PerfModelError(f"{path}: field '{where}.trees' must be LightGBM's model text or null")
        codes = fdoc.get("op_codes", [])
        if not isinstance(codes, list) or not all(isinstance(c, str) for c in codes):
            raise PerfModelError(f"{path}: field '{where}.op_codes' must be a list of operator names")
        families[name] = FamilyModel(name, reader.roofline(fdoc.get("pooled"), f"{where}.pooled"), ops, codes, trees)
    held = reader.mapping(doc, "held_out")
    columns = {}
    for key in ("op", "dims", "types", "args", "duration_us", "source"):
        value = held.get(key)
        if not isinstance(value, list):
            raise PerfModelError(f"{path}: field 'held_out.{key}' must be a list")
        columns[key] = value
    if len({len(v) for v in columns.values()}) > 1:
        raise PerfModelError(f"{path}: the lists in field 'held_out' differ in length")
    models = PerfModels(device, families, pd.DataFrame(columns), list(doc.get("sources", [])), str(doc.get("created", "")))
    if check_device:
        mismatch = device_mismatch(models.device)
        if mismatch:
            warnings.warn(f"{path}: {mismatch}", DeviceMismatchWarning, stacklevel=2)
    return models


class _Reader:
    """Field checks that name the file and the field, for one-line errors."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str):
        raise PerfModelError(f"{self.path}: field '{where}' {problem}")

    def mapping(self, doc: dict, key: str, where: Optional[str] = None) -> dict:
        value = doc.get(key) if isinstance(doc, dict) else None
        if not isinstance(value, dict):
            self.fail(where or key, "is missing or not an object")
        return value

    def text(self, doc: dict, key: str, where: str) -> str:
        if not isinstance(doc.get(key), str):
            self.fail(where, "is missing or not a string")
        return doc[key]

    def positive(self, doc: dict, key: str, where: str) -> float:
        return self._number(doc, key, where, "a positive number", lambda value: value > 0)

    def non_negative(self, doc: dict, key: str, where: str) -> float:
        return self._number(doc, key, where, "a non-negative number", lambda value: value >= 0)

    def _number(self, doc: dict, key: str, where: str, wanted: str, fits) -> float:
        value = doc.get(key) if isinstance(doc, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not fits(value):
            self.fail(where, f"must be {wanted}, not {value!r}")
        return float(value)

    def roofline(self, doc, where: str) -> Roofline:
        if not isinstance(doc, dict):
            self.fail(where, "is missing or not an object")
        return Roofline(
            self.non_negative(doc, "overhead_us", f"{where}.overhead_us"),
            self.positive(doc, "compute_efficiency", f"{where}.compute_efficiency"),
            self.positive(doc, "memory_efficiency", f"{where}.memory_efficiency"),
            int(doc.get("samples", 0) or 0),
            self.non_negative(doc, "per_loop_us", f"{where}.per_loop_us"),
            self.flag(doc, "additive", f"{where}.additive"),
        )

    def flag(self, doc: dict, key: str, where: str) -> bool:
        if not isinstance(doc.get(key), bool):
            self.fail(where, f"must be true or false, not {doc.get(key)!r}")
        return doc[key]


def current_device() -> dict:
    """The device at hand, as a models file names it (the sweep runs on the CPU)."""
    from whatif.collectors.capture import cpu_model

    return {"type": "cpu", "name": cpu_model()}


def device_mismatch(device: dict) -> Optional[str]:
    """Why models measured on ``device`` do not describe this machine, or None when they do."""
    here = current_device()
    if (here["type"], here["name"]) != (device.get("type"), device.get("name")):
        return (
            f"the models were measured on {device.get('type')} {device.get('name')!r}, not on this "
            f"machine's {here['name']!r}; refit them here with `whatif perfmodel fit`"
        )
    return None


def cache_dir() -> Path:
    """Where fitted models are cached: $WHATIF_CACHE_DIR, else $XDG_CACHE_HOME/whatif or ~/.cache/whatif."""
    if os.environ.get("WHATIF_CACHE_DIR"):
        return Path(os.environ["WHATIF_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "whatif"


def default_models(progress=None) -> PerfModels:
    """This machine's models from the quick sweep, fitted once (a few seconds) and then cached.

    The cache is keyed by the device and by the code that measures and fits (a hash of this
    module and the sweep's): models cached by an older whatif, whose features differ, are
    refitted rather than fed features they were not trained on."""
    device = current_device()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device["name"]).strip("-").lower() or "cpu"
    path = cache_dir() / f"perfmodels-quick-{slug}-{_code_fingerprint()}.json"
    if path.is_file():
        return load_models(path)
    try:
        from whatif.collectors.microbench import run_sweep

        samples, measured = run_sweep(quick=True)
    except ImportError as err:
        raise PerfModelError(
            f"no operator models given (--perfmodel) and none cached in {path.parent}; fitting them needs torch ({err})"
        ) from None
    models = fit_models(samples, measured, sources=["sweep quick"])
    models.save(path)
    if progress:
        progress(f"fitted operator models on the quick sweep; cached in {path}")
    return models


def _code_fingerprint() -> str:
    from whatif.collectors import microbench

    digest = hashlib.sha1()
    for source in (__file__, microbench.__file__):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]


# -- samples from traces --------------------------------------------------------------------

def operator_units(trace) -> pd.DataFrame:
    """The outermost operator of a modelled family on every CPU stack: the unit a model times.

    Columns: row (the event's row in ``trace.events``), unit (the row of the outermost modelled
    operator around or at it, -1 for none), op, dims, types, args (decoded ``Input Dims`` /
    ``Input type`` / ``Concrete Inputs``). One row per CPU event; a unit's inclusive time holds its dispatch and the helper
    operators it calls, as a microbenchmark of the same call does.
    """
    from whatif.collectors.kineto import EventKind

    ev = trace.events
    cpu = ev[ev["kind"].isin([int(EventKind.CPU_OP), int(EventKind.ANNOTATION), int(EventKind.PYTHON)])]
    order = cpu.assign(neg_dur=-cpu["dur_us"]).sort_values(["thread", "ts_us", "neg_dur"], kind="stable")
    rows = order.index.to_numpy()
    names = order["name"].astype(str).to_numpy()
    threads = order["thread"].astype(str).to_numpy()
    starts = order["ts_us"].to_numpy()
    ends = (order["ts_us"] + order["dur_us"]).to_numpy()
    unit = np.full(len(rows), -1, dtype=np.int64)
    parent = np.full(len(rows), -1, dtype=np.int64)
    stack: list[int] = []
    thread = None
    for i in range(len(rows)):
        if threads[i] != thread:
            stack, thread = [], threads[i]
        while stack and ends[stack[-1]] <= starts[i] + 1e-6:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
            unit[i] = unit[stack[-1]]
        if unit[i] < 0 and names[i] in FAMILY_OF:
            unit[i] = i
        stack.append(i)
    dims = [_decode(trace.input_dims.get(r)) for r in rows]
    types = [_decode(trace.input_types.get(r)) for r in rows]
    args = [_decode(trace.concrete_inputs.get(r)) for r in rows]
    return pd.DataFrame(
        {
            "row": rows,
            "unit": np.where(unit >= 0, rows[np.maximum(unit, 0)], -1),
            "parent": np.where(parent >= 0, rows[np.maximum(parent, 0)], -1),
            "op": names,
            "dims": dims,
            "types": types,
            "args": args,
            "dur_us": order["dur_us"].to_numpy(),
        }
    )


def _decode(raw) -> list:
    if raw is None or not len(raw):
        return []
    value = json.loads(bytes(raw))
    return value if isinstance(value, list) else []


def trace_samples(path: Union[str, Path]) -> pd.DataFrame:
    """Every modelled unit of a CPU-only trace with its shapes and inclusive CPU time."""
    from whatif.collectors.kineto import TraceError
    from whatif.collectors.load import load_trace

    trace = load_trace(path)
    if trace.has_gpu:
        raise TraceError(path, "has GPU kernels: fitting from a GPU trace's operator times is not supported (its CPU times are launch overhead)")
    units = operator_units(trace)
    own = units[(units["unit"] == units["row"]) & units["dims"].map(bool)]
    return pd.DataFrame(
        {
            "op": own["op"].to_numpy(),
            "dims": own["dims"].tolist(),
            "types": own["types"].tolist(),
            "args": own["args"].tolist(),
            "duration_us": own["dur_us"].to_numpy(),
            "source": f"trace {Path(path).name}",
        }
    )


# -- fitting ---------------------------------------------------------------------------------

def fit_models(samples: pd.DataFrame, device: dict, sources: Iterable[str] = (), seed: int = 0,
               fold: int = 0) -> PerfModels:
    """Fit every family present in ``samples`` (op, dims, types, duration_us, source, and args
    where the calls' scalar arguments were recorded), holding a
    fifth of each family's shapes out: the ``fold``-th of :data:`FOLDS` random fifths, so that
    fitting every fold predicts every shape once unseen (a cross-validation). ``device``
    carries the measured ``peak_gflops`` and ``bandwidth_gbps`` the rooflines are drawn
    against."""
    samples = samples[samples["op"].isin(FAMILY_OF) & (samples["duration_us"] > 0)]
    samples = _one_per_shape(samples.assign(args=_args_of(samples)))
    threads = int(device.get("threads", 1))
    done = [_work(*call, threads) for call in zip(samples["op"], samples["dims"], samples["types"], samples["args"])]
    flops, bytes_, loops = np.array([d[:3] for d in done], dtype=float).reshape(-1, 3).T
    samples = samples.assign(flops=flops, bytes=bytes_, loops=loops, params=[d[3] for d in done],
                             path=[d[4] for d in done], family=samples["op"].map(FAMILY_OF))
    samples = samples[np.isfinite(samples["flops"])].reset_index(drop=True)
    rng = np.random.default_rng(seed)
    held = np.zeros(len(samples), dtype=bool)
    for _, rows in samples.groupby("family", sort=True):
        shapes = rows["shape"].unique()
        if len(shapes) >= FOLDS:
            picked = shapes[rng.permutation(len(shapes)) % FOLDS == fold]
            held[rows.index[rows["shape"].isin(picked)]] = True
    peak = float(device["peak_gflops"]) * 1e3
    bandwidth = float(device["bandwidth_gbps"]) * 1e3
    families = {}
    train = samples[~held]
    for name, rows in train.groupby("family", sort=True):
        families[name] = _fit_family(name, rows, peak, bandwidth, seed)
    kept = samples[held][["op", "dims", "types", "args", "duration_us", "source"]].reset_index(drop=True)
    return PerfModels(
        device=dict(device),
        families=families,
        held_out=kept,
        sources=list(sources),
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def _one_per_shape(samples: pd.DataFrame) -> pd.DataFrame:
    """One sample per shape and source, timed at the median of its calls, with the shape's key.

    A trace calls a layer's operators at the same shapes every step, and a random sweep can draw
    a shape twice: these are repeated timings of one shape. As separate samples they would weigh
    a shape by how often it was called, and the held-out check could hold out one call of a
    shape whose other calls were fitted; so the check holds out shapes, with all their sources.
    The median, because a trace's calls of one shape vary up to a hundredfold (page faults,
    the profiler's own work), and a shape's model is of its typical call."""
    grouped = samples.assign(shape=shape_keys(samples)).groupby(["shape", "source"], sort=False)
    return grouped.first().reset_index().assign(duration_us=grouped["duration_us"].median().to_numpy())


def shape_keys(samples: pd.DataFrame) -> pd.Series:
    """One string per sample naming its operator, input shapes and types, and scalar arguments
    where recorded: samples with the same key time the same call."""
    keys = [json.dumps([op, dims, types] + ([a] if a else []))
            for op, dims, types, a in zip(samples["op"], samples["dims"], samples["types"], _args_of(samples))]
    return pd.Series(keys, index=samples.index, dtype=object)


def _args_of(samples: pd.DataFrame) -> list:
    """Every sample's ``args`` list: empty where none was recorded (a sweep or trace from before
    they were, alone or concatenated with one from after)."""
    args = samples["args"] if "args" in samples else [None] * len(samples)
    return [list(a) if isinstance(a, (list, tuple)) else [] for a in args]


def _fit_family(name: str, rows: pd.DataFrame, peak: float, bandwidth: float, seed: int) -> FamilyModel:
    additive = name in _ADDITIVE_FAMILIES
    pooled = _fit_roofline(rows, peak, bandwidth, additive)
    ops = {
        key: _fit_roofline(group, peak, bandwidth, additive)
        for key, group in rows.groupby("path", sort=True)
        if len(group) >= _MIN_OP_SAMPLES
    }
    model = FamilyModel(name, pooled, ops)
    roof = np.array([
        ops.get(key, pooled).predict_us(np.array([f]), np.array([b]), np.array([n]), peak, bandwidth)[0]
        for key, f, b, n in zip(rows["path"], rows["flops"], rows["bytes"], rows["loops"])
    ])
    measured = rows["duration_us"].to_numpy()
    residual = np.log(measured) - np.log(roof)
    if len(rows) >= 8:
        codes = sorted(rows["path"].unique())
        features = np.array([
            _features(codes.index(key), f, b, p) for key, f, b, p in zip(rows["path"], rows["flops"], rows["bytes"], rows["params"])
        ])
        if _trees_help(features, measured, roof, residual, seed):
            model.op_codes = codes
            model.trees = _fit_trees(features, residual, seed)
    return model


def _trees_help(features: np.ndarray, measured: np.ndarray, roof: np.ndarray, residual: np.ndarray, seed: int) -> bool:
    """Whether trees beat the roofline alone on training samples they were not fitted on (each
    quarter predicted by trees fitted on the other three): on a noisy sweep they can learn the
    noise instead of the shapes. A single quarter is too few shapes to decide on: in one
    family it kept or dropped the trees depending on the seed, at 10 against 16 % held-out error."""
    import lightgbm

    quarter = np.random.default_rng(seed + 1).permutation(len(measured)) % 4
    learned = np.empty(len(measured))
    for part in range(4):
        check = quarter == part
        trees = lightgbm.Booster(model_str=_fit_trees(features[~check], residual[~check], seed))
        learned[check] = roof[check] * np.exp(trees.predict(features[check]))
    return geomean_abs_error(learned, measured) < geomean_abs_error(roof, measured)


def _fit_roofline(rows: pd.DataFrame, peak: float, bandwidth: float, additive: bool = False) -> Roofline:
    """Overhead, efficiencies and (where the family runs loops) the cost per loop minimising the
    squared log error (robust to a few noisy samples)."""
    from scipy.optimize import least_squares

    t = rows["duration_us"].to_numpy(dtype=float)
    flops = rows["flops"].to_numpy(dtype=float)
    bytes_ = rows["bytes"].to_numpy(dtype=float)
    loops = rows["loops"].to_numpy(dtype=float)
    looped = bool((loops > 0).any())

    def residual(theta):
        c, ec, em = np.exp(theta[:3])
        roof = Roofline(c, ec, em, per_loop_us=np.exp(theta[3]) if looped else 0.0, additive=additive)
        return np.log(roof.predict_us(flops, bytes_, loops, peak, bandwidth)) - np.log(t)

    low, high = [1e-3, 1e-5, 1e-5, 1e-7][: 3 + looped], [1e6, 10.0, 10.0, 1e3][: 3 + looped]
    overhead = max(float(np.min(t)) / 2, 0.1)
    # The max() leaves the term that never binds without a gradient, so start from several
    # balances of compute and memory and keep the best fit.
    fits = [
        least_squares(residual, np.log([overhead, ec, em, 1e-3][: 3 + looped]), bounds=(np.log(low), np.log(high)),
                      loss="soft_l1", f_scale=0.1)
        for ec in (0.3, 0.01) for em in (0.3, 0.03)
    ]
    theta = np.exp(min(fits, key=lambda f: f.cost).x)
    return Roofline(float(theta[0]), float(theta[1]), float(theta[2]), len(rows), float(theta[3]) if looped else 0.0, additive)


def _fit_trees(features: np.ndarray, residual: np.ndarray, seed: int) -> str:
    """Trees from :func:`_features` rows to the roofline's log residual, in LightGBM's text format."""
    import lightgbm

    params = {
        "objective": "huber", "alpha": 0.2, "learning_rate": 0.05, "num_leaves": 16,
        "min_data_in_leaf": 2, "min_data_in_bin": 1, "lambda_l2": 1.0, "num_threads": 1,
        "deterministic": True, "force_row_wise": True, "seed": seed, "verbose": -1,
    }
    data = lightgbm.Dataset(features, residual, categorical_feature=[0], params={"verbose": -1})
    booster = lightgbm.train(params, data, num_boost_round=400)
    return booster.model_to_string()


def geomean_abs_error(predicted, measured) -> float:
    """Geometric-mean absolute error: the geometric mean of max(p/m, m/p), minus one.

    The seed paper's GMAE: errors compound multiplicatively, so a 2x over- and a 2x
    under-prediction count alike, and one wild sample does not dominate the mean."""
    p = np.asarray(predicted, dtype=float)
    m = np.asarray(measured, dtype=float)
    ok = np.isfinite(p) & (p > 0) & (m > 0)
    if not ok.any():
        return math.nan
    return float(np.exp(np.mean(np.abs(np.log(p[ok] / m[ok])))) - 1.0)


def held_out_report(*folds: PerfModels) -> pd.DataFrame:
    """Per family: model kind, held-out samples, and their geometric-mean absolute error with the
    roofline alone and with the family's full model; the full model's error also apart on the
    swept and on the traced samples, which time an operator in different conditions (a trace's
    times hold the profiler's share, and inputs that a training step left out of the cache).

    Given several models (the folds of a cross-validation), each held-out sample is predicted by
    the model that did not see it, and the kind is the one most folds chose."""
    predicted = []
    for models in folds:
        held = models.held_out
        calls = held["op"].tolist(), held["dims"].tolist(), held["types"].tolist(), held["args"].tolist()
        family = held["op"].map(FAMILY_OF)
        kinds = {name: model.kind for name, model in models.families.items()}
        predicted.append(held.assign(
            family=family,
            roof=models.predict_us(*calls, learned=False) if len(held) else [],
            full=models.predict_us(*calls) if len(held) else [],
            kind=family.map(kinds).fillna("none"),
        ))
    held = pd.concat(predicted, ignore_index=True)
    rows = []
    if len(held):
        for name in sorted(set(held["family"].dropna())):
            part = held[held["family"] == name]
            measured = part["duration_us"].to_numpy(dtype=float)
            roof, full = part["roof"].to_numpy(dtype=float), part["full"].to_numpy(dtype=float)
            traced = part["source"].str.startswith("trace").to_numpy()
            rows.append({
                "family": name,
                "kind": part["kind"].mode().iloc[0],
                "held_out": len(part),
                "from_traces": int(traced.sum()),
                "roofline_gmae_pct": 100 * geomean_abs_error(roof, measured),
                "gmae_pct": 100 * geomean_abs_error(full, measured),
                "swept_gmae_pct": 100 * geomean_abs_error(full[~traced], measured[~traced]),
                "traced_gmae_pct": 100 * geomean_abs_error(full[traced], measured[traced]),
                "median_abs_error_pct": 100 * float(np.nanmedian(np.abs(full / measured - 1))),
            })
    return pd.DataFrame(rows, columns=["family", "kind", "held_out", "from_traces", "roofline_gmae_pct", "gmae_pct",
                                       "swept_gmae_pct", "traced_gmae_pct", "median_abs_error_pct"])

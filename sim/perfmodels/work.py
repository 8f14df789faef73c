"""The work of an operator call: FLOPs, bytes moved, inner loops, and the kernel it runs.

Per family (:mod:`~whatif.sim.perfmodels.families`), a formula from the recorded shapes and
scalar arguments (:mod:`~whatif.sim.perfmodels.shapes`) to the FLOPs a roofline divides by the
device's peak, the bytes it divides by its bandwidth, and the loops a kernel starts afresh (rows,
channels, image planes, matrices, images), as in the DLRM performance model (Lin et al., 2022;
``shared/seeds/002``); and the shape parameters the trees see beside them.

One operator can run different kernels by its arguments, and a roofline fitted across them
fits neither: a sum along rows reads memory in order, one down columns adds whole rows at a
time, and a batch norm over 1 x 1 images runs PyTorch's channels-last kernel, which has no
per-channel loop (models fitted across both kernels predicted such a batch norm up to 3 times
its time, and its backward down to a quarter of it); a convolution runs oneDNN's kernel or, on
small inputs and 1 x 1 kernels, PyTorch's own, an image at a time. So each operator's calls are
split by kernel path (:func:`kernel_path`), and each path gets a roofline of its own.
"""

from __future__ import annotations

import math

import numpy as np

from .families import FAMILY_OF
from .shapes import parse_args, parse_shapes


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
    return read_call(op, dims, types, args, threads)[:3]


def kernel_path(op: str, dims, types, args=(), threads: int = 1) -> str:
    """The operator, and the kernel it runs where its arguments choose between kernels of
    different cost (``aten::sum/columns``, ``aten::conv2d/native``): the unit a roofline is
    fitted for."""
    return read_call(op, dims, types, args, threads)[4]


def read_call(op: str, dims, types, args=(), threads: int = 1) -> tuple[float, float, float, list, str]:
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

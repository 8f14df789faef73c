"""The calls the microbenchmark sweep times: each swept operator at a random shape, as a trace records it.

Each case is named, shaped and argued exactly as the profiler records the same call (the
outermost ``aten::`` operator and its ``Input Dims``, ``Input type`` and ``Concrete Inputs``),
so the operator models (the DLRM performance model, Lin et al., 2022; ``shared/seeds/002``)
read traces and sweeps alike; :func:`recorded_as` checks that against the profiler itself.
Where an argument chooses the kernel or the work, the sweep draws it too: sums and means along
rows, down columns or across the second dimension, convolutions of stride 2 as well as 1, and
first-layer backward passes that compute no input gradient. Shapes are drawn log-uniformly from
ranges that cover the example models from batch 4 to 256. torch is passed in, or imported by
:func:`recorded_as` when it runs, never on import.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from whatif.collectors.kineto import EventKind
from whatif.collectors.load import load_trace


@dataclass
class Case:
    """One operator at one shape: how to call it, and how the profiler records the call (its
    ``Input Dims``, ``Input type`` and ``Concrete Inputs``: the scalar arguments' values)."""

    op: str
    dims: list
    types: list
    call: Callable[[], object]
    args: list


def _pow2(rng, lo: int, hi: int) -> int:
    return int(2 ** rng.integers(int(math.log2(lo)), int(math.log2(hi)) + 1))


def _log_int(rng, lo: int, hi: int) -> int:
    """Log-uniform in [lo, hi]; mostly a multiple of 16 above 64, as layer widths are."""
    value = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    if value > 64 and rng.random() < 0.7:
        value = max(16, value // 16 * 16)
    return value


def draw_case(torch, op: str, rng) -> Optional[Case]:
    """A random shape for ``op`` and its call; None for ops this sweep does not draw."""
    F = torch.nn.functional
    aten = torch.ops.aten
    rand = torch.rand
    f = "float"

    if op in ("aten::linear", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul"):
        m, k, n = _log_int(rng, 8, 4096), _log_int(rng, 8, 2048), _log_int(rng, 8, 2048)
        if op == "aten::linear":
            lead = [m] if rng.random() < 0.5 else [max(1, m // 64), 64]
            x, w, b = rand(*lead, k), rand(n, k), rand(n)
            return Case(op, [lead + [k], [n, k], [n]], [f, f, f], lambda: F.linear(x, w, b), ["", "", ""])
        if op == "aten::addmm":
            bias, a, b = rand(n), rand(m, k), rand(k, n)
            return Case(op, [[n], [m, k], [k, n], [], []], [f, f, f, "Scalar", "Scalar"], lambda: torch.addmm(bias, a, b), ["", "", "", "1", "1"])
        if op == "aten::mm":
            a, b = rand(m, k), rand(k, n)
            return Case(op, [[m, k], [k, n]], [f, f], lambda: torch.mm(a, b), ["", ""])
        batch = _log_int(rng, 2, 64)
        m, k, n = max(1, m // batch), max(1, k // 4), max(1, n // 4)
        if op == "aten::bmm":
            a, b = rand(batch, m, k), rand(batch, k, n)
            return Case(op, [[batch, m, k], [batch, k, n]], [f, f], lambda: torch.bmm(a, b), ["", ""])
        a, b = rand(batch, m, k), rand(k, n)
        return Case(op, [[batch, m, k], [k, n]], [f, f], lambda: torch.matmul(a, b), ["", ""])

    if op in ("aten::conv2d", "aten::convolution_backward"):
        n, c, o = _pow2(rng, 1, 128), _pow2(rng, 8, 256) if rng.random() > 0.15 else 3, _pow2(rng, 8, 256)
        hw, k = _pow2(rng, 4, 64), int(rng.choice([1, 3, 3, 5]))
        stride = 2 if hw >= 8 and rng.random() < 0.25 else 1  # a downsampling layer
        pad = k // 2
        out = (hw + 2 * pad - k) // stride + 1
        x, w = rand(n, c, hw, hw), rand(o, c, k, k)
        if op == "aten::conv2d":
            dims = [[n, c, hw, hw], [o, c, k, k], [], [], [], [], []]
            types = [f, f, "", "ScalarList", "ScalarList", "ScalarList", "Scalar"]
            args = ["", "", "", _recorded([stride] * 2), _recorded([pad] * 2), "[1, 1]", "1"]
            return Case(op, dims, types, lambda: F.conv2d(x, w, None, stride, pad), args)
        grad = rand(n, o, out, out)
        # a first layer, on the image's three channels, needs no gradient of its input
        mask = [c != 3, True, False]
        dims = [[n, o, out, out], [n, c, hw, hw], [o, c, k, k], [], [], [], [], [], [], [], []]
        types = [f, f, f, "ScalarList", "ScalarList", "ScalarList", "ScalarList", "Scalar", "ScalarList", "Scalar", "ScalarList"]
        args = ["", "", "", "[0]", _recorded([stride] * 2), _recorded([pad] * 2), "[1, 1]", "False", "[0, 0]", "1",
                _recorded(mask)]
        return Case(op, dims, types, lambda: aten.convolution_backward(
            grad, x, w, [0], [stride, stride], [pad, pad], [1, 1], False, [0, 0], 1, mask), args)

    if op in _ELEMENTWISE_CALLS or op in _NORM_CALLS or op in _REDUCTION_CALLS or op in _POOLING_CALLS:
        shape = _activation_shape(rng)
        table = {**_ELEMENTWISE_CALLS, **_NORM_CALLS, **_REDUCTION_CALLS, **_POOLING_CALLS}
        return table[op](torch, shape, rand, rng)

    if op in ("aten::embedding", "aten::embedding_backward", "aten::embedding_bag"):
        rows, width = _log_int(rng, 64, 65536), _pow2(rng, 16, 512)
        batch, length = _pow2(rng, 1, 128), _pow2(rng, 1, 128)
        idx = torch.randint(0, rows, (batch, length))
        if op == "aten::embedding":
            w = rand(rows, width)
            return Case(op, [[rows, width], [batch, length], [], [], []], [f, "long int", "Scalar", "Scalar", "Scalar"],
                        lambda: F.embedding(idx, w), ["", "", "-1", "False", "False"])
        if op == "aten::embedding_bag":
            w = rand(rows, width)
            flat = idx.reshape(-1)
            offsets = torch.arange(0, batch * length, length)
            dims = [[rows, width], [batch * length], [batch], [], [], [], [], [], []]
            types = [f, "long int", "long int", "Scalar", "Scalar", "Scalar", "", "Scalar", ""]
            return Case(op, dims, types, lambda: F.embedding_bag(flat, w, offsets, mode="sum"),
                        ["", "", "", "False", "0", "False", "", "False", ""])
        rows = 1024  # the table's size is not recorded: the sweep keeps it fixed
        idx = torch.randint(0, rows, (batch, length))
        grad = rand(batch, length, width)
        dims = [[batch, length, width], [batch, length], [], [], [], []]
        types = [f, "long int", "Scalar", "Scalar", "Scalar", "Scalar"]
        return Case(op, dims, types, lambda: aten.embedding_backward(grad, idx, rows, -1, False, False),
                    ["", "", str(rows), "-1", "False", "False"])

    if op in ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"):
        batch, heads, length, depth = _pow2(rng, 1, 64), _pow2(rng, 1, 16), _pow2(rng, 16, 512), _pow2(rng, 16, 128)
        q, k, v = rand(batch, heads, length, depth), rand(batch, heads, length, depth), rand(batch, heads, length, depth)
        shape = [batch, heads, length, depth]
        if op == "aten::scaled_dot_product_attention":
            dims = [shape, shape, shape, [], [], [], [], []]
            types = [f, f, f, "", "Scalar", "Scalar", "", "Scalar"]
            return Case(op, dims, types, lambda: F.scaled_dot_product_attention(q, k, v), ["", "", "", "", "0.", "False", "", "False"])
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        grad = rand(*shape)
        dims = [shape, shape, shape, shape, shape, [batch, heads, length], [], [], [], []]
        types = [f, f, f, f, f, f, "Scalar", "Scalar", "", ""]
        return Case(op, dims, types, lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, False), ["", "", "", "", "", "", "0.", "False", "", ""])
    return None


def _recorded(values: list) -> str:
    """A list argument as the profiler's ``Concrete Inputs`` writes it: ``[2, 2]``, ``[False, True]``."""
    return "[" + ", ".join(map(str, values)) + "]"


def _activation_shape(rng) -> list:
    """An activation as the example models have them: images NCHW, tokens NLD, or rows NF."""
    kind = rng.random()
    if kind < 0.45:
        return [_pow2(rng, 1, 128), _pow2(rng, 3, 256), *([_pow2(rng, 2, 64)] * 2)]
    if kind < 0.75:
        return [_pow2(rng, 1, 64), _pow2(rng, 8, 256), _pow2(rng, 16, 2048)]
    return [_pow2(rng, 1, 512), _log_int(rng, 2, 8192)]


def _unary(op, fn):
    def case(torch, shape, rand, rng):
        x = rand(*shape)
        return Case(op, [shape], ["float"], lambda: fn(torch, x), [""])
    return case


def _binary(op, fn, scalar_arg=None):
    """A call on two tensors and an alpha of 1; or, given how the profiler writes its scalar
    argument (``'2.'``, ``''`` for an unrecorded one), on one tensor and that scalar."""
    def case(torch, shape, rand, rng):
        x, y = rand(*shape), rand(*shape)
        if scalar_arg is not None:
            return Case(op, [shape, []], ["float", "Scalar"], lambda: fn(torch, x, 2.0), ["", scalar_arg])
        return Case(op, [shape, shape, []], ["float", "float", "Scalar"], lambda: fn(torch, x, y), ["", "", "1"])
    return case


def _mul_case(op, fn):
    def case(torch, shape, rand, rng):
        x, y = rand(*shape), rand(*shape)
        return Case(op, [shape, shape], ["float", "float"], lambda: fn(torch, x, y), ["", ""])
    return case


def _threshold_backward(torch, shape, rand, rng):
    g, x = rand(*shape), rand(*shape) - 0.5
    return Case("aten::threshold_backward", [shape, shape, []], ["float", "float", "Scalar"],
                lambda: torch.ops.aten.threshold_backward(g, x, 0.0), ["", "", "0."])


def _gelu_backward(torch, shape, rand, rng):
    g, x = rand(*shape), rand(*shape)
    return Case("aten::gelu_backward", [shape, shape, []], ["float", "float", "c10::string_view"],
                lambda: torch.ops.aten.gelu_backward(g, x), ["", "", ""])


def _copy(torch, shape, rand, rng):
    dst, src = rand(*shape), rand(*shape)
    return Case("aten::copy_", [shape, shape, []], ["float", "float", "Scalar"], lambda: dst.copy_(src), ["", "", "False"])


def _cat(torch, shape, rand, rng):
    parts = [rand(*shape) for _ in range(2)]
    return Case("aten::cat", [[shape, shape], []], ["TensorList", "Scalar"], lambda: torch.cat(parts), ["", "0"])


def _as_images(shape) -> list:
    """An activation as the NCHW tensor batch norm sees, with more than one value per channel."""
    if len(shape) != 4:
        shape = [shape[0], shape[1], 1, 1] if len(shape) == 2 else [shape[0], shape[1], shape[2], 1]
    return [max(shape[0], 2), *shape[1:]]


def _batch_norm(torch, shape, rand, rng):
    shape = _as_images(shape)
    x, c = rand(*shape), shape[1]
    mean, var, w, b = torch.zeros(c), torch.ones(c), rand(c), rand(c)
    dims = [shape, [c], [c], [c], [c], [], [], [], []]
    types = ["float"] * 5 + ["Scalar"] * 4
    return Case("aten::batch_norm", dims, types,
                lambda: torch.nn.functional.batch_norm(x, mean, var, w, b, training=True),
                ["", "", "", "", "", "True", "0.10000000000000001", "1.0000000000000001e-05", "True"])


def _batch_norm_backward(torch, shape, rand, rng):
    shape = _as_images(shape)
    x, g, c = rand(*shape), rand(*shape), shape[1]
    w, rm, rv, sm, si = rand(c), torch.zeros(c), torch.ones(c), rand(c), rand(c)
    dims = [shape, shape, [c], [c], [c], [c], [c], [], [], []]
    types = ["float"] * 7 + ["Scalar", "Scalar", "ScalarList"]
    return Case("aten::native_batch_norm_backward", dims, types,
                lambda: torch.ops.aten.native_batch_norm_backward(g, x, w, rm, rv, sm, si, True, 1e-5, [True, True, True]),
                ["", "", "", "", "", "", "", "True", "1.0000000000000001e-05", "[True, True, True]"])


def _tokens(shape) -> list:
    """An activation as the (batch, tokens, features) tensor a layer norm sees."""
    if len(shape) == 4:
        return [shape[0], shape[2] * shape[3], max(shape[1], 32)]
    return [shape[0], max(shape[-1], 32)] if len(shape) == 2 else [shape[0], shape[1], max(shape[2], 32)]


def _layer_norm(torch, shape, rand, rng):
    shape = _tokens(shape)
    d = shape[-1]
    x, w, b = rand(*shape), rand(d), rand(d)
    return Case("aten::layer_norm", [shape, [], [d], [d], [], []], ["float", "ScalarList", "float", "float", "Scalar", "Scalar"],
                lambda: torch.nn.functional.layer_norm(x, (d,), w, b), ["", _recorded([d]), "", "", "1.0000000000000001e-05", "True"])


def _layer_norm_backward(torch, shape, rand, rng):
    shape = _tokens(shape)
    d = shape[-1]
    x, g, w, b = rand(*shape), rand(*shape), rand(d), rand(d)
    stats = shape[:-1] + [1]
    mean, rstd = rand(*stats), rand(*stats)
    dims = [shape, shape, [], stats, stats, [d], [d], []]
    types = ["float", "float", "ScalarList", "float", "float", "float", "float", "ScalarList"]
    return Case("aten::native_layer_norm_backward", dims, types,
                lambda: torch.ops.aten.native_layer_norm_backward(g, x, [d], mean, rstd, w, b, [True, True, True]),
                ["", "", _recorded([d]), "", "", "", "", "[True, True, True]"])


def _rows(shape) -> list:
    """An activation as the (rows, classes) matrix a loss or softmax sees."""
    return [int(np.prod(shape[:-1])), shape[-1]] if len(shape) > 2 else list(shape)


def _reduce(op, fn):
    """A sum or mean along the rows (the last dimension, or an image's two), down the columns
    (the first) or across the second: PyTorch runs a different kernel for each."""
    def case(torch, shape, rand, rng):
        x = rand(*shape)
        choices = [[-1], [0], [1]] + ([[-1, -2]] if len(shape) == 4 else [])
        dims = choices[int(rng.integers(len(choices)))]
        return Case(op, [shape, [], [], []], ["float", "ScalarList", "Scalar", ""], lambda: fn(torch, x, dims),
                    ["", _recorded(dims), "False", ""])
    return case


def _log_softmax(torch, shape, rand, rng):
    shape = _rows(shape)
    x = rand(*shape)
    return Case("aten::log_softmax", [shape, [], []], ["float", "Scalar", ""],
                lambda: torch.nn.functional.log_softmax(x, dim=1), ["", "1", ""])


def _log_softmax_backward(torch, shape, rand, rng):
    shape = _rows(shape)
    g, out = rand(*shape), rand(*shape)
    return Case("aten::_log_softmax_backward_data", [shape, shape, [], []], ["float", "float", "Scalar", "Scalar"],
                lambda: torch.ops.aten._log_softmax_backward_data(g, out, 1, torch.float32), ["", "", "1", "6"])


def _cross_entropy(torch, shape, rand, rng):
    shape = _rows(shape)
    x = rand(*shape)
    y = torch.randint(0, shape[1], (shape[0],))
    return Case("aten::cross_entropy_loss", [shape, [shape[0]], [], [], [], []],
                ["float", "long int", "", "Scalar", "Scalar", "Scalar"],
                lambda: torch.nn.functional.cross_entropy(x, y), ["", "", "", "1", "-100", "0."])


def _nll_loss_backward(torch, shape, rand, rng):
    shape = _rows(shape)
    x, g, total = rand(*shape), torch.tensor(1.0), torch.tensor(float(shape[0]))
    y = torch.randint(0, shape[1], (shape[0],))
    return Case("aten::nll_loss_backward", [[], shape, [shape[0]], [], [], [], []],
                ["float", "float", "long int", "", "Scalar", "Scalar", "float"],
                lambda: torch.ops.aten.nll_loss_backward(g, x, y, None, 1, -100, total), ["", "", "", "", "1", "-100", ""])


def _images(shape) -> list:
    if len(shape) == 4:
        return shape
    return [shape[0], shape[1], 2, 2] if len(shape) == 2 else [shape[0], shape[1], 2, shape[2] // 2 * 2 or 2]


def _max_pool(torch, shape, rand, rng):
    shape = _images(shape)
    x = rand(*shape)
    return Case("aten::max_pool2d", [shape, [], [], [], [], []], ["float", "ScalarList", "ScalarList", "ScalarList", "ScalarList", "Scalar"],
                lambda: torch.nn.functional.max_pool2d(x, 2), ["", "[2, 2]", "[]", "[0, 0]", "[1, 1]", "False"])


def _max_pool_backward(torch, shape, rand, rng):
    shape = _images(shape)
    x = rand(*shape)
    out, idx = torch.ops.aten.max_pool2d_with_indices(x, [2, 2])
    g = rand(*out.shape)
    half = list(out.shape)
    dims = [half, shape, [], [], [], [], [], half]
    types = ["float", "float", "ScalarList", "ScalarList", "ScalarList", "ScalarList", "Scalar", "long int"]
    return Case("aten::max_pool2d_with_indices_backward", dims, types,
                lambda: torch.ops.aten.max_pool2d_with_indices_backward(g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx),
                ["", "", "[2, 2]", "[2, 2]", "[0, 0]", "[1, 1]", "False", ""])


def _adaptive_avg_pool(torch, shape, rand, rng):
    shape = _images(shape)
    x = rand(*shape)
    return Case("aten::adaptive_avg_pool2d", [shape, []], ["float", "ScalarList"],
                lambda: torch.nn.functional.adaptive_avg_pool2d(x, 1), ["", "[1, 1]"])


_ELEMENTWISE_CALLS = {
    "aten::relu_": _unary("aten::relu_", lambda torch, x: torch.relu_(x)),
    "aten::relu": _unary("aten::relu", lambda torch, x: torch.relu(x)),
    "aten::gelu": _binary("aten::gelu", lambda torch, x, s: torch.nn.functional.gelu(x), scalar_arg=""),
    "aten::sigmoid": _unary("aten::sigmoid", lambda torch, x: torch.sigmoid(x)),
    "aten::tanh": _unary("aten::tanh", lambda torch, x: torch.tanh(x)),
    "aten::clone": _binary("aten::clone", lambda torch, x, s: torch.clone(x), scalar_arg=""),
    "aten::fill_": _binary("aten::fill_", lambda torch, x, s: x.fill_(s), scalar_arg="2."),
    "aten::zero_": _unary("aten::zero_", lambda torch, x: x.zero_()),
    "aten::div": _binary("aten::div", lambda torch, x, s: torch.div(x, s), scalar_arg=""),
    "aten::add": _binary("aten::add", lambda torch, x, y: torch.add(x, y)),
    "aten::add_": _binary("aten::add_", lambda torch, x, y: x.add_(y)),
    "aten::mul": _mul_case("aten::mul", lambda torch, x, y: torch.mul(x, y)),
    "aten::mul_": _mul_case("aten::mul_", lambda torch, x, y: x.mul_(y)),
    "aten::threshold_backward": _threshold_backward,
    "aten::gelu_backward": _gelu_backward,
    "aten::copy_": _copy,
    "aten::cat": _cat,
}
_NORM_CALLS = {
    "aten::batch_norm": _batch_norm,
    "aten::native_batch_norm_backward": _batch_norm_backward,
    "aten::layer_norm": _layer_norm,
    "aten::native_layer_norm_backward": _layer_norm_backward,
}
_REDUCTION_CALLS = {
    "aten::sum": _reduce("aten::sum", lambda torch, x, dims: torch.sum(x, dim=dims)),
    "aten::mean": _reduce("aten::mean", lambda torch, x, dims: torch.mean(x, dim=dims)),
    "aten::log_softmax": _log_softmax,
    "aten::_log_softmax_backward_data": _log_softmax_backward,
    "aten::cross_entropy_loss": _cross_entropy,
    "aten::nll_loss_backward": _nll_loss_backward,
}
_POOLING_CALLS = {
    "aten::max_pool2d": _max_pool,
    "aten::max_pool2d_with_indices_backward": _max_pool_backward,
    "aten::adaptive_avg_pool2d": _adaptive_avg_pool,
}

#: Every operator the sweep times, by family.
SWEEP_OPS: dict[str, tuple[str, ...]] = {
    "gemm": ("aten::linear", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul"),
    "conv": ("aten::conv2d", "aten::convolution_backward"),
    "elementwise": tuple(_ELEMENTWISE_CALLS),
    "norm": tuple(_NORM_CALLS),
    "reduction": tuple(_REDUCTION_CALLS),
    "pooling": tuple(_POOLING_CALLS),
    "embedding": ("aten::embedding", "aten::embedding_backward", "aten::embedding_bag"),
    "attention": ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
}


def recorded_as(op: str, seed: int = 0) -> tuple[Case, str, list, list]:
    """One case of ``op`` and what a trace of its call records: the outermost operator's name,
    input dims and scalar arguments, read back through ``collectors/kineto.py`` from an
    exported Chrome trace. The sweep is right when they equal the case's own ``op``, ``dims``
    and ``args``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        case = draw_case(torch, op, np.random.default_rng(seed))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            case.call()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "case.json"
        prof.export_chrome_trace(str(path))
        trace = load_trace(path)
    ops = trace.events[trace.events["kind"] == int(EventKind.CPU_OP)]
    ops = ops[ops["name"].astype(str).str.startswith("aten::")]
    outer = ops.assign(neg=-ops["dur_us"]).sort_values(["ts_us", "neg"]).index[0]
    recorded = [json.loads(bytes(raw.get(outer, b"[]"))) for raw in (trace.input_dims, trace.concrete_inputs)]
    return case, str(trace.events.at[outer, "name"]), *recorded

"""The operator families a performance model is fitted for, as tables.

Following the DLRM performance model (Lin et al., 2022; ``shared/seeds/002``), operators whose
time follows one formula of their work share a family (:data:`FAMILY_OPS`): GEMM-like,
convolution, element-wise, normalisation, reduction, pooling, embedding, attention. An operator
of no family and no view (:data:`VIEW_OPS`) is not modelled.
"""

from __future__ import annotations

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

# Families whose kernels move their operands before computing on them, so that memory time adds
# to compute time rather than hiding under it. A CPU GEMM packs its weight into panels first: a
# [32, 2048] x [2048, 2048] product took 0.61 to 0.64 of the [64, 2048] one in the wide MLP's
# profiled steps, while compute bounds it at 0.5 and max(compute, memory) predicted 0.54.
# A CPU convolution does the same: oneDNN reorders a plain NCHW input and the weight into its
# blocked layout and the output back, PyTorch's own kernel unfolds every image into columns
# (im2col), and only then do they compute. On the 7120-shape sweep of bench/out, adding lowered
# the convolutions' held-out error from 11.0 to 8.5 % (from 13.9 to 12.7 % without the split
# by backend of ``work._conv_backend``).
ADDITIVE_FAMILIES = frozenset({"gemm", "conv"})

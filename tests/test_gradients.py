"""What a training step communicates: the gradients found in a trace (``find_gradients``) and the
messages each data-parallel framework makes of them (``Framework.messages``).

ResNet-50 has 25,557,032 parameters (torchvision); as float32 that is 102,228,128 bytes of
gradients per iteration, which two independent traces record in two different ways: the
per-parameter ``AccumulateGrad`` shapes of the kineto sample and the DDP buckets of the HTA run
(see ../shared/traces/SOURCES.md).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from trace_corpus import A100_DDP2, BUNDLED, DLRM_RANK0, EVENT_SYNC, RESNET18, RESNET50, V100_1GPU
from whatif import GraphError
from whatif.sim.frameworks import FrameworkOptions, framework
from whatif.sim.gradients import ACCUMULATE_GRAD, find_gradients
from whatif.sim.graph import TaskKind
from whatif.sim.workload import first_input_bytes, first_inputs_bytes

RESNET50_PARAMETERS = 25_557_032
RESNET50_GRADIENT_BYTES = 4 * RESNET50_PARAMETERS  # float32: 102.2 MB
RESNET50_PARAMETER_TENSORS = 161  # 53 conv + 53 batch-norm weight/bias pairs + fc weight and bias
DDP_BUCKET_ELEMENTS = [2_049_000, 7_875_584, 6_563_840, 6_637_568, 2_431_040]  # SOURCES.md
MiB = 1024 * 1024

_workers: dict = {}


def worker_graph(traces, name):
    """The graph ``whatif predict`` simulates on every worker: the trace's own communication
    kernels removed (the simulated collectives replace them). Built once per trace."""
    if name not in _workers:
        graph = traces.study(name).graph.copy()
        graph.remove(graph.select(kinds=[TaskKind.COMM]))
        _workers[name] = graph
    return _workers[name]


def gradients_of(traces, name, **given):
    study = traces.study(name)
    return find_gradients(worker_graph(traces, name), study.iterations, **given)


def per_iteration(gradients, iterations: int) -> list[list]:
    return [gradients.of_iteration(i) for i in range(iterations)]


@pytest.fixture(scope="module")
def resnet50_gradients(traces):
    return gradients_of(traces, RESNET50)


# -- find_gradients --------------------------------------------------------------------------------


def test_resnet50_has_one_gradient_per_parameter_tensor_from_accumulate_grad_shapes(traces, resnet50_gradients):
    study = traces.study(RESNET50)
    assert "AccumulateGrad" in resnet50_gradients.source
    for grads in per_iteration(resnet50_gradients, len(study.iterations)):
        assert len(grads) == RESNET50_PARAMETER_TENSORS
        assert sum(g.nbytes for g in grads) == RESNET50_GRADIENT_BYTES
    assert resnet50_gradients.bytes_per_iteration() == RESNET50_GRADIENT_BYTES
    assert round(resnet50_gradients.bytes_per_iteration() / 1e6, 1) == 102.2


def test_resnet50_gradients_come_in_the_order_they_become_ready(traces, resnet50_gradients):
    """Backward runs from the classifier to the stem: the first gradient ready is the fc layer's
    (1000 biases, then 2048 x 1000 weights), each is ready when its AccumulateGrad ends, and the
    list is in that order."""
    study = traces.study(RESNET50)
    tasks = worker_graph(traces, RESNET50).tasks
    for grads in per_iteration(resnet50_gradients, len(study.iterations)):
        assert [g.nbytes for g in grads[:2]] == [4 * 1000, 4 * 2048 * 1000]
        ready_us = tasks["measured_end_us"].to_numpy()[[g.ready_task for g in grads]]
        assert (np.diff(ready_us) >= 0).all()
        assert (tasks["name"].astype(str).to_numpy()[[g.ready_task for g in grads]] == ACCUMULATE_GRAD).all()


def test_resnet50_gradients_lie_inside_their_iteration(traces, resnet50_gradients):
    study = traces.study(RESNET50)
    end_us = worker_graph(traces, RESNET50).tasks["measured_end_us"].to_numpy()
    for i, it in enumerate(study.iterations.itertuples()):
        ready = end_us[[g.ready_task for g in resnet50_gradients.of_iteration(i)]]
        assert (ready > it.start_us).all() and (ready <= it.end_us).all()


def test_every_accumulate_grad_with_a_recorded_shape_gives_a_gradient(traces):
    """DLRM rank 0 records the shape of 15 of its 16 AccumulateGrads (the embedding's sparse
    gradient has none); as float32 they are the gradients of the step."""
    study = traces.study(DLRM_RANK0)
    rows = np.flatnonzero(study.trace.events["name"].to_numpy() == ACCUMULATE_GRAD)
    shapes = [msgspec.json.decode(study.trace.input_dims[r])[0] for r in rows]
    shaped = [s for s in shapes if s]
    assert len(rows) == 16 and len(shaped) == 15
    gradients = gradients_of(traces, DLRM_RANK0)
    assert len(gradients.of_iteration(0)) == len(shaped)
    assert gradients.bytes_per_iteration() == sum(4 * np.prod(s) for s in shaped)


def test_a_ddp_trace_gives_its_buckets_which_add_up_to_resnet50(traces):
    gradients = gradients_of(traces, A100_DDP2)
    assert "DDP" in gradients.source
    for grads in per_iteration(gradients, len(traces.study(A100_DDP2).iterations)):
        assert [g.nbytes / 4 for g in grads] == DDP_BUCKET_ELEMENTS
    assert sum(DDP_BUCKET_ELEMENTS) == RESNET50_PARAMETERS
    assert gradients.bytes_per_iteration() == RESNET50_GRADIENT_BYTES


def test_a_world_size_one_ddp_trace_still_records_its_buckets(traces):
    """The V100 run of the same DDP script with one process still all-reduces its five buckets
    (``record_param_comms`` with ``In msg nelems``, group size 1), so it is not a trace without
    sizes: it gives the same buckets as the two-GPU run."""
    gradients = gradients_of(traces, V100_1GPU)
    assert "DDP" in gradients.source
    for grads in per_iteration(gradients, len(traces.study(V100_1GPU).iterations)):
        assert [g.nbytes / 4 for g in grads] == DDP_BUCKET_ELEMENTS


def test_a_trace_without_sizes_asks_for_them(traces):
    """ResNet-18 recorded without shapes and without DDP: AccumulateGrad operators but no size."""
    study = traces.study(RESNET18)
    assert (study.trace.events["name"] == ACCUMULATE_GRAD).any()
    with pytest.raises(GraphError) as info:
        gradients_of(traces, RESNET18)
    message = str(info.value)
    assert "\n" not in message
    assert "gradients.total" in message and "gradients.sizes" in message
    assert RESNET18.split("/")[-1] in message, "the error names the trace"


def test_a_trace_without_sizes_spreads_a_given_total_over_its_accumulate_grads(traces):
    gradients = gradients_of(traces, RESNET18, total_bytes=50e6)
    assert gradients.bytes_per_iteration() == pytest.approx(50e6)
    assert "total 50.0 MB" in gradients.source and "AccumulateGrad" in gradients.source
    sizes = {g.nbytes for g in gradients.gradients}
    assert len(sizes) == 1, "spread evenly"
    context = worker_graph(traces, RESNET18).tasks["context"].astype(str).to_numpy()
    # the anchor is the AccumulateGrad's last segment, or its child's where the child covers it
    assert all(ACCUMULATE_GRAD in c for c in context[[g.ready_task for g in gradients.gradients]])


def test_a_trace_without_accumulate_grad_places_a_given_total_on_gpu_kernels(traces):
    study = traces.study(EVENT_SYNC)
    assert not (study.trace.events["name"] == ACCUMULATE_GRAD).any()
    with pytest.raises(GraphError):
        gradients_of(traces, EVENT_SYNC)
    gradients = gradients_of(traces, EVENT_SYNC, total_bytes=50e6)
    assert gradients.bytes_per_iteration() == pytest.approx(50e6)
    assert "GPU kernels" in gradients.source and "total 50.0 MB" in gradients.source
    kinds = worker_graph(traces, EVENT_SYNC).tasks["kind"].to_numpy()
    assert (kinds[[g.ready_task for g in gradients.gradients]] == int(TaskKind.KERNEL)).all()


def test_sizes_given_by_the_user_replace_those_of_the_trace(traces):
    sizes = [1e6, 2e6, 3e6]
    gradients = gradients_of(traces, RESNET50, sizes=sizes)
    assert "3 sizes" in gradients.source
    for grads in per_iteration(gradients, len(traces.study(RESNET50).iterations)):
        assert [g.nbytes for g in grads] == sizes


def test_the_bundled_cpu_trace_has_its_gradients_too(traces):
    gradients = gradients_of(traces, BUNDLED)
    assert "AccumulateGrad" in gradients.source
    assert gradients.bytes_per_iteration() > 0


# -- frameworks: the messages of one iteration -------------------------------------------------------


def test_ddp_buckets_hold_every_gradient_once_in_ready_order(resnet50_gradients):
    grads = resnet50_gradients.of_iteration(0)
    buckets = framework("ddp").messages(grads, FrameworkOptions(), sliced=False)
    assert sum(b.nbytes for b in buckets) == RESNET50_GRADIENT_BYTES
    # forward positions count down in ready order: buckets are contiguous runs of the gradients
    assert [p for b in buckets for p in b.layers] == list(range(len(grads) - 1, -1, -1))
    for bucket in buckets:
        held = [g for g in grads if len(grads) - 1 - grads.index(g) in bucket.layers]
        assert all(g.ready_task in bucket.ready_after for g in held), "a bucket waits for all its gradients"
    assert all(b.phase == "allreduce" for b in buckets)


def _pytorch_bucket_rule_holds(buckets, grads, options):
    """PyTorch's Reducer (``compute_bucket_assignment_by_size``) adds gradients to a bucket until
    the bucket reaches its cap (1 MiB for the first, ``bucket_cap_mb`` = 25 MiB after), then
    closes it: every bucket but the last reaches its cap, and is below it without its last
    gradient."""
    size_at = {len(grads) - 1 - i: g.nbytes for i, g in enumerate(grads)}  # by forward position
    for i, bucket in enumerate(buckets[:-1]):
        cap = options.first_bucket_bytes if i == 0 else options.bucket_cap_bytes
        if bucket.nbytes < cap or bucket.nbytes - size_at[bucket.layers[-1]] >= cap:
            return False
    return True


def test_ddp_closes_a_bucket_once_it_reaches_its_cap(resnet50_gradients):
    options = FrameworkOptions()
    grads = resnet50_gradients.of_iteration(0)
    assert _pytorch_bucket_rule_holds(framework("ddp").messages(grads, options, sliced=False), grads, options)


def test_ddp_buckets_of_resnet50_are_those_pytorch_used(resnet50_gradients):
    """The kineto ResNet-50's 161 gradients, bucketed as DDP does, give the five buckets that the
    real DDP run of ResNet-50 all-reduced (hta-ddp-resnet50, SOURCES.md)."""
    buckets = framework("ddp").messages(resnet50_gradients.of_iteration(0), FrameworkOptions(), sliced=False)
    assert [b.nbytes / 4 for b in buckets] == DDP_BUCKET_ELEMENTS


def test_a_smaller_bucket_cap_makes_more_buckets(resnet50_gradients):
    grads = resnet50_gradients.of_iteration(0)
    default = framework("ddp").messages(grads, FrameworkOptions(), sliced=False)
    small = framework("ddp").messages(grads, FrameworkOptions(bucket_cap_bytes=5 * MiB), sliced=False)
    assert len(small) > len(default)
    assert sum(b.nbytes for b in small) == RESNET50_GRADIENT_BYTES


def test_horovod_sends_every_gradient_as_its_own_message(resnet50_gradients):
    grads = resnet50_gradients.of_iteration(0)
    messages = framework("horovod").messages(grads, FrameworkOptions(), sliced=False)
    assert [m.nbytes for m in messages] == [g.nbytes for g in grads]
    assert all(g.ready_task in m.ready_after for m, g in zip(messages, grads))


def test_messages_are_prioritised_by_forward_position(resnet50_gradients):
    """The last gradient ready (the stem) is the first the next forward pass needs: priority 0."""
    grads = resnet50_gradients.of_iteration(0)
    messages = framework("horovod").messages(grads, FrameworkOptions(), sliced=False)
    assert [m.priority for m in messages] == list(range(len(grads) - 1, -1, -1))


def test_parameter_server_messages_are_push_then_pull_pairs(resnet50_gradients):
    options = FrameworkOptions()
    grads = resnet50_gradients.of_iteration(0)
    messages = framework("ps").messages(grads, options, sliced=False)
    assert len(messages) % 2 == 0
    pushes, pulls = messages[0::2], messages[1::2]
    assert all(m.phase == "push" and m.follows is None for m in pushes)
    for i, (push, pull) in enumerate(zip(pushes, pulls)):
        assert pull.phase == "pull"
        assert pull.follows == 2 * i, "a pull waits for its own push"
        assert pull.nbytes == push.nbytes and pull.layers == push.layers
        assert pull.ready_after == [], "a pull is ready when its push is done"
    assert all(p.nbytes <= options.partition_bytes for p in pushes)
    assert sum(p.nbytes for p in pushes) == pytest.approx(RESNET50_GRADIENT_BYTES, rel=1e-12)
    assert len(pushes) > len(grads), "large gradients are partitioned"


@pytest.mark.parametrize("name", ["horovod", "ddp", "ps"])
@pytest.mark.parametrize("slice_bytes", [1 * MiB, 256 * 1024])
def test_p3_slices_are_at_most_the_slice_size(resnet50_gradients, name, slice_bytes):
    options = FrameworkOptions(slice_bytes=slice_bytes)
    grads = resnet50_gradients.of_iteration(0)
    slices = framework(name).messages(grads, options, sliced=True)
    sent = [m for m in slices if m.phase in ("allreduce", "push")]
    assert max(m.nbytes for m in sent) <= slice_bytes
    assert sum(m.nbytes for m in sent) == pytest.approx(RESNET50_GRADIENT_BYTES, rel=1e-12)
    assert len(sent) >= RESNET50_GRADIENT_BYTES / slice_bytes


def test_a_framework_nobody_knows_is_refused(resnet50_gradients):
    with pytest.raises(ValueError, match="horovod"):
        framework("mpi").messages(resnet50_gradients.of_iteration(0), FrameworkOptions(), sliced=False)


@pytest.mark.parametrize("name", [RESNET50, DLRM_RANK0], ids=["resnet50", "dlrm"])
def test_the_first_inputs_of_many_operators_are_those_of_each(traces, name):
    """``first_inputs_bytes`` reads the operator table's columns once; each operator's bytes
    are what ``first_input_bytes`` reads of it alone (None where no shape was recorded)."""
    ops = worker_graph(traces, name).ops
    rows = ops.index[::7].tolist()
    each = [first_input_bytes(ops, r) for r in rows]
    assert first_inputs_bytes(ops, rows) == each
    assert any(b is not None for b in each) and any(b is None for b in each)

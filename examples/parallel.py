"""The example transformers under today's parallelisms, on CPU workers over Gloo.

``examples/run_distributed.py`` runs these families beside Horovod and DDP, with the same
report; each is the way PyTorch's own libraries do it (torch 2.13), on a device mesh of CPU
ranks:

- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) with every block a unit and the
  model's root (embeddings, final norm, head) the last; parameters sharded over all ranks,
  all-gathered before each unit's forward and backward (``reshard_after_forward`` True, FSDP2's
  default and implicit prefetch), gradients reduce-scattered after each unit's backward.
- ``tp``: Megatron-style tensor parallelism with DTensor (``parallelize_module``): in every
  block ``attention.qkv`` and ``mlp.0`` column-wise, ``attention.out`` and ``mlp.2`` row-wise, so
  each block all-reduces its activations twice forward and twice backward; embeddings, norms
  and head replicated. ``--sequence-parallel`` shards the norms and residual stream along the
  sequence (``SequenceParallel``): the all-reduces become an all-gather before each column-wise
  layer and a reduce-scatter after each row-wise one. Every rank trains on the same batch.
- ``pp``: pipeline parallelism (``torch.distributed.pipelining``): the blocks split evenly into
  one stage per rank, the embeddings on the first stage, the norm and head on the last, the
  batch split into ``--microbatches`` and run by ``ScheduleGPipe`` (``--schedule gpipe``) or
  ``Schedule1F1B`` (``1f1b``), activations and their gradients sent point to point. The
  schedule scales each microbatch's gradient by 1/microbatches (``scale_grads``), so one step
  equals a step on the whole batch.
- ``ep``: expert parallelism for ``examples/moe.py``: the experts of every block spread over the
  ranks (Megatron's expert group = the data-parallel group), tokens dispatched to their experts'
  ranks and combined back by ``all_to_all_single`` (autograd's version); everything else data
  parallel under DDP, which leaves the experts' parameters out. Each expert's gradient, a sum
  over every rank's tokens, is divided by the ranks as data parallelism's average would.
- ``fsdp+tp``: the 2-D combination (torchtitan's): ``--tensor`` ranks of tensor parallelism
  inside, FSDP2 over the data-parallel dimension outside, on a (data, tensor) mesh with tensor
  the fastest-varying rank.

Every family's worker says which data-parallel rank it is (``data_rank`` of ``data_size``) so
that the run gives it the right shard, how it steps (pipeline schedules replace forward and
backward), and its settings for the report. :func:`reference_losses` is what one worker computes
for the same data: the parallel runs must match it.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from profiled_training import endless, shard, train_step, with_batch_size

FAMILIES = ("fsdp", "tp", "pp", "ep", "fsdp+tp")
SCHEDULES = ("gpipe", "1f1b")


@dataclass
class ParallelOptions:
    """The command line's settings for the parallel families."""

    tensor: int = 2  # fsdp+tp: tensor-parallel ranks (the rest is data parallel)
    sequence_parallel: bool = False  # tp, fsdp+tp
    microbatches: int = 4  # pp
    schedule: str = "1f1b"  # pp


class DistributedWorker:
    """What the torch.distributed families share: Gloo over ``env://``, gathering the workers'
    reports, leaving together. Subclasses set the parallel degrees and wrap the model."""

    family = ""

    def __init__(self, options: ParallelOptions) -> None:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if name not in os.environ]
        if missing:
            raise SystemExit(f"--framework {self.family} needs {', '.join(missing)} in the environment (or launch it with torchrun)")
        self.options = options
        dist.init_process_group("gloo", init_method="env://")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.degrees = {"data": self.size, "tensor": 1, "pipeline": 1, "expert": 1}
        self.coordinates = {"data": self.rank, "tensor": 0, "pipeline": 0}

    @property
    def data_rank(self) -> int:
        return self.coordinates["data"]

    @property
    def data_size(self) -> int:
        return self.degrees["data"]

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """The model as this rank trains it, and an optimizer like ``optimizer`` over its parameters."""
        raise NotImplementedError

    def step(self, model, optimizer, loss_fn, inputs, labels, mark) -> float:
        return train_step(model, optimizer, loss_fn, inputs, labels, mark=mark)

    def gather(self, value) -> list:
        values = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def settings(self) -> dict:
        return {"parallelism": {"family": self.family, **self.degrees, "sequence_parallel": False}, "backend": "gloo"}

    def close(self) -> None:
        dist.barrier()  # every rank leaves together; see run_distributed.DDPWorker.close


def same_optimizer(optimizer: torch.optim.Optimizer, parameters) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s kind and settings over ``parameters`` (the wrapped model's)."""
    return type(optimizer)(parameters, **optimizer.defaults)


def blocks_of(model: nn.Module) -> nn.Sequential:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential):
        raise SystemExit(f"{type(model).__name__} has no `blocks`: the parallel families need a transformer "
                         "(--model transformer or moe)")
    return blocks


def cpu_mesh(shape: tuple, names: tuple):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


# -- FSDP2 ----------------------------------------------------------------------------------------


def shard_fully(model: nn.Module, mesh) -> None:
    """FSDP2 with every block a unit and the root the last (``fully_shard`` per block, then the model)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class FSDPWorker(DistributedWorker):
    family = "fsdp"

    def prepare(self, model, optimizer):
        shard_fully(model, cpu_mesh((self.size,), ("data",)))
        self.units = len(blocks_of(model)) + 1  # the blocks, and the root
        return model, same_optimizer(optimizer, model.parameters())

    def settings(self) -> dict:
        settings = super().settings()
        settings["parallelism"]["fsdp"] = FSDP_SETTINGS
        settings["parallelism"]["fsdp_units"] = getattr(self, "units", 0)
        return settings


FSDP_SETTINGS = {"units": "each block, then the root", "reshard_after_forward": True}


# -- tensor (and sequence) parallelism -----------------------------------------------------------


def tensor_parallel_plan(sequence_parallel: bool) -> dict:
    """Megatron's split of one block: column-wise into each pair, row-wise out of it; with
    sequence parallelism the norms work on sequence shards and the row-wise layers scatter."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        return {"attention.qkv": ColwiseParallel(), "attention.out": RowwiseParallel(),
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "attention_norm": SequenceParallel(),
        "attention": gather,
        "attention.qkv": ColwiseParallel(),
        "attention.out": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize_blocks(model: nn.Module, mesh, sequence_parallel: bool) -> None:
    """Tensor-parallel blocks on ``mesh``; with sequence parallelism the residual stream enters
    the blocks as each rank's sequence shard (a local slice, no communication) and leaves them
    gathered whole again for the replicated final norm and head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    blocks = blocks_of(model)
    heads = blocks[0].attention.qkv.out_features // 3 // blocks[0].attention.head_dim
    length = model.position_embedding.num_embeddings
    if heads % mesh.size() or (sequence_parallel and length % mesh.size()):
        raise SystemExit(f"tensor parallelism over {mesh.size()} ranks needs heads ({heads}) and, with sequence "
                         "parallelism, the sequence length divisible by it")
    plan = tensor_parallel_plan(sequence_parallel)
    for block in blocks:
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        parallelize_module(blocks, mesh, PrepareModuleInputOutput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))


class TensorParallelWorker(DistributedWorker):
    family = "tp"

    def __init__(self, options: ParallelOptions) -> None:
        super().__init__(options)
        self.degrees = {"data": 1, "tensor": self.size, "pipeline": 1, "expert": 1}
        self.coordinates = {"data": 0, "tensor": self.rank, "pipeline": 0}

    def prepare(self, model, optimizer):
        parallelize_blocks(model, cpu_mesh((self.size,), ("tensor",)), self.options.sequence_parallel)
        self.pairs = 2 * len(blocks_of(model))  # each block's attention and MLP: a column/row pair
        return model, same_optimizer(optimizer, model.parameters())

    def settings(self) -> dict:
        settings = super().settings()
        settings["parallelism"]["sequence_parallel"] = self.options.sequence_parallel
        settings["parallelism"]["tensor_pairs"] = getattr(self, "pairs", 0)
        return settings


class FSDPTensorParallelWorker(DistributedWorker):
    """2-D: tensor parallelism inside (fastest-varying ranks), FSDP2 over the data dimension."""

    family = "fsdp+tp"

    def __init__(self, options: ParallelOptions) -> None:
        super().__init__(options)
        tensor = options.tensor
        if tensor < 1 or self.size % tensor:
            raise SystemExit(f"--tensor {tensor} does not divide the {self.size} ranks")
        self.degrees = {"data": self.size // tensor, "tensor": tensor, "pipeline": 1, "expert": 1}
        self.coordinates = {"data": self.rank // tensor, "tensor": self.rank % tensor, "pipeline": 0}

    def prepare(self, model, optimizer):
        mesh = cpu_mesh((self.degrees["data"], self.degrees["tensor"]), ("data", "tensor"))
        parallelize_blocks(model, mesh["tensor"], self.options.sequence_parallel)
        shard_fully(model, mesh["data"])
        return model, same_optimizer(optimizer, model.parameters())

    def settings(self) -> dict:
        settings = super().settings()
        settings["parallelism"].update(sequence_parallel=self.options.sequence_parallel, fsdp=FSDP_SETTINGS)
        return settings


# -- pipeline parallelism -------------------------------------------------------------------------


class PipelineStageModule(nn.Module):
    """Blocks ``first`` to ``last - 1`` of a transformer classifier, with its embeddings on the
    first stage and its final norm and head on the last; the blocks keep their names
    (``blocks.2...``), so parameters and layers read as in the whole model."""

    def __init__(self, model: nn.Module, first: int, last: int, stage: int, stages: int) -> None:
        super().__init__()
        self.model_type = type(model)
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.blocks = nn.ModuleDict({str(i): blocks_of(model)[i] for i in range(first, last)})
        if self.is_first:
            self.token_embedding, self.position_embedding = model.token_embedding, model.position_embedding
        if self.is_last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.model_type.embed(self, x)
        for block in self.blocks.values():
            x = block(x)
        return self.model_type.classify(self, x) if self.is_last else x


def stage_blocks(blocks: int, stages: int) -> list[range]:
    """Blocks per stage, as even as they go (the first stages take the remainder)."""
    if blocks < stages:
        raise SystemExit(f"{blocks} blocks cannot fill {stages} pipeline stages")
    sizes = [blocks // stages + (s < blocks % stages) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


class PipelineWorker(DistributedWorker):
    family = "pp"

    def __init__(self, options: ParallelOptions) -> None:
        super().__init__(options)
        if options.schedule not in SCHEDULES:
            raise SystemExit(f"unknown --schedule {options.schedule!r}; choose from {', '.join(SCHEDULES)}")
        self.degrees = {"data": 1, "tensor": 1, "pipeline": self.size, "expert": 1}
        self.coordinates = {"data": 0, "tensor": 0, "pipeline": self.rank}
        self.schedule = None
        self.losses: list = []

    def prepare(self, model, optimizer):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        spans = stage_blocks(len(blocks_of(model)), self.size)
        span = spans[self.rank]
        module = PipelineStageModule(model, span.start, span.stop, self.rank, self.size)
        self.stage_blocks = [list(s) for s in spans]
        stage = PipelineStage(module, self.rank, self.size, torch.device("cpu"))
        kind = ScheduleGPipe if self.options.schedule == "gpipe" else Schedule1F1B
        self.schedule = kind(stage, self.options.microbatches, loss_fn=nn.CrossEntropyLoss())
        return module, same_optimizer(optimizer, module.parameters())

    def step(self, model, optimizer, loss_fn, inputs, labels, mark) -> float:
        """One schedule run (every microbatch's forward and backward, interleaved as the
        schedule orders them: the phase ``schedule``) and the optimizer step; the last stage's
        loss, the mean over microbatches (NaN on the other stages)."""
        optimizer.zero_grad()
        if inputs.shape[0] % self.options.microbatches:
            raise SystemExit(f"the batch of {inputs.shape[0]} does not split into {self.options.microbatches} microbatches")
        losses: list = []
        first, last = self.rank == 0, self.rank == self.size - 1  # a one-stage pipeline is both
        self.schedule.step(*([inputs] if first else []), **({"target": labels, "losses": losses} if last else {}))
        mark("schedule")
        optimizer.step()
        mark("step")
        return float(torch.stack(losses).mean()) if losses else math.nan

    def settings(self) -> dict:
        settings = super().settings()
        settings["parallelism"].update(microbatches=self.options.microbatches, schedule=self.options.schedule,
                                       stage_blocks=getattr(self, "stage_blocks", None))
        return settings


# -- expert parallelism ---------------------------------------------------------------------------


def all_to_all(group) -> Callable[[torch.Tensor], torch.Tensor]:
    """The exchange over ``group``: an all-to-all with equal splits along the first dimension,
    autograd's (``all_to_all_single_autograd``, as torchtitan's expert parallelism uses; its
    backward is the reverse exchange), waited for at once."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    def exchange(buffer: torch.Tensor) -> torch.Tensor:
        return wait_tensor(all_to_all_single_autograd(buffer.contiguous(), None, None, group))

    return exchange


def expert_layers(model: nn.Module) -> list:
    layers = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "exchange")]
    if not layers:
        raise SystemExit("--framework ep needs a model with experts (--model moe)")
    return layers


def keep_local_experts(model: nn.Module, rank: int, ranks: int, group) -> list:
    """Each mixture-of-experts layer keeps experts ``rank * E/ranks`` onwards and exchanges its
    tokens over ``group``; the local experts' parameters."""
    local_params = []
    for layer in expert_layers(model):
        if layer.num_experts % ranks:
            raise SystemExit(f"{layer.num_experts} experts do not split over {ranks} ranks")
        per_rank = layer.num_experts // ranks
        mine = {str(e) for e in range(rank * per_rank, (rank + 1) * per_rank)}
        for name in list(layer.experts):
            if name not in mine:
                del layer.experts[name]
        layer.exchange = all_to_all(group)
        local_params += list(layer.experts.parameters())
    return local_params


class ExpertParallelWorker(DistributedWorker):
    family = "ep"

    def __init__(self, options: ParallelOptions) -> None:
        super().__init__(options)
        self.degrees = {"data": self.size, "tensor": 1, "pipeline": 1, "expert": self.size}

    def prepare(self, model, optimizer):
        experts = keep_local_experts(model, self.rank, self.size, dist.new_group(list(range(self.size))))
        for parameter in experts:  # the sum over every rank's tokens, to the data-parallel mean
            parameter.register_hook(lambda grad: grad / self.size)
        ids = {id(p) for p in experts}
        ignored = [name for name, p in model.named_parameters() if id(p) in ids]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        wrapped = nn.parallel.DistributedDataParallel(model)
        return wrapped, same_optimizer(optimizer, model.parameters())

    def settings(self) -> dict:
        settings = super().settings()
        settings["parallelism"]["expert_all_to_all"] = "all_to_all_single_autograd, equal splits"
        settings["ddp"] = {"backend": "gloo", "bucket_cap_mb": 25, "ignores": "the experts' parameters"}
        return settings


WORKERS = {"fsdp": FSDPWorker, "tp": TensorParallelWorker, "pp": PipelineWorker, "ep": ExpertParallelWorker,
           "fsdp+tp": FSDPTensorParallelWorker}


# -- what one worker computes -------------------------------------------------------------------


def reference_losses(build: Callable, data_size: int, steps: int, batch_size: Optional[int] = None) -> list[float]:
    """The losses one worker computes in ``steps`` steps for what ``data_size`` data-parallel
    ranks train on together: each step, every rank's batch through the same model, the mean of
    their losses backward, one SGD step (the run's optimizer). A parallel run of the family
    must report the same losses (its data-parallel ranks' mean), to rounding."""
    torch.manual_seed(0)
    model, loader = build()
    loader = with_batch_size(loader, batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    streams = [endless(shard(loader, r, data_size)) for r in range(data_size)]
    losses = []
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        per_rank = [loss_fn(model(inputs), labels) for inputs, labels in (next(s) for s in streams)]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def data_parallel_losses(report: dict) -> list[float]:
    """A parallel run's loss per step: the mean over its data-parallel ranks (ranks holding
    the same data report the same loss; pipeline stages other than the last report NaN)."""
    by_data_rank: dict = {}
    for worker in report["workers"]:
        losses = worker["losses"]
        if not any(math.isnan(x) for x in losses):
            by_data_rank.setdefault(worker["coordinates"]["data"], losses)
    return [statistics.fmean(step) for step in zip(*by_data_rank.values())]


def options_record(options: ParallelOptions) -> dict:
    return asdict(options)

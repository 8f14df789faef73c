"""The parallelism of a training job: how many ranks, and how the model and data are split.

A job is one training step of ``world = data x tensor x pipeline`` ranks. Expert parallelism
reuses ranks, as Megatron-LM does: the expert group is carved out of the data-parallel group,
so ``expert`` divides ``data`` and adds no ranks. :class:`Parallelism` is the scenario's
``parallelism:`` block parsed and checked; the other modules of this package turn it into
process groups (``placement.py``), find the model's repeated blocks (``units.py``), count
memory per GPU (``memory.py``), and transform one rank's graph, one family at a time (the
passes registered in :data:`PASSES`).

The families and their knobs:

* data: ``data`` replicas; ``zero`` 0 (plain data parallel, DDP: everything replicated), 1
  (optimizer state sharded), 2 (and gradients), 3 (and parameters: FSDP), as in Rajbhandari et
  al., "ZeRO: memory optimizations toward training trillion parameter models" (SC'20).
* tensor: ``tensor`` ranks split each block's GEMMs (Megatron-LM, Shoeybi et al. 2019);
  ``sequence_parallel`` splits the norms and dropouts along the sequence too (Korthikanti et
  al., "Reducing activation recomputation in large transformer models", 2022), whose
  replicated parameters' gradients (the norms', the row-parallel layers' biases) are then
  partial sums over the sequence shards, all-reduced over the tensor group before the optimizer
  step: ``sequence_parallel_grads`` ``coalesced`` (one all-reduce of them all, Megatron-LM) or
  ``per_parameter`` (one each, as DTensor's ``SequenceParallel`` leaves them).
  ``tensor_dispatch`` is the host time the tensor-parallel library adds per column/row pair
  beyond the traced operators, in forward, in backward and in the optimizer step (``(forward_us,
  backward_us, step_us)``; DTensor on a CPU routes every operator of a parallelized layer and
  every sharded parameter's update through its sharding propagation in Python); a plain trace
  lacks it. ``tensor_collective`` (scenario: ``tensor_dispatch.collective``) is the host time the
  library spends issuing and completing each collective beyond what the collective's own price
  holds (DTensor's functional collectives on top of c10d's: 0.1 to 0.3 ms each as the lab
  measured it). Default none; the lab measures both (``lab/parallel.py``'s ``measure_tensor_dispatch``).
* pipeline: ``pipeline`` stages, ``microbatches`` per step, ``schedule`` ``gpipe``, ``1f1b`` or
  ``interleaved`` (with ``virtual_stages`` model chunks per rank, Narayanan et al. 2021),
  ``partition`` ``balanced`` (by time) or the number of units per stage.
* expert: ``expert`` ranks share a mixture-of-experts layer's experts (all-to-all dispatch and
  combine).
* ``recompute``: ``none``, ``selective`` (attention's softmax and dropout recomputed) or
  ``full`` (each block's input kept, the block recomputed in backward): what it saves is
  ``memory.py``'s, what it costs ``recompute.py``'s.
* ``placement``: the order in which dimensions vary over GPU ids, fastest first (default
  tensor, data, pipeline: tensor parallel inside an NVLink domain).
* ``units``: a regular expression naming the repeated blocks (``blocks\\.\\d+``), where a bundle's
  layers or the default names do not find them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional, Union

from whatif.topology import TopologyError

#: The dimensions that make ranks, and the order they may be placed in.
DIMENSIONS = ("tensor", "data", "pipeline")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
SEQUENCE_PARALLEL_GRADS = ("coalesced", "per_parameter")
PARTITIONS = ("balanced",)

#: The graph passes, by family (``tensor``, ``expert``, ``pipeline``, ``fsdp``), filled by their
#: modules: ``PASSES[family] = apply_<family>``, each ``(graph, units, par, cluster, ranks_of) ->
#: TaskGraph``; :func:`parallelize` applies them in :data:`PASS_ORDER`.
PASSES: dict[str, Callable] = {}
PASS_ORDER = ("tensor", "expert", "fsdp", "pipeline")


def is_parallel_job(par: "Optional[Parallelism]") -> bool:
    """Whether ``par`` makes a parallel job (some family beyond plain data parallelism), which
    ``sim/parallel/job.py`` builds, rather than the data-parallel cluster path."""
    return par is not None and bool(par.families())


class ParallelismError(TopologyError):
    """A parallelism that cannot be used; ``str`` is one line naming the key
    (``parallelism.tensor: ...``)."""


@dataclass(frozen=True)
class Parallelism:
    """One job's parallelism, checked (see the module's docstring for what each key means)."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    zero: int = 0  # 0 none (DDP), 1, 2, 3 (= FSDP)
    sequence_parallel: bool = False
    sequence_parallel_grads: str = "coalesced"
    tensor_dispatch: tuple = (0.0, 0.0, 0.0)  # host us per column/row pair: forward, backward, step
    tensor_collective: float = 0.0  # host us per tensor-parallel collective, beyond its price
    fsdp_dispatch: tuple = (0.0, 0.0, 0.0)  # FSDP2's host us per unit: forward, backward, step
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    partition: Union[str, tuple] = "balanced"
    recompute: str = "none"
    placement: tuple = ("tensor", "data", "pipeline")
    units: Optional[str] = None
    reshard_after_forward: bool = True  # FSDP2's default: parameters freed after each unit's forward

    def __post_init__(self):
        for key in ("data", "tensor", "pipeline", "expert", "microbatches", "virtual_stages"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelismError(f"parallelism.{_key(key)}", f"expected a whole number >= 1, got {value!r}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ParallelismError("parallelism.zero", f"expected 0, 1, 2 or 3 (3 is fsdp), got {self.zero!r}")
        for key in ("sequence_parallel", "reshard_after_forward"):
            if not isinstance(getattr(self, key), bool):
                raise ParallelismError(f"parallelism.{key}", f"expected true or false, got {getattr(self, key)!r}")
        if self.schedule not in SCHEDULES:
            raise ParallelismError("parallelism.pipeline.schedule",
                                   f"unknown schedule {self.schedule!r} (choose from {', '.join(SCHEDULES)})")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ParallelismError("parallelism.pipeline.virtual_stages",
                                   f"{self.virtual_stages} virtual stages need schedule: interleaved, not {self.schedule}")
        if self.schedule in ("1f1b", "interleaved") and self.pipeline > 1 and self.microbatches < self.pipeline:
            raise ParallelismError("parallelism.pipeline.microbatches",
                                   f"{self.schedule} needs at least as many microbatches as stages: "
                                   f"{self.microbatches} microbatches for {self.pipeline} stages")
        if self.schedule == "interleaved" and self.pipeline > 1 and self.microbatches % self.pipeline:
            raise ParallelismError("parallelism.pipeline.microbatches",
                                   f"the interleaved schedule needs a multiple of the {self.pipeline} stages, "
                                   f"got {self.microbatches}")
        if self.data % self.expert:
            raise ParallelismError("parallelism.expert",
                                   f"the expert group is carved out of the data-parallel group: {self.expert} "
                                   f"does not divide data {self.data}")
        if self.recompute not in RECOMPUTE:
            raise ParallelismError("parallelism.recompute",
                                   f"unknown value {self.recompute!r} (choose from {', '.join(RECOMPUTE)})")
        if self.sequence_parallel_grads not in SEQUENCE_PARALLEL_GRADS:
            raise ParallelismError("parallelism.sequence_parallel_grads",
                                   f"unknown value {self.sequence_parallel_grads!r} "
                                   f"(choose from {', '.join(SEQUENCE_PARALLEL_GRADS)})")
        for key in ("tensor_dispatch", "fsdp_dispatch"):
            dispatch = getattr(self, key)
            if not (isinstance(dispatch, tuple) and len(dispatch) == 3
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")
                            for v in dispatch)):
                raise ParallelismError(f"parallelism.{key}",
                                       f"expected three durations >= 0 (forward, backward, step), got {dispatch!r}")
        collective = self.tensor_collective
        if isinstance(collective, bool) or not isinstance(collective, (int, float)) or not 0 <= collective < float("inf"):
            raise ParallelismError("parallelism.tensor_dispatch.collective", f"expected a duration >= 0, got {collective!r}")
        if any(self.fsdp_dispatch) and self.zero != 3:
            raise ParallelismError("parallelism.fsdp_dispatch", f"FSDP2's host time needs fsdp (zero 3), not zero {self.zero}")
        if self.sequence_parallel and self.tensor == 1:
            raise ParallelismError("parallelism.sequence_parallel", "sequence parallelism needs tensor > 1")
        partition = self.partition
        if isinstance(partition, str):
            if partition not in PARTITIONS:
                raise ParallelismError("parallelism.pipeline.partition",
                                       f"expected balanced or a list of units per stage, got {partition!r}")
        elif not (isinstance(partition, tuple) and len(partition) == self.pipeline
                  and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in partition)):
            raise ParallelismError("parallelism.pipeline.partition",
                                   f"expected balanced or {self.pipeline} whole numbers >= 1 (units per stage), "
                                   f"got {partition!r}")
        if sorted(self.placement) != sorted(DIMENSIONS) or not isinstance(self.placement, tuple):
            raise ParallelismError("parallelism.placement",
                                   f"expected an ordering of {', '.join(DIMENSIONS)}, got {list(self.placement)!r}")
        if self.units is not None and not isinstance(self.units, str):
            raise ParallelismError("parallelism.units", f"expected a regular expression, got {self.units!r}")

    @property
    def world(self) -> int:
        """The ranks of the job: data x tensor x pipeline (expert reuses data-parallel ranks)."""
        return self.data * self.tensor * self.pipeline

    @property
    def fsdp(self) -> bool:
        return self.zero == 3

    def size(self, dimension: str) -> int:
        """The ranks in one group of ``dimension`` (tensor, data, pipeline or expert)."""
        return getattr(self, dimension)

    def families(self) -> tuple[str, ...]:
        """The families this parallelism uses beyond plain data parallelism, in :data:`PASS_ORDER`."""
        model_parallel = self.tensor > 1 or self.expert > 1 or self.pipeline > 1
        # "fsdp": the data-parallel pass: ZeRO/FSDP sharding, or DDP's all-reduce beside model parallelism
        used = {"tensor": self.tensor > 1, "expert": self.expert > 1,
                "fsdp": self.zero > 0 or (self.data > 1 and model_parallel), "pipeline": self.pipeline > 1}
        return tuple(family for family in PASS_ORDER if used[family])

    def describe(self) -> str:
        """A short label: ``dp4 tp2 pp2(1f1b m8) zero3``, the plain ``dp4`` for data parallel."""
        parts = [f"dp{self.data}"]
        if self.tensor > 1:
            parts.append(f"tp{self.tensor}" + ("sp" if self.sequence_parallel else ""))
        if self.pipeline > 1:
            virtual = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pipeline}({self.schedule} m{self.microbatches}{virtual})")
        if self.expert > 1:
            parts.append(f"ep{self.expert}")
        if self.zero:
            parts.append("fsdp" if self.zero == 3 else f"zero{self.zero}")
        if self.recompute != "none":
            parts.append(f"recompute-{self.recompute}")
        return " ".join(parts)


def _key(field_name: str) -> str:
    """The scenario key a field comes from (``microbatches`` is ``pipeline.microbatches``)."""
    return {"microbatches": "pipeline.microbatches", "virtual_stages": "pipeline.virtual_stages"}.get(field_name, field_name)


PARALLELISM_FIELDS = tuple(f.name for f in fields(Parallelism))

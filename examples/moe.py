"""Capture a trace of a small mixture-of-experts transformer trained on synthetic tokens on one CPU core.

The transformer classifier of ``examples/transformer.py`` (four pre-norm blocks, d_model 256,
4 heads, sequences of 64 tokens) with a 4,096-token vocabulary and, in every block, a mixture of
experts in place of the MLP: a router (a linear layer without bias) scores 4 experts per token,
each token goes to its top 2, weighted by their renormalised softmax scores, and each expert is
an MLP 256 -> 512 -> 256. Routing follows GShard and the Switch Transformer: every expert takes
a fixed ``capacity`` of tokens per step, ceil(1.25 x top-k x tokens / experts) (320 for a batch
of 8 sequences), first choices placed before second choices, in token order, and choices past
the capacity dropped; empty places are zeros that the expert computes all the same. The shapes
are therefore the same every step: dispatch gathers the tokens into an (experts, capacity,
d_model) buffer, each expert runs on its (capacity, d_model) slice, combine adds each output
back to its token with the choice's weight.

Expert parallelism (``examples/parallel.py``) keeps ``experts / ranks`` experts on each rank and
replaces the two seams ``moe.dispatch`` and ``moe.combine`` (profiler ranges, empty on one
worker) with an all-to-all each of the buffer: rank r sends ``capacity x d_model`` floats per
expert to the rank holding it, and gets its experts' outputs back the same way. 6.3 million
parameters, 4.2 million of them in the experts; a step on a batch of 8 sequences takes about
150 ms on one core.

The training loop and profiler settings are those of ``examples/profiled_training.py``.

Usage::

    python examples/moe.py [OUTPUT.pt.trace.json.gz]
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from profiled_training import run_example, synthetic_loader
from torch import nn
from torch.nn import functional as F
from torch.profiler import record_function
from torch.utils.data import DataLoader
from transformer import D_MODEL, NUM_CLASSES, NUM_HEADS, NUM_LAYERS, SEQUENCE_LENGTH, SelfAttention, TransformerClassifier

DEFAULT_OUTPUT = Path("data/moe_cpu.pt.trace.json.gz")
VOCAB_SIZE = 4096
NUM_EXPERTS = 4
TOP_K = 2
EXPERT_FEED_FORWARD = 512
CAPACITY_FACTOR = 1.25
BATCH_SIZE = 8
NUM_SEQUENCES = 1024
DISPATCH, COMBINE = "moe.dispatch", "moe.combine"


class Expert(nn.Module):
    """One expert: an MLP d_model -> feed_forward -> d_model."""

    def __init__(self, d_model: int, feed_forward: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, feed_forward)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(feed_forward, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MixtureOfExperts(nn.Module):
    """Top-k routing to experts of fixed capacity (GShard / Switch), dispatch and combine.

    ``exchange`` is None on one worker; expert parallelism sets it to an all-to-all that splits
    a tensor into equal parts along its first dimension, one per rank in rank order, and returns
    what every rank sent in the same order, and keeps only the rank's own experts in ``experts``
    (a ``ModuleDict`` keyed by the experts' global numbers, so their parameters keep their
    names). Dispatch sends the (experts, capacity, d) buffer, combine the experts' outputs."""

    def __init__(self, d_model: int, feed_forward: int, num_experts: int, top_k: int, capacity_factor: float) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert(d_model, feed_forward) for e in range(num_experts)})
        self.exchange = None

    def capacity(self, tokens: int) -> int:
        """Places per expert for ``tokens`` tokens."""
        return math.ceil(self.capacity_factor * self.top_k * tokens / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        count, d_model = tokens.shape
        experts, capacity = self.num_experts, self.capacity(count)
        scores = F.softmax(self.router(tokens), dim=-1)
        weight, chosen = scores.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        # every (choice, token) in choice-major order: first choices take their places first
        expert = chosen.t().reshape(-1)
        place = (F.one_hot(expert, experts).cumsum(0) - 1).gather(1, expert[:, None]).squeeze(1)
        kept = place < capacity
        slot = (expert * capacity + place)[kept]
        token = torch.arange(count, device=x.device).repeat(self.top_k)[kept]
        weight = weight.t().reshape(-1)[kept]
        buffer = tokens.new_zeros(experts * capacity, d_model).index_copy(0, slot, tokens[token])
        buffer = buffer.view(experts, capacity, d_model)
        with record_function(DISPATCH):
            if self.exchange is not None:  # (ranks, local experts, capacity, d): every rank's tokens for mine
                buffer = self.exchange(buffer).view(-1, len(self.experts), capacity, d_model)
        outputs = self.run_experts(buffer)
        with record_function(COMBINE):
            if self.exchange is not None:
                outputs = self.exchange(outputs)
        outputs = outputs.reshape(experts * capacity, d_model)
        combined = tokens.new_zeros(count, d_model).index_add(0, token, outputs[slot] * weight[:, None])
        return combined.view(x.shape)

    def run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
        """Each expert on its tokens: ``buffer`` is (experts, capacity, d) on one worker and
        (ranks, local experts, capacity, d) after an exchange, when each local expert takes its
        tokens from every rank in one batch."""
        if self.exchange is None:
            return torch.stack([expert(buffer[e]) for e, expert in enumerate(self.experts.values())])
        ranks, local, capacity, d_model = buffer.shape
        outputs = [expert(buffer[:, e].reshape(ranks * capacity, d_model)).view(ranks, capacity, d_model)
                   for e, expert in enumerate(self.experts.values())]
        return torch.stack(outputs, dim=1)


class MoEBlock(nn.Module):
    """A pre-norm block whose MLP is a mixture of experts."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = SelfAttention(d_model, num_heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.moe = MixtureOfExperts(d_model, EXPERT_FEED_FORWARD, NUM_EXPERTS, TOP_K, CAPACITY_FACTOR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.mlp_norm(x))


class MoEClassifier(TransformerClassifier):
    """``TransformerClassifier`` with mixture-of-experts blocks and a smaller vocabulary."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        nn.Module.__init__(self)
        self.token_embedding = nn.Embedding(VOCAB_SIZE, D_MODEL)
        self.position_embedding = nn.Embedding(SEQUENCE_LENGTH, D_MODEL)
        self.blocks = nn.Sequential(*(MoEBlock(D_MODEL, NUM_HEADS) for _ in range(NUM_LAYERS)))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, num_classes)


def build() -> tuple[nn.Module, DataLoader]:
    tokens = torch.randint(0, VOCAB_SIZE, (NUM_SEQUENCES, SEQUENCE_LENGTH), generator=torch.Generator().manual_seed(0))
    return MoEClassifier(), synthetic_loader(tokens, NUM_CLASSES, BATCH_SIZE)


if __name__ == "__main__":
    run_example(__doc__.splitlines()[0], DEFAULT_OUTPUT, build, BATCH_SIZE)

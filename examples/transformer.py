"""Capture a trace of a small transformer encoder classifier trained on synthetic tokens on one CPU core.

A BERT-style encoder cut down to run on a CPU: token and position embeddings, four pre-norm
encoder blocks (d_model 256, 4 heads, feed-forward 1024) and a linear classifier on the mean of
the token states, for sequences of 64 tokens from a 16,384-token vocabulary. It holds 7.4
million parameters, 29.5 MB of float32 gradients, a third of them the dense gradient of the
token embedding, which is the last gradient backward produces and the first one forward needs.
A step on a batch of 8 sequences takes about 130 ms on one core, so the model sits between the
compute-bound convnet and the communication-bound wide MLP.

The attention's fused projection lays its outputs out head by head (each head's query, key and
value side by side), as Megatron-LM does, so that splitting it by columns over tensor-parallel
ranks gives each rank whole heads (``examples/parallel.py``). The classifier's ``embed`` and
``classify`` are the parts before and after the blocks, which pipeline stages reuse.

The training loop and profiler settings are those of ``examples/profiled_training.py``.

Usage::

    pip install torch==2.13.0
    python examples/transformer.py [OUTPUT.pt.trace.json.gz]
"""

from __future__ import annotations

from pathlib import Path

import torch
from profiled_training import run_example, synthetic_loader
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

DEFAULT_OUTPUT = Path("data/transformer_cpu.pt.trace.json.gz")
VOCAB_SIZE = 16384
SEQUENCE_LENGTH = 64
D_MODEL = 256
NUM_HEADS = 4
FEED_FORWARD = 1024
NUM_LAYERS = 4
NUM_CLASSES = 10
BATCH_SIZE = 8
NUM_SEQUENCES = 1024


class SelfAttention(nn.Module):
    """Multi-head self-attention: one projection to queries, keys and values, one out.

    ``qkv``'s outputs are head-major (head, then query/key/value, then the head's features) and
    the head count is read from them, so the same code runs on a tensor-parallel rank that holds
    a column slice of ``qkv`` (some whole heads) and a row slice of ``out``."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v)
        return self.out(attended.transpose(1, 2).reshape(batch, length, -1))


class EncoderBlock(nn.Module):
    """A pre-norm transformer encoder block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, d_model: int, num_heads: int, feed_forward: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = SelfAttention(d_model, num_heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, feed_forward), nn.GELU(), nn.Linear(feed_forward, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TransformerClassifier(nn.Module):
    """Embeddings, ``NUM_LAYERS`` encoder blocks, a final norm and a linear head on the mean token."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, D_MODEL)
        self.position_embedding = nn.Embedding(SEQUENCE_LENGTH, D_MODEL)
        self.blocks = nn.Sequential(*(EncoderBlock(D_MODEL, NUM_HEADS, FEED_FORWARD) for _ in range(NUM_LAYERS)))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classify(self.blocks(self.embed(tokens)))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the first block reads: token plus position embeddings."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token_embedding(tokens) + self.position_embedding(positions)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """The logits from the last block's output."""
        return self.head(self.norm(x).mean(dim=1))


def build() -> tuple[nn.Module, DataLoader]:
    tokens = torch.randint(0, VOCAB_SIZE, (NUM_SEQUENCES, SEQUENCE_LENGTH), generator=torch.Generator().manual_seed(0))
    return TransformerClassifier(), synthetic_loader(tokens, NUM_CLASSES, BATCH_SIZE)


if __name__ == "__main__":
    run_example(__doc__.splitlines()[0], DEFAULT_OUTPUT, build, BATCH_SIZE)

"""A zoo of small models for leveled profiling: five families, three sizes each, on synthetic data.

XSP (Li et al., 2020) characterised 65 models to show that where the time goes, and what
profiling costs, depends on the kind of model. These are the kinds a CPU can train in a few
hundred milliseconds a step on one thread: a multilayer perceptron, a convolutional network
(the blocks of ``convnet.py``), a transformer encoder (the blocks of ``transformer.py``), a
DLRM-like recommendation model (embedding bags, bottom and top MLPs, pairwise dot-product
feature interaction, as in Naumov et al. 2019) and an LSTM sequence classifier. Sizes go from
a few milliseconds a step, where per-operator overheads dominate, to a few hundred, where the
arithmetic does; the sizes were picked so that on one core of the 2-CPU development machine
every step takes between about 5 and 300 ms.

Each model trains with ``profiled_training.train_step`` (SGD with momentum, cross-entropy)
under :class:`whatif.collectors.xsp.measure.LeveledProfile`, so ``whatif profile`` runs it once
per level; ``--levels`` runs every level in this one process instead
(:func:`~whatif.collectors.xsp.session.run_levels`), as ``bench/xsp_zoo.py`` does::

    python examples/zoo.py --list
    python examples/zoo.py cnn-medium                   # the model level: median step time
    whatif profile --levels model,layer,operator -- python examples/zoo.py cnn-medium
    python examples/zoo.py cnn-medium --levels model,layer,operator --rounds 3 --out cnn.xsp
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from convnet import conv_block
from profiled_training import endless, train_step
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset
from transformer import EncoderBlock

NUM_CLASSES = 10
BATCHES_PER_EPOCH = 8


class MLP(nn.Module):
    """Linear + ReLU layers of the given widths and a linear classifier."""

    def __init__(self, in_features: int, widths: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for width in widths:
            layers += [nn.Linear(in_features, width), nn.ReLU(inplace=True)]
            in_features = width
        self.layers = nn.Sequential(*layers, nn.Linear(in_features, NUM_CLASSES))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


class CNN(nn.Module):
    """Conv blocks (3x3 convolution, batch norm, ReLU, 2x2 max pooling) and a linear head."""

    def __init__(self, channels: tuple[int, ...]) -> None:
        super().__init__()
        widths = (3,) + channels
        self.features = nn.Sequential(*(conv_block(a, b) for a, b in zip(widths, widths[1:])))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels[-1], NUM_CLASSES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


class Transformer(nn.Module):
    """Token and position embeddings, pre-norm encoder blocks, a linear head on the mean token."""

    def __init__(self, vocab: int, length: int, d_model: int, blocks: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d_model)
        self.position_embedding = nn.Embedding(length, d_model)
        self.blocks = nn.Sequential(*(EncoderBlock(d_model, 4, 4 * d_model) for _ in range(blocks)))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


class DLRM(nn.Module):
    """DLRM's structure: a bottom MLP turns the dense features into one embedding-sized vector,
    one sum-pooled embedding bag per sparse feature gives the others, the model then takes the
    dot product of every pair of these vectors and a top MLP reads the products and the dense
    vector. Inputs are ``(dense [B, D], sparse [B, tables, lookups])``."""

    def __init__(self, dense: int, tables: int, rows: int, dim: int, top: int) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim), nn.ReLU())
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        vectors = tables + 1
        pairs = vectors * (vectors - 1) // 2
        self.register_buffer("pairs", torch.triu_indices(vectors, vectors, offset=1), persistent=False)
        self.top = nn.Sequential(
            nn.Linear(dim + pairs, top), nn.ReLU(), nn.Linear(top, top // 2), nn.ReLU(), nn.Linear(top // 2, NUM_CLASSES)
        )

    def forward(self, inputs) -> torch.Tensor:
        dense, sparse = inputs
        x = self.bottom(dense)
        vectors = torch.stack([x] + [bag(sparse[:, i]) for i, bag in enumerate(self.embeddings)], dim=1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, products], dim=1))


class LSTMClassifier(nn.Module):
    """A stacked LSTM over a sequence of feature vectors, a linear head on the last state."""

    def __init__(self, features: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, sequences: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(sequences)
        return self.head(states[:, -1])


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo at one size: how to build it and the synthetic inputs of an epoch
    (one tensor per model input, ``BATCHES_PER_EPOCH`` batches long)."""

    family: str
    size: str
    batch_size: int
    build: Callable[[int, torch.Generator], tuple[nn.Module, tuple[torch.Tensor, ...]]]

    @property
    def name(self) -> str:
        return f"{self.family}-{self.size}"


def _mlp(in_features: int, widths: tuple[int, ...]):
    def build(samples: int, generator: torch.Generator):
        return MLP(in_features, widths), (torch.randn(samples, in_features, generator=generator),)

    return build


def _cnn(channels: tuple[int, ...], image: int):
    def build(samples: int, generator: torch.Generator):
        return CNN(channels), (torch.randn(samples, 3, image, image, generator=generator),)

    return build


def _transformer(vocab: int, length: int, d_model: int, blocks: int):
    def build(samples: int, generator: torch.Generator):
        return Transformer(vocab, length, d_model, blocks), (torch.randint(0, vocab, (samples, length), generator=generator),)

    return build


def _dlrm(dense: int, tables: int, rows: int, dim: int, lookups: int, top: int):
    def build(samples: int, generator: torch.Generator):
        inputs = (
            torch.randn(samples, dense, generator=generator),
            torch.randint(0, rows, (samples, tables, lookups), generator=generator),
        )
        return DLRM(dense, tables, rows, dim, top), inputs

    return build


def _lstm(features: int, hidden: int, layers: int, length: int):
    def build(samples: int, generator: torch.Generator):
        return LSTMClassifier(features, hidden, layers), (torch.randn(samples, length, features, generator=generator),)

    return build


def batched_loader(inputs: tuple[torch.Tensor, ...], batch: int, generator: torch.Generator) -> DataLoader:
    """Shuffled batches of ``inputs`` with random labels, each drawn as one batch of indices
    (one indexing operation per tensor, where ``profiled_training.synthetic_loader`` indexes
    every sample and stacks them): with a few hundred samples a batch, per-sample loading would
    be most of a small model's step and of its profiler events."""
    labels = torch.randint(0, NUM_CLASSES, (len(inputs[0]),), generator=generator)
    dataset = TensorDataset(*inputs, labels)
    sampler = BatchSampler(RandomSampler(dataset, generator=generator), batch, drop_last=True)
    return DataLoader(dataset, sampler=sampler, batch_size=None)


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("mlp", "small", 256, _mlp(256, (512, 512))),
        ZooModel("mlp", "medium", 64, _mlp(512, (1024, 1024, 1024))),
        ZooModel("mlp", "large", 64, _mlp(1024, (2048,) * 5)),
        ZooModel("cnn", "small", 16, _cnn((16, 32), 32)),
        ZooModel("cnn", "medium", 16, _cnn((32, 64, 128), 32)),
        ZooModel("cnn", "large", 16, _cnn((64, 128, 256, 256), 48)),
        ZooModel("transformer", "small", 8, _transformer(1024, 32, 64, 2)),
        ZooModel("transformer", "medium", 8, _transformer(4096, 64, 128, 4)),
        ZooModel("transformer", "large", 4, _transformer(16384, 128, 256, 4)),
        ZooModel("dlrm", "small", 1024, _dlrm(13, 4, 1000, 16, 4, 128)),
        ZooModel("dlrm", "medium", 128, _dlrm(13, 8, 20000, 32, 8, 256)),
        ZooModel("dlrm", "large", 256, _dlrm(13, 26, 20000, 64, 16, 512)),
        ZooModel("lstm", "small", 16, _lstm(32, 128, 1, 48)),
        ZooModel("lstm", "medium", 16, _lstm(64, 256, 1, 32)),
        ZooModel("lstm", "large", 16, _lstm(128, 512, 2, 48)),
    )
}


def trainer(entry: ZooModel) -> tuple[nn.Module, Callable[[], float]]:
    """``entry`` built on one thread, and a function running one training step of it."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model, inputs = entry.build(BATCHES_PER_EPOCH * entry.batch_size, generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    batches = endless(batched_loader(inputs, entry.batch_size, generator))

    def step() -> float:
        *batch, labels = next(batches)
        return train_step(model, optimizer, loss_fn, batch[0] if len(batch) == 1 else tuple(batch), labels)

    return model, step


def main(argv=None) -> int:
    from whatif.collectors.xsp.measure import LeveledProfile
    from whatif.collectors.xsp.session import run_levels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", choices=list(ZOO), metavar="MODEL", help="a zoo model (--list names them)")
    parser.add_argument("--list", action="store_true", help="print the zoo's models and exit")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (default: 10)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before them (default: 3)")
    parser.add_argument("--levels", help="profile these levels in this process (run_levels) instead of one level")
    parser.add_argument("--rounds", type=int, default=1, help="with --levels: rounds of all levels, alternating")
    parser.add_argument("--out", type=Path, help="with --levels: the folder for the runs and the view")
    args = parser.parse_args(argv)
    if args.list or args.model is None:
        print("\n".join(ZOO))
        return 0
    model, step = trainer(ZOO[args.model])
    if args.levels:
        view = run_levels(step, model, args.out or Path(f"{args.model}.xsp"), args.levels, args.rounds, args.steps, args.warmup, args.model)
        print(f"{args.model}: {', '.join(view['levels'])} written to {view['folder']}")
        return 0
    with LeveledProfile(model=model, name=args.model, steps=args.steps, warmup=args.warmup) as profile:
        step()
        while profile.step():
            step()
    record = profile.record
    if record["run"]:
        print(f"{args.model}: level {record['level']}, median step {statistics.median(record['step_ms'][args.warmup:]):.2f} ms")
    else:
        print(f"{args.model}: level {record['level']} not run: {record['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

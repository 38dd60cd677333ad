"""``charlm``: a character-level, decoder-only transformer trained on next-character prediction.

The model is GPT-2's shape at a small size (Radford et al., 2019; as in Karpathy's nanoGPT): token and
learned position embeddings, ``layers`` pre-norm blocks of causal multi-head self-attention and a 4x MLP
with GELU, a final LayerNorm, and an output head tied to the token embedding; no dropout. Weights start
from N(0, 0.02), with the residual projections scaled by 1 / sqrt(2 * layers). The defaults (2 layers,
width 128, 4 heads, context 64: 0.44 M parameters) train at about 30-75 ms per AdamW step of 16 sequences
on one CPU core (BENCHMARKS.md); ``--layers``, ``--model-dim``, ``--heads`` and ``--context`` make it as
large as a GPU wants.

The text, its validation split and the samples are ``gossip/tasks/corpus.py``'s; each peer trains on its
shard of the windows (``--partition iid`` or ``by-file``). ``evaluate`` reports, on the fixed evaluation
windows, the validation loss in nats per character (``loss``), the same in bits (``bits_per_char``), and
next-character accuracy (``accuracy``). A model that predicts uniformly scores log(256) = 5.55 nats.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gossip.partition import deal, parse_partition
from gossip.tasks import Task, TaskContext
from gossip.tasks.corpus import Corpus, Windows, read_corpus, windows

VOCAB = 256  # bytes
EVAL_BATCH = 64


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(width, dim=2))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CharTransformer(nn.Module):
    def __init__(self, context: int = 64, layers: int = 2, width: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        for name, parameter in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):  # residual outputs: GPT-2's scaled init
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * layers))
            elif parameter.dim() >= 2:
                nn.init.normal_(parameter, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits over the next byte at every position of ``ids`` (batch, length)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.T  # the head is the embedding, transposed


def make_model(ctx: TaskContext) -> CharTransformer:
    torch.manual_seed(ctx.seed)
    return CharTransformer(ctx.context, ctx.layers, ctx.model_dim, ctx.heads)


def gather(text: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """The windows of ``length`` bytes at ``starts``, as int64 token ids (batch, length)."""
    return text[starts[:, None] + torch.arange(length)].long()


def batches(text: torch.Tensor, starts: np.ndarray, batch_size: int, length: int, seed: int,
            device: torch.device) -> Iterator[torch.Tensor]:
    """Endless batches of windows: a fresh seeded shuffle of the shard every epoch."""
    rng = np.random.default_rng(seed)
    while True:
        order = torch.from_numpy(starts[rng.permutation(len(starts))])
        for begin in range(0, len(order), batch_size):
            yield gather(text, order[begin:begin + batch_size], length).to(device, non_blocking=True)


def next_char_loss(model: nn.Module, window: torch.Tensor) -> torch.Tensor:
    logits = model(window[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))


def evaluator(model: nn.Module, held_out: torch.Tensor):
    def evaluate() -> dict[str, float]:
        total, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for begin in range(0, len(held_out), EVAL_BATCH):
                window = held_out[begin:begin + EVAL_BATCH]
                logits = model(window[:, :-1]).reshape(-1, VOCAB)
                targets = window[:, 1:].reshape(-1)
                total += F.cross_entropy(logits, targets, reduction="sum").item()
                correct += int((logits.argmax(1) == targets).sum())
                count += targets.numel()
        loss = total / count
        return {"loss": loss, "bits_per_char": loss / math.log(2), "accuracy": correct / count}
    return evaluate


def shard(corpus: Corpus, cut: Windows, ctx: TaskContext) -> np.ndarray:
    """This peer's training windows under ``ctx.partition``."""
    per_file = np.bincount(cut.train_file, minlength=len(corpus.files))
    used = np.flatnonzero(per_file)  # files with a training window: what by-file deals out
    position = np.full(len(corpus.files), -1, dtype=np.int64)
    position[used] = np.arange(len(used))
    mine = deal(parse_partition(ctx.partition), ctx.world_size, ctx.seed, n_samples=len(cut.train),
                sample_file=position[cut.train_file], file_sizes=per_file[used].tolist())[ctx.rank]
    return cut.train[mine]


def check(ctx: TaskContext) -> None:
    """Read the corpus and deal its windows, as every peer will: a missing --data, a text too short for
    --context or more peers than files under ``by-file`` fails here, in one line."""
    corpus = read_corpus(ctx.data)
    shard(corpus, windows(corpus, ctx.context), ctx)


def make_task(ctx: TaskContext) -> Task:
    corpus = read_corpus(ctx.data)
    cut = windows(corpus, ctx.context)
    mine = shard(corpus, cut, ctx)
    text = torch.from_numpy(corpus.text.copy())  # a writable copy: torch refuses read-only buffers
    model = make_model(ctx).to(ctx.device)
    optimizer = ctx.optimizer.build(model.parameters())
    length = ctx.context + 1
    stream = batches(text, mine, ctx.batch_size, length, ctx.seed * 1000 + ctx.rank, ctx.device)
    held_out = gather(text, torch.from_numpy(cut.eval), length).to(ctx.device)
    files = np.unique(np.searchsorted(corpus.starts, mine, side="right") - 1)
    return Task(model, lambda: next_char_loss(model, next(stream)), evaluator(model, held_out), optimizer,
                samples_per_step=ctx.batch_size,
                shard={"samples": len(mine), "files": len(files), "characters": len(mine) * ctx.context},
                dataset={"name": corpus.name, "files": len(corpus.files), "bytes": len(corpus.text),
                         "sha256": corpus.sha256, "held_out_bytes": cut.held_out_bytes,
                         "train_windows": len(cut.train), "eval_windows": len(cut.eval), "vocab": VOCAB})

"""Which samples each peer trains on (``--partition``): pure functions of the data, the world size and the seed.

Every rule deals out all the training samples, each to exactly one peer:

- ``iid``: one seeded permutation dealt out round-robin (each shard in the permutation's order), so shards
  differ by at most one sample and look alike;
- ``dirichlet:ALPHA`` (label skew, for tasks with class labels): for every class, its samples are split
  among the peers in proportions drawn from a symmetric Dirichlet(ALPHA), as in the federated-learning
  benchmarks of Hsu et al. (2019) and NIID-Bench (Li et al., 2022). Small ALPHA (0.1) gives each peer a few
  classes, large ALPHA (100) approaches ``iid``. A draw that leaves a peer with fewer than ``min_samples``
  samples is redrawn from the same seeded generator, as NIID-Bench does;
- ``by-file`` (for tasks whose samples come from files, such as ``charlm``): the files, in their sorted
  order, are cut into ``world_size`` contiguous runs of about equal size, so each peer trains on its own
  files (its own modules: styles and vocabularies differ). No seed: the cut depends only on the files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gossip.errors import ConfigError

RULES = ("iid", "dirichlet:ALPHA", "by-file")
MAX_REDRAWS = 1000


@dataclass(frozen=True)
class Partition:
    rule: str  # "iid", "dirichlet" or "by-file"
    alpha: float = 0.0  # dirichlet's concentration

    @property
    def spec(self) -> str:
        return f"dirichlet:{self.alpha:g}" if self.rule == "dirichlet" else self.rule


def parse_partition(spec: str) -> Partition:
    """``Partition`` for a ``--partition`` value, or ``ConfigError`` saying what is wrong."""
    if not isinstance(spec, str):
        raise ConfigError(f"--partition must be one of {', '.join(RULES)}, got {spec!r}")
    name, _, argument = spec.strip().partition(":")
    if name in ("iid", "by-file") and not argument:
        return Partition(name)
    if name == "dirichlet":
        try:
            alpha = float(argument)
        except ValueError:
            raise ConfigError(f"--partition {spec}: ALPHA must be a number, e.g. dirichlet:0.1") from None
        if not (np.isfinite(alpha) and alpha > 0):
            raise ConfigError(f"--partition {spec}: ALPHA must be > 0 (0.1: a few classes per peer; 100: nearly iid)")
        return Partition("dirichlet", alpha)
    raise ConfigError(f"--partition {spec!r} is not a rule; choose one of: {', '.join(RULES)}")


def iid(n_samples: int, world_size: int, seed: int) -> list[np.ndarray]:
    """Each peer's sample indices: one seeded permutation dealt out round-robin."""
    order = np.random.default_rng(seed).permutation(n_samples)
    return [order[rank::world_size] for rank in range(world_size)]


def dirichlet(labels: np.ndarray, world_size: int, alpha: float, seed: int, min_samples: int = 1) -> list[np.ndarray]:
    """Each peer's sample indices, every class split among the peers by a Dirichlet(``alpha``) draw."""
    if world_size * min_samples > len(labels):
        raise ConfigError(f"{len(labels)} samples cannot give {world_size} peers {min_samples} each; use fewer peers")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(MAX_REDRAWS):
        shards: list[list[np.ndarray]] = [[] for _ in range(world_size)]
        for label in classes:
            members = rng.permutation(np.flatnonzero(labels == label))
            shares = rng.dirichlet(np.full(world_size, alpha))
            cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(int)
            for rank, part in enumerate(np.split(members, cuts)):
                shards[rank].append(part)
        result = [np.sort(np.concatenate(parts)) for parts in shards]
        if min(len(r) for r in result) >= min_samples:
            return result
    raise ConfigError(f"--partition dirichlet:{alpha:g} left a peer with fewer than {min_samples} samples in "
                      f"{MAX_REDRAWS} draws; use a larger ALPHA or fewer peers")


def by_file(file_sizes: list[int], world_size: int) -> list[np.ndarray]:
    """Each peer's file indices: contiguous runs of the files in their order, of about equal total size
    (each cut at the file boundary nearest to an equal share), at least one file each."""
    files = len(file_sizes)
    if world_size > files:
        raise ConfigError(f"--partition by-file needs at least one file per peer: {files} files for {world_size} "
                          "peers; use fewer peers, more files (--data), or --partition iid")
    total = float(np.sum(file_sizes))
    ends = np.cumsum(np.asarray(file_sizes, dtype=np.float64))[:-1]  # the boundary after each file but the last
    cuts: list[int] = []
    for rank in range(1, world_size):
        nearest = int(np.argmin(np.abs(ends - rank * total / world_size))) + 1
        lowest = cuts[-1] + 1 if cuts else 1
        cuts.append(min(max(nearest, lowest), files - (world_size - rank)))
    return np.split(np.arange(files), cuts)


def deal(partition: Partition, world_size: int, seed: int, *, n_samples: int, labels: np.ndarray | None = None,
         sample_file: np.ndarray | None = None, file_sizes: list[int] | None = None,
         min_samples: int = 1) -> list[np.ndarray]:
    """Every peer's sample indices under ``partition``. ``labels``: each sample's class (dirichlet);
    ``sample_file`` and ``file_sizes``: the file each sample comes from, and each file's size (by-file)."""
    if partition.rule == "iid":
        return iid(n_samples, world_size, seed)
    if partition.rule == "dirichlet":
        if labels is None:
            raise ConfigError("--partition dirichlet splits classes among the peers; this task has no class labels "
                              "(use iid, or by-file for a task read from files)")
        return dirichlet(labels, world_size, partition.alpha, seed, min_samples)
    if sample_file is None or file_sizes is None:
        raise ConfigError("--partition by-file gives each peer its own files; this task's samples do not come from "
                          "files (use iid, or dirichlet:ALPHA for label skew)")
    owner = np.empty(len(file_sizes), dtype=np.int64)
    for rank, files in enumerate(by_file(file_sizes, world_size)):
        owner[files] = rank
    sample_owner = owner[sample_file]
    return [np.flatnonzero(sample_owner == rank) for rank in range(world_size)]

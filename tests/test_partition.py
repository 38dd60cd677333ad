"""``--partition``: every rule deals out every training sample to exactly one peer, for every world size."""

from __future__ import annotations

import numpy as np
import pytest

from gossip.errors import ConfigError
from gossip.partition import by_file, deal, dirichlet, iid, parse_partition
from gossip.tasks.digits import load_split, shard

WORLD_SIZES = (1, 2, 3, 4, 7, 8, 16)


def assert_disjoint_and_complete(shards: list[np.ndarray], n_samples: int) -> None:
    joined = np.concatenate(shards)
    assert len(joined) == n_samples and np.array_equal(np.sort(joined), np.arange(n_samples))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_iid_deals_every_sample_once_in_shards_that_differ_by_at_most_one(world_size):
    shards = iid(1437, world_size, seed=3)
    assert_disjoint_and_complete(shards, 1437)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert all(np.array_equal(a, b) for a, b in zip(shards, iid(1437, world_size, seed=3)))  # seeded
    assert not np.array_equal(shards[0], iid(1437, world_size, seed=4)[0]) or world_size == 1


@pytest.mark.parametrize("alpha", (0.1, 1.0, 100.0))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dirichlet_deals_every_sample_once_and_skews_the_labels_less_as_alpha_grows(world_size, alpha):
    labels = np.repeat(np.arange(10), 150)
    shards = dirichlet(labels, world_size, alpha, seed=0, min_samples=8)
    assert_disjoint_and_complete(shards, len(labels))
    assert min(map(len, shards)) >= 8
    assert all(np.array_equal(a, b) for a, b in zip(shards, dirichlet(labels, world_size, alpha, 0, 8)))


def test_dirichlet_small_alpha_gives_each_peer_a_few_classes_and_large_alpha_nearly_all():
    labels = np.repeat(np.arange(10), 150)

    def dominant_share(alpha: float) -> float:  # the mean share of each peer's largest class
        shards = dirichlet(labels, 8, alpha, seed=1, min_samples=8)
        return float(np.mean([np.bincount(labels[s], minlength=10).max() / len(s) for s in shards]))

    assert dominant_share(0.1) > 0.4 > 0.2 > dominant_share(100.0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_by_file_gives_every_peer_contiguous_files_of_about_equal_size(world_size):
    sizes = list(np.random.default_rng(0).integers(1, 1000, size=40))
    runs = by_file(sizes, world_size)
    assert_disjoint_and_complete(runs, len(sizes))
    assert all(len(run) >= 1 and np.array_equal(run, np.arange(run[0], run[-1] + 1)) for run in runs)
    assert [run[0] for run in runs] == sorted(run[0] for run in runs)
    share = sum(sizes) / world_size
    assert all(abs(sum(sizes[i] for i in run) - share) <= max(sizes) for run in runs)


@pytest.mark.parametrize("world_size", (1, 3, 5))
def test_by_file_deals_the_samples_of_each_file_to_its_owner(world_size):
    sample_file = np.repeat(np.arange(6), [5, 1, 3, 8, 2, 4])
    shards = deal(parse_partition("by-file"), world_size, 0, n_samples=len(sample_file), sample_file=sample_file,
                  file_sizes=np.bincount(sample_file).tolist())
    assert_disjoint_and_complete(shards, len(sample_file))
    owners = [{int(f) for f in sample_file[s]} for s in shards]
    assert all(not a & b for i, a in enumerate(owners) for b in owners[i + 1:])


def test_digits_shards_are_disjoint_and_complete_under_every_rule():
    labels = load_split()[1].numpy()
    for spec in ("iid", "dirichlet:0.1", "dirichlet:10"):
        for world_size in (1, 4, 8):
            shards = [shard(labels, rank, world_size, seed=2, partition=spec, batch_size=32)
                      for rank in range(world_size)]
            assert_disjoint_and_complete(shards, len(labels))
            assert min(map(len, shards)) >= min(32, len(labels) // world_size)


@pytest.mark.parametrize("spec, message", [
    ("dirichlet:0", "ALPHA must be > 0"), ("dirichlet:-1", "ALPHA must be > 0"), ("dirichlet:nan", "ALPHA must be > 0"),
    ("dirichlet:x", "ALPHA must be a number"), ("dirichlet", "ALPHA must be a number"), ("by-files", "is not a rule"),
    ("iid:3", "is not a rule")])
def test_a_bad_rule_is_one_line_saying_what_to_give(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_partition(spec)


def test_more_peers_than_files_or_a_rule_without_its_data_is_refused():
    with pytest.raises(ConfigError, match="at least one file per peer: 3 files for 4 peers"):
        by_file([1, 2, 3], 4)
    with pytest.raises(ConfigError, match="no class labels"):
        deal(parse_partition("dirichlet:1"), 2, 0, n_samples=10)
    with pytest.raises(ConfigError, match="do not come from files"):
        deal(parse_partition("by-file"), 2, 0, n_samples=10, labels=np.zeros(10, int))

"""The charlm task: its corpus, the fixed validation split, the windows each peer trains on, and the model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gossip.errors import ConfigError, TaskError
from gossip.tasks import TaskContext, build_task
from gossip.tasks.charlm import VOCAB, CharTransformer, shard
from gossip.tasks.corpus import BLOCK, EVAL_WINDOWS, HELD_OUT, held_out_blocks, read_corpus, windows


@pytest.fixture(scope="module")
def corpus():
    return read_corpus()


def test_the_default_corpus_is_the_standard_librarys_sources_in_sorted_order(corpus):
    assert corpus.name.startswith("python3.") and len(corpus.files) > 100
    assert list(corpus.files) == sorted(corpus.files, key=lambda f: f.split("/"))
    assert all(f.endswith(".py") and "site-packages" not in f and "/test/" not in f"/{f}" for f in corpus.files)
    assert corpus.starts[-1] == len(corpus.text) and len(corpus.sha256) == 64
    assert read_corpus().sha256 == corpus.sha256


def test_the_validation_split_depends_on_the_text_alone_and_is_never_trained_on(corpus):
    held = held_out_blocks(corpus)
    blocks = sum(math.ceil((b - a) / BLOCK) for a, b in zip(corpus.starts[:-1], corpus.starts[1:]))
    assert len(held) == blocks // HELD_OUT
    for context in (16, 64):
        cut = windows(corpus, context)
        assert len(cut.eval) == EVAL_WINDOWS and cut.held_out_bytes > 0
        file_of = np.searchsorted(corpus.starts, cut.train, side="right") - 1
        assert np.array_equal(file_of, cut.train_file)
        ends = cut.train + context + 1
        assert np.all(ends <= corpus.starts[file_of + 1])  # a window stays in its file
        for starts, end_of in ((cut.train, ends), (cut.eval, cut.eval + context + 1)):
            first = (starts - corpus.starts[np.searchsorted(corpus.starts, starts, side="right") - 1]) // BLOCK
            last = (end_of - 1 - corpus.starts[np.searchsorted(corpus.starts, starts, side="right") - 1]) // BLOCK
            files = np.searchsorted(corpus.starts, starts, side="right") - 1
            inside = [any((f, b) in held for b in range(lo, hi + 1)) for f, lo, hi in zip(files, first, last)]
            assert all(inside) if starts is cut.eval else not any(inside)


@pytest.mark.parametrize("partition", ("iid", "by-file"))
@pytest.mark.parametrize("world_size", (1, 2, 4, 8))
def test_the_peers_windows_are_disjoint_and_complete(corpus, partition, world_size):
    cut = windows(corpus, 64)
    shards = [shard(corpus, cut, TaskContext(rank, world_size, seed=1, partition=partition))
              for rank in range(world_size)]
    joined = np.concatenate(shards)
    assert len(joined) == len(cut.train) and np.array_equal(np.sort(joined), np.sort(cut.train))
    if partition == "by-file":
        owners = [set(np.searchsorted(corpus.starts, s, side="right") - 1) for s in shards]
        assert all(not a & b for i, a in enumerate(owners) for b in owners[i + 1:])
        assert max(map(len, shards)) < 1.5 * len(cut.train) / world_size


def test_a_text_too_small_or_a_partition_it_cannot_serve_is_one_line(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("x" * 100)
    with pytest.raises(TaskError, match="too small"):
        windows(read_corpus(str(small)), 64)
    one = tmp_path / "one.txt"
    one.write_bytes(bytes(range(256)) * 300)
    cut = windows(read_corpus(str(one)), 64)
    with pytest.raises(ConfigError, match="1 files for 2 peers"):
        shard(read_corpus(str(one)), cut, TaskContext(0, 2, 0, partition="by-file"))
    with pytest.raises(TaskError, match="no such file or folder"):
        read_corpus(str(tmp_path / "missing"))


def test_a_folder_of_text_is_read_in_sorted_order(tmp_path):
    for name, text in (("b/x.txt", "bbbb"), ("a.txt", "aaaa"), (".hidden", "hh"), ("b/__pycache__/c", "cc")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    corpus = read_corpus(str(tmp_path))
    assert corpus.files == ("a.txt", "b/x.txt") and corpus.text.tobytes() == b"aaaabbbb"


def test_the_default_model_is_gpt_shaped_with_a_tied_head():
    model = CharTransformer()
    assert 0.4e6 < sum(p.numel() for p in model.parameters()) < 0.45e6
    ids = torch.randint(0, VOCAB, (2, 64))
    assert model(ids).shape == (2, 64, VOCAB)
    changed = ids.clone()
    changed[:, 40] = (changed[:, 40] + 1) % VOCAB  # causal: the future does not change the past
    assert torch.equal(model(ids)[:, :40], model(changed)[:, :40])
    assert model.tokens.weight.data_ptr() in {p.data_ptr() for p in model.parameters()}


def test_an_untrained_model_scores_near_the_uniform_loss():
    task = build_task("charlm", TaskContext(0, 1, seed=0, batch_size=8, context=32, model_dim=64, heads=2))
    before = task.evaluate()
    assert 0.9 * math.log(VOCAB) < before["loss"] < 1.05 * math.log(VOCAB)
    assert before["bits_per_char"] == pytest.approx(before["loss"] / math.log(2))
    assert task.shard["samples"] * 32 == task.shard["characters"] and task.dataset["vocab"] == VOCAB

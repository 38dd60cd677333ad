"""The flat parameter buffer: parameters become views into one segment per dtype, and the ops on it."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from gossip.errors import ConfigError
from gossip.flat import FlatParams

CHUNK = 256


def small_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def inside(tensor: torch.Tensor, segment: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies within ``segment``'s."""
    start, end = segment.data_ptr(), segment.data_ptr() + segment.numel() * segment.element_size()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= end


def offset_in(tensor: torch.Tensor, segment: torch.Tensor) -> int:
    return (tensor.data_ptr() - segment.data_ptr()) // segment.element_size()


def test_parameters_become_views_with_values_and_identity_kept():
    torch.manual_seed(0)
    model = small_net()
    params = list(model.parameters())
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}

    flat = FlatParams(model, CHUNK)

    assert len(flat.segments) == 1
    assert all(a is b for a, b in zip(model.parameters(), params))  # the same Parameter objects
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    for param in model.parameters():
        assert inside(param, flat.segments[0])
    offsets = sorted(offset_in(p, flat.segments[0]) for p in model.parameters())
    assert len(set(offsets)) == len(offsets)  # no two parameters share memory


def test_an_optimizer_built_before_attach_updates_the_flat_segment():
    torch.manual_seed(0)
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = FlatParams(model, CHUNK)
    segment = flat.segments[0]
    nn.functional.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 3, (16,))).backward()
    expected = segment.clone()  # after the forward pass, which updated BatchNorm's running statistics in place
    for param in model.parameters():
        start = offset_in(param, segment)
        expected[start:start + param.numel()] -= 0.1 * param.grad.flatten()

    before_step = segment.clone()

    optimizer.step()

    assert not torch.equal(segment, before_step)
    torch.testing.assert_close(segment, expected, rtol=0, atol=1e-7)


def test_float_buffers_are_averaged_and_integer_buffers_are_not():
    model = small_net()
    bn = model[1]
    flat = FlatParams(model, CHUNK)
    params = sum(p.numel() for p in model.parameters())
    assert flat.numel == params + 2 * 8  # running_mean and running_var
    assert inside(bn.running_mean, flat.segments[0]) and inside(bn.running_var, flat.segments[0])
    assert bn.num_batches_tracked.dtype == torch.int64 and not inside(bn.num_batches_tracked, flat.segments[0])

    model.train()
    model(torch.randn(16, 4) + 5)  # BatchNorm updates its running statistics in place ...
    start = offset_in(bn.running_mean, flat.segments[0])
    assert torch.equal(flat.segments[0][start:start + 8], bn.running_mean)  # ... inside the flat segment
    assert bn.running_mean.abs().sum() > 0 and bn.num_batches_tracked == 1


def test_tied_parameters_are_counted_once_and_stay_tied():
    encoder, decoder = nn.Linear(4, 4), nn.Linear(4, 4)
    decoder.weight = encoder.weight
    model = nn.Sequential(encoder, nn.Tanh(), decoder)
    flat = FlatParams(model, CHUNK)
    assert flat.numel == 16 + 4 + 4
    assert decoder.weight is encoder.weight and inside(encoder.weight, flat.segments[0])


def test_a_buffer_shared_by_two_modules_stays_shared():
    first, second = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    second.running_mean = first.running_mean
    flat = FlatParams(nn.Sequential(first, second), CHUNK)
    assert flat.numel == 2 * (3 + 3) + 2 * 3 + 3  # two affine pairs, two running_var, one shared running_mean
    assert second.running_mean is first.running_mean
    flat.segments[0].fill_(7.0)
    assert torch.equal(second.running_mean, torch.full((3,), 7.0))


def test_two_dtypes_give_two_segments():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2).double())
    flat = FlatParams(model, CHUNK)
    assert [s.dtype for s in flat.segments] == [torch.float32, torch.float64]
    assert flat.layout.dtypes == ("float32", "float64") and flat.layout.numels == (8, 6)
    assert inside(model[0].weight, flat.segments[0]) and inside(model[1].weight, flat.segments[1])


def test_snapshot_is_a_copy_cut_per_frame_plan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 10), nn.Linear(10, 3).double())
    flat = FlatParams(model, CHUNK)
    before = [s.clone() for s in flat.segments]
    snapshot = flat.snapshot()

    assert [t.numel() for t in snapshot] == [stop - start for _, start, stop in flat.plan]
    assert len(snapshot) > 2
    for segment in range(2):
        parts = [t for t, (s, _, _) in zip(snapshot, flat.plan) if s == segment]
        assert torch.equal(torch.cat(parts), before[segment])
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    for segment in range(2):
        parts = [t for t, (s, _, _) in zip(snapshot, flat.plan) if s == segment]
        assert torch.equal(torch.cat(parts), before[segment])  # unchanged by the model's update
        assert torch.equal(flat.segments[segment], before[segment] + 1)


def test_views_share_the_segments_memory():
    flat = FlatParams(nn.Linear(30, 10), CHUNK)
    views = list(flat.views())
    assert len(views) == len(flat.plan) > 1
    assert all(inside(view, flat.segments[0]) for view in views)


def plan_chunks(flat: FlatParams, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(stop - start, generator=generator, dtype=torch.float64).to(flat.segments[segment].dtype)
            for segment, start, stop in flat.plan]


def joined(flat: FlatParams, chunks: list[torch.Tensor], segment: int) -> torch.Tensor:
    return torch.cat([c for c, (s, _, _) in zip(chunks, flat.plan) if s == segment])


def test_add_and_copy_do_what_they_say():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 10), nn.Linear(10, 3).double())
    flat = FlatParams(model, CHUNK)
    chunks = plan_chunks(flat, seed=1)
    before = [s.clone() for s in flat.segments]

    flat.add_(chunks, alpha=0.3)
    for i in range(2):
        torch.testing.assert_close(flat.segments[i], before[i] + 0.3 * joined(flat, chunks, i))

    flat.copy_(chunks)
    for i in range(2):
        assert torch.equal(flat.segments[i], joined(flat, chunks, i))
    assert torch.equal(model[1].bias, joined(flat, chunks, 1)[-3:])  # the model sees it: bias is last


@pytest.mark.parametrize("block_bytes", [8, 64, 1 << 20])
def test_combine_adds_every_term_and_snapshots_the_result(monkeypatch, block_bytes):
    monkeypatch.setattr("gossip.flat.MIX_BLOCK_BYTES", block_bytes)  # blocks that split frames unevenly
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 10), nn.Linear(10, 3).double())
    flat = FlatParams(model, CHUNK)
    before = [s.clone() for s in flat.segments]
    a, b = plan_chunks(flat, seed=1), plan_chunks(flat, seed=2)
    # the async form: x <- 0.5 x + 0.3 a + 0.2 b, with x itself as a term
    copies = flat.combine_([(-0.5, list(flat.views())), (0.3, a), (0.2, b)], snapshot=True)
    for i in range(2):
        expected = 0.5 * before[i] + 0.3 * joined(flat, a, i) + 0.2 * joined(flat, b, i)
        torch.testing.assert_close(flat.segments[i], expected)
        assert torch.equal(joined(flat, copies, i), flat.segments[i])
    assert all(c.data_ptr() != v.data_ptr() for c, v in zip(copies, flat.views()))
    assert flat.combine_([(1.0, a)]) is None


@pytest.mark.parametrize("block_bytes", [8, 64, 1 << 20])
def test_combine_writes_the_snapshot_into_a_term_it_has_read(monkeypatch, block_bytes):
    """The overlap round's form: x <- x + 0.2 (own - x)... with the next snapshot written into ``own``."""
    monkeypatch.setattr("gossip.flat.MIX_BLOCK_BYTES", block_bytes)
    torch.manual_seed(0)
    flat = FlatParams(nn.Sequential(nn.Linear(20, 10), nn.Linear(10, 3).double()), CHUNK)
    twin = FlatParams(nn.Sequential(nn.Linear(20, 10), nn.Linear(10, 3).double()), CHUNK)
    twin.copy_(list(flat.views()))
    own, a = plan_chunks(flat, seed=1), plan_chunks(flat, seed=2)
    terms = lambda target, own: [(-0.5, list(target.views())), (0.3, own), (0.2, a)]  # noqa: E731
    expected = twin.combine_(terms(twin, [c.clone() for c in own]), snapshot=True)
    pointers = [c.data_ptr() for c in own]
    received = [c.clone() for c in a]
    copies = flat.combine_([*terms(flat, own)[:2], (0.2, received)], snapshot=True, into=own, release=[received])
    assert [c.data_ptr() for c in copies] == pointers  # no new buffer
    assert received == [None] * len(a)  # each frame given up once mixed
    for mine, theirs in zip(copies + list(flat.views()), expected + list(twin.views()), strict=True):
        assert torch.equal(mine, theirs)


def fingerprint(model: nn.Module) -> str:
    return FlatParams(model, CHUNK).layout.fingerprint


class Block(nn.Module):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype))


def test_fingerprint_is_equal_for_identical_models():
    torch.manual_seed(0)
    first = fingerprint(small_net())
    torch.manual_seed(1)  # different values, same layout
    assert fingerprint(small_net()) == first


@pytest.mark.parametrize("other", [
    lambda: nn.Sequential(OrderedDict(a=Block((3, 4)))),  # same numel, different shape
    lambda: nn.Sequential(OrderedDict(b=Block((2, 6)))),  # different name
    lambda: nn.Sequential(OrderedDict(a=Block((2, 6), torch.float64))),  # different dtype
    lambda: nn.Sequential(OrderedDict(a=Block((2, 6)), c=Block((1,)))),  # one more tensor
])
def test_fingerprint_differs_when_the_layout_differs(other):
    assert fingerprint(nn.Sequential(OrderedDict(a=Block((2, 6))))) != fingerprint(other())


@pytest.mark.parametrize("model", [
    lambda: nn.ReLU(),
    lambda: nn.Sequential(nn.Identity()),
    lambda: _int_only(),
], ids=["no-parameters", "identity", "integer-buffers-only"])
def test_a_model_without_float_tensors_is_a_config_error(model):
    with pytest.raises(ConfigError, match="no floating-point"):
        FlatParams(model(), CHUNK)
    assert issubclass(ConfigError, ValueError)


def _int_only() -> nn.Module:
    module = nn.Module()
    module.register_buffer("count", torch.zeros(3, dtype=torch.long))
    return module


def test_relocate_moves_the_weights_and_leaves_the_old_memory_alone():
    first, second = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    second.running_mean = first.running_mean  # shared: must stay shared after the move
    model = nn.Sequential(nn.Linear(3, 3), first, second)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    flat = FlatParams(model, CHUNK)
    flat.segments[0].copy_(torch.arange(flat.numel, dtype=torch.float32))
    old = flat.segments[0]
    sent = old.clone()
    flat.relocate()
    assert flat.segments[0].data_ptr() != old.data_ptr() and torch.equal(flat.segments[0], sent)
    for place in flat.places:
        assert inside(place.tensor, flat.segments[0])
    assert second.running_mean is first.running_mean
    model[0].weight.grad = torch.ones(3, 3)
    optimizer.step()  # an optimizer built before the move updates the new memory
    flat.segments[0].add_(1.0)
    assert torch.equal(old, sent)  # what was handed to ZeroMQ from the old memory is unchanged
    assert torch.equal(model[0].weight.reshape(-1), sent[offset_in(model[0].weight, flat.segments[0]):][:9])


@pytest.mark.parametrize("make,expected", [
    (lambda: torch.nn.Linear(4, 2, device="meta"), "the model's weight is on the meta device (it holds no values)"),
    (lambda: _with_parameter(torch.zeros(3, dtype=torch.complex64)), "the model's extra is complex (torch.complex64)"),
])
def test_a_tensor_gossip_cannot_average_is_refused_not_left_out(make, expected):
    with pytest.raises(ConfigError) as raised:
        FlatParams(make(), 1 << 20)
    assert str(raised.value).startswith(expected), raised.value


def _with_parameter(value: torch.Tensor) -> torch.nn.Module:
    model = torch.nn.Linear(4, 2)
    model.extra = torch.nn.Parameter(value)
    return model

"""The flat parameter buffer: a model's parameters as views into one contiguous tensor per dtype.

At attach time every parameter (and every floating-point buffer, such as BatchNorm's running statistics)
is copied into one contiguous tensor per (dtype, device) and re-pointed as a view into it. The Parameter
objects stay the same, so an optimizer built before or after keeps working. Sending is then a handful of
zero-copy frames, and mixing is one fused ``add_`` per neighbour and frame instead of a Python loop over
tensors. Integer buffers (``num_batches_tracked``) are left alone: they are counters, not weights. A
complex tensor, or one on the meta device (no values yet), is refused in one line rather than left out.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from gossip.errors import ConfigError
from gossip.net.wire import DTYPES, Layout

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MIX_BLOCK_BYTES = 2 << 20  # fits the cache with the terms' blocks; measured best of 0.25-8 MiB here


class FlatParams:
    """Owns the flat segments of ``model``; ``segments[i]`` is a 1-D tensor of ``layout.dtypes[i]``."""

    def __init__(self, model: nn.Module, chunk_bytes: int) -> None:
        entries, aliases = _averaged_tensors(model)
        if not entries:
            raise ConfigError("the model has no floating-point parameters or buffers to average")
        groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Module, str, torch.Tensor]]] = {}
        for entry in entries:
            tensor = entry[3]
            groups.setdefault((tensor.dtype, tensor.device), []).append(entry)
        if len({device for _, device in groups}) > 1:
            raise ConfigError("the model's tensors live on several devices; move the model to one device first")
        self.segments: list[torch.Tensor] = []
        self.places: list[Place] = []  # where each tensor lives in the segments, in layout order
        owners: dict[int, int] = {}  # id of the original tensor -> index of its place
        for (dtype, device), members in groups.items():
            flat = torch.empty(sum(t.numel() for *_, t in members), dtype=dtype, device=device)
            offset = 0
            for _, module, attr, tensor in members:
                flat[offset:offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
                owners[id(tensor)] = len(self.places)
                self.places.append(Place(len(self.segments), offset, offset + tensor.numel(), module, attr))
                offset += tensor.numel()
            self.segments.append(flat)
        # a buffer shared by two modules must stay shared
        self._aliases = [(module, attr, owners[id(tensor)]) for module, attr, tensor in aliases]
        self._point_tensors()
        self.model = model
        self.device = self.segments[0].device
        self.chunk_bytes = chunk_bytes
        self.layout = Layout.describe(
            [(name, tuple(t.shape), _DTYPE_NAMES[t.dtype]) for name, _, _, t in entries],
            [_DTYPE_NAMES[s.dtype] for s in self.segments], [s.numel() for s in self.segments], chunk_bytes)
        self.plan = self.layout.frame_plan(chunk_bytes)

    @property
    def parameters(self) -> list[Place]:
        return [place for place in self.places if place.is_parameter]

    @property
    def buffers(self) -> list[Place]:
        return [place for place in self.places if not place.is_parameter]

    def gradient_snapshot(self) -> list[torch.Tensor]:
        """The parameters' gradients (zeros where a parameter has none) and the buffers' current values,
        cut like ``snapshot()``. It is written into one buffer reused by every call: send it before the
        next call (the parameter-server worker waits for the server's reply, so it always has)."""
        if not hasattr(self, "_gradients"):
            self._gradients = [torch.empty_like(s, device="cpu", pin_memory=self.device.type == "cuda")
                               for s in self.segments]
        for place in self.places:
            target = self._gradients[place.segment][place.start:place.stop]
            source = place.tensor.grad if place.is_parameter else place.tensor
            if source is None:
                target.zero_()
            else:
                target.copy_(source.detach().reshape(-1), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return [self._gradients[segment][start:stop] for segment, start, stop in self.plan]

    def point_gradients_into(self) -> list[torch.Tensor]:
        """Give every parameter a ``.grad`` that is a view into new flat segments, returned cut like
        ``snapshot()``: writing a flat gradient there is what an optimizer then steps with."""
        flat = [torch.zeros_like(s) for s in self.segments]
        for place in self.parameters:
            place.tensor.grad = flat[place.segment][place.start:place.stop].view_as(place.tensor)
        return [flat[segment][start:stop] for segment, start, stop in self.plan]

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.segments)

    def views(self) -> Iterator[torch.Tensor]:
        """The live buffers cut as the wire cuts them: one view per payload frame."""
        for segment, start, stop in self.plan:
            yield self.segments[segment][start:stop]

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the current weights on the host, one tensor per payload frame, safe to send uncopied.

        One allocation per frame (not one big block) so that glibc serves them from its heap; on a GPU
        the copies go to pinned memory with ``non_blocking`` and are awaited once.
        """
        if self.device.type == "cpu":
            return [view.clone() for view in self.views()]
        copies = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                  for v in self.views()]
        torch.cuda.current_stream(self.device).synchronize()
        return copies

    def relocate(self) -> list[torch.Tensor]:
        """Move the weights to fresh segments (a copy) and re-point every parameter and buffer there. The
        old segments are left to whoever still reads them (ZeroMQ sending them), unchanged from now on;
        returned cut like ``views()``."""
        old = list(self.views())
        self.segments = [segment.clone() for segment in self.segments]
        self._point_tensors()
        return old

    def _point_tensors(self) -> None:
        """Make every parameter and buffer, and every further module holding one, a view into the segments."""
        views = []
        for place in self.places:
            view = self.segments[place.segment][place.start:place.stop].view(place.tensor.shape)
            _repoint(place.module, place.attr, view)
            views.append(view)
        for module, attr, index in self._aliases:
            _repoint(module, attr, views[index])

    def combine_(self, terms: list[tuple[float, list[torch.Tensor]]], snapshot: bool = False,
                 into: list[torch.Tensor] | None = None,
                 release: list[list[torch.Tensor | None]] = ()) -> list[torch.Tensor] | None:
        """weights += sum(alpha * chunks for alpha, chunks in terms); with ``snapshot``, also return a copy
        of the result as ``snapshot()`` would, written ``into`` those chunks when given (on the CPU; they
        may be one of the terms: each block of it is read before it is overwritten). The first term may
        be the weights themselves (``views()``), which scales them; a later one would see them already
        changed. Each list in ``release`` (received messages' chunks, also among the terms) gives up its
        chunk for a frame as soon as that frame is mixed, so a message's memory goes back to the heap
        during the mix, for the messages of the next round that arrive meanwhile.

        On the CPU this goes block by block (``MIX_BLOCK_BYTES``): every term is added to a block while it
        is still in cache, and the snapshot copies it from there, instead of one pass over the whole model
        per term plus one more for the copy (measured: 47 instead of 60 ms for a 100 MiB model with two
        neighbours).
        """
        if self.device.type != "cpu":
            for alpha, chunks in terms:
                self.add_(chunks, alpha)
            for chunks in release:
                chunks[:] = [None] * len(chunks)
            return self.snapshot() if snapshot else None
        copies = []
        for index, view in enumerate(self.views()):
            copy = (torch.empty_like(view) if into is None else into[index]) if snapshot else None
            block = max(1, MIX_BLOCK_BYTES // view.element_size())
            for start in range(0, view.numel(), block):
                target = view[start:start + block]
                for alpha, chunks in terms:
                    target.add_(chunks[index][start:start + block], alpha=alpha)
                if copy is not None:
                    copy[start:start + block].copy_(target)
            copies.append(copy)
            for chunks in release:
                chunks[index] = None
        return copies if snapshot else None

    def add_(self, chunks: list[torch.Tensor], alpha: float) -> None:
        """weights += alpha * chunks (chunks cut by ``plan``, on any device)."""
        for view, chunk in zip(self.views(), chunks, strict=True):
            view.add_(chunk.to(self.device, non_blocking=True), alpha=alpha)

    def copy_(self, chunks: list[torch.Tensor]) -> None:
        for view, chunk in zip(self.views(), chunks, strict=True):
            view.copy_(chunk)


class Place:
    """Where one parameter or buffer lives: ``segments[segment][start:stop]``."""

    def __init__(self, segment: int, start: int, stop: int, module: nn.Module, attr: str) -> None:
        self.segment, self.start, self.stop = segment, start, stop
        self.module, self.attr = module, attr
        self.is_parameter = attr in module._parameters

    @property
    def tensor(self) -> torch.Tensor:
        return self.module._parameters[self.attr] if self.is_parameter else self.module._buffers[self.attr]


def _averaged_tensors(model: nn.Module) -> tuple[list[tuple[str, nn.Module, str, torch.Tensor]],
                                                  list[tuple[nn.Module, str, torch.Tensor]]]:
    """(qualified name, owner module, attribute, tensor) for every tensor to average, tied ones once; and
    (module, attribute, tensor) for every further place a tied tensor is registered."""
    seen: set[int] = set()
    entries = []
    aliases = []
    for module_name, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(module, kind).items():
                name = f"{module_name}.{attr}".lstrip(".")
                if tensor is not None and tensor.is_meta:
                    raise ConfigError(f"the model's {name} is on the meta device (it holds no values): create "
                                      "its weights (e.g. model.to_empty(device=...) and initialise them) before "
                                      "attaching")
                if tensor is not None and tensor.is_complex():
                    raise ConfigError(f"the model's {name} is complex ({tensor.dtype}); gossip averages real "
                                      "tensors: store it as a real one (torch.view_as_real) in the model")
                if tensor is None or tensor.dtype not in _DTYPE_NAMES:
                    continue
                if id(tensor) in seen:
                    aliases.append((module, attr, tensor))
                    continue
                seen.add(id(tensor))
                entries.append((name, module, attr, tensor))
    return entries, aliases


def _repoint(module: nn.Module, attr: str, view: torch.Tensor) -> None:
    if attr in module._parameters:
        module._parameters[attr].data = view  # same Parameter object, new storage
    else:
        module._buffers[attr] = view

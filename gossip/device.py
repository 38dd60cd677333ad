"""``--device``: which device a peer computes on. CPU and GPU peers mix in one swarm, because weights
travel as host bytes: a GPU peer copies its snapshot into pinned host memory with ``non_blocking`` and
copies what it receives back onto the GPU (``gossip.flat``)."""

from __future__ import annotations

import torch

from gossip.errors import ConfigError


def resolve_device(spec: str, local_rank: int) -> torch.device:
    """``auto``: the GPU ``local_rank`` mod the number of GPUs when torch sees one, else the CPU; ``cuda``:
    the same but a GPU is required; ``cuda:I``: GPU I; ``cpu``. Selects the GPU as the current device."""
    if spec == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        if spec == "auto":
            return torch.device("cpu")
        raise ConfigError(f"--device {spec}: torch sees no GPU on this host (torch.cuda.is_available() is False); "
                          "use --device cpu or auto")
    index = local_rank % count if spec in ("auto", "cuda") else int(spec.partition(":")[2])
    if index >= count:
        raise ConfigError(f"--device {spec}: this host has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict on the CPU, so that a GPU peer's saved model loads on any host."""
    return {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}

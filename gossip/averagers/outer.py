"""The outer step of decentralized DiLoCo: each gossip peer's own outer optimizer on the change its mixing
points make.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023)
keeps one set of global weights theta; every worker starts H inner steps from theta, the server averages
their weights and treats delta = theta - mean as a pseudo-gradient for an outer Nesterov step
(``gossip/coordinator/averaging.py``). Without a server there is no global theta: peer i keeps an anchor
a_i (its weights right after its last outer step) and its own outer momentum m_i. At each mixing point
it mixes with its neighbours by gossip-sync's rules (``sync.py``: the push-sum weights w_i are untouched by
what follows), which gives z_i, and then

    delta_i = a_i - z_i,    m_i <- mu m_i + delta_i,
    z_i <- a_i - eta (delta_i + mu m_i)    (Nesterov, PyTorch's form; plain momentum: a_i - eta m_i),
    a_i <- z_i.

With eta 1 and mu 0 the step gives z_i back: local-steps gossip, so those settings build no ``OuterStep``
(``gossip.api.gossip_outer``, by the rule that makes ps-avg's server plainly average). NoLoCo
(Kolehmainen et al., arXiv 2506.10911; its authors' code, ``sparse_optimizer_c.py`` of jkolehm/noloco)
averages each replica with a random group per outer step; written out, its update is m_i <- mu m_i + eta
(mean of the group's current weights - a_i), a_i <- a_i + m_i: the same pseudo-gradient (a gossip mix is
a weighted mean of the neighbours' weights) with heavy-ball momentum where this uses Nesterov's, as
OpenDiLoCo and the server's outer step do, so one outer optimizer means the same on the server and over
gossip. The anchor and the momentum cost two copies of
the model's floating-point tensors; both are saved in the checkpoint.

Where it applies: the lockstep mix of gossip-sync (fixed deadlines, no ``--weight-by``), not overlapped
(the step needs this mixing point's weights of the neighbours), plain or compressed (``compressed.py``:
the step follows CHOCO's consensus step). There every push-sum weight stays 1 and
W is doubly stochastic, so sum_i delta_i is what the peers' inner steps did and the outer step moves the
network's mean as DiLoCo's server would (on the consensus task, which has no inner steps, the mean held
to 8e-14 with Nesterov). Where the weights vary (adaptive deadlines, gossip-async push-sum) a peer's
z_i = x_i / w_i is a weighted mean and sum_i w_i delta_i no longer cancels: on the consensus task
(``python -m launch --nodes 4 --task consensus --steps 100 --compute-ms 5 ...``) outer SGD with lr 0.7 moved
gossip-async's mean by 0.33, and Nesterov (0.7, 0.9) made gossip-async and adaptive gossip-sync diverge
(consensus distances 6e4 and 4e4). A push-sum outer step would have to mix the anchors (and momenta)
with the same weights, which doubles what a message carries; NoLoCo sends both, to one partner.
"""

from __future__ import annotations

from typing import Any

import torch

from gossip.errors import CheckpointError
from gossip.flat import FlatParams


class OuterStep:
    def __init__(self, flat: FlatParams, name: str, lr: float, momentum: float) -> None:
        if name not in ("sgd", "nesterov"):
            raise ValueError(f"no outer optimizer {name!r}")
        self.flat, self.name, self.lr, self.momentum = flat, name, float(lr), float(momentum)
        self.anchor: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []
        self.steps = 0
        self.reanchor()

    def reanchor(self) -> None:
        """The current weights are the anchor (at the start, and after a restarted peer took its
        neighbours' models): the next outer step measures the change from them."""
        self.anchor = [segment.detach().clone() for segment in self.flat.segments]

    def apply_(self) -> None:
        """One outer step on the weights just mixed (see the module docstring)."""
        weights = list(self.flat.segments)
        with torch.no_grad():
            delta = torch._foreach_sub(self.anchor, weights)
            if self.momentum:
                if not self.buffers:
                    self.buffers = [torch.zeros_like(d) for d in delta]
                torch._foreach_mul_(self.buffers, self.momentum)
                torch._foreach_add_(self.buffers, delta)
                step = torch._foreach_add(delta, self.buffers, alpha=self.momentum) if self.name == "nesterov" \
                    else self.buffers
            else:
                step = delta
            for weight, anchor, change in zip(weights, self.anchor, step, strict=True):
                torch.add(anchor, change, alpha=-self.lr, out=weight)
            torch._foreach_copy_(self.anchor, weights)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": [a.cpu() for a in self.anchor], "momentum": [b.cpu() for b in self.buffers],
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's outer state, checked against this model first (one line when it does not fit)."""
        anchor, momentum = state.get("anchor"), state.get("momentum", [])
        shapes = [(s.dtype, s.numel()) for s in self.flat.segments]
        for name, tensors in (("anchor", anchor), ("momentum", momentum)):
            if name == "momentum" and not tensors:
                continue
            if not isinstance(tensors, list) or [(t.dtype, t.numel()) if isinstance(t, torch.Tensor) else None
                                                 for t in tensors] != shapes:
                raise CheckpointError(f"the checkpoint's outer {name} does not fit this model's "
                                      f"{len(shapes)} flat segment(s) {shapes}")
            if not all(bool(torch.isfinite(t).all()) for t in tensors):
                raise CheckpointError(f"the checkpoint's outer {name} holds NaN or Inf")
        device = self.flat.device
        self.anchor = [t.to(device).clone() for t in anchor]
        self.buffers = [t.to(device).clone() for t in momentum]
        self.steps = int(state.get("steps", 0))

"""Which update rules reach the right model when workers run at different speeds: an event-driven simulation.

    python bench/rate_fairness.py    # plain numpy, deterministic, about 30 seconds

Six workers; worker i minimises f_i(x) = 0.5 |x - b_i|^2 with its own target b_i (in R^10, seeded normal
draws) and exact gradients g_i(x) = x - b_i. The right model is mean b, the minimiser of (1/N) sum_i f_i. A
step of worker i takes (1 +- 10 %) / r_i (uniform, a seeded stream per worker, the same for every rule), with
rates r = 1, 1, 1, 1, 1, 1/4 (worker 5 four times slower) or all 1. The error of a model x is
|x - mean b| / (the rms distance of the b_i from mean b): 1 is as far off as a typical worker's own optimum
(b_5 is at 0.965), and unlike |mean b| the scale does not depend on where the origin lies. Every number is a
mean over 8 seeds of the step times. Each rule runs at lr with S = 400 steps per worker, then at lr / 4 with
4 S: a constant-step bias that is O(lr) shows a ratio of the two errors near 4, a wrong fixed point a ratio
near 1. "fixed point" is where the rule goes as lr -> 0, sum_i c_i b_i / sum_i c_i with c_i how much worker
i's gradients count per unit of time; "its err" is that point's error, "lr/4 to it" how far (same scale) the
lr / 4 run ended from it.

A. An asynchronous parameter server without momentum or network delay. A worker pulls the server's weights,
computes its gradient for one step time and sends it; the server applies it on arrival, stale by whatever the
others applied meanwhile. 1. each worker stops after its own S steps; 2. a swarm budget: everybody stops once
N S gradients were applied in all; 3. as 2., with worker i's gradient scaled by rbar / r_i (rbar the mean
rate), with the true rates or with r_i = 1 / an EMA (weight 0.1) of the step times the server sees (pull to
arrival); 4. as 2., the server keeping every worker's latest gradient (zero before its first) and stepping
with their mean at every arrival (SAG; MIFA, Gu et al. 2021).

B. Asynchronous push-sum on a ring (SGP, Assran et al. 2019; asynchronous gradient push, Assran & Rabbat
2020). Peer i holds (x_i, w_i), w_i = 1 at the start, its model is z_i = x_i / w_i. When a step ends it adds
everything that arrived since its last step (every message is mixed exactly once), steps with the gradient
at the model the step started from, keeps a third of (x_i, w_i) and sends a third to each ring neighbour,
arriving 0.05 later. The run's model is sum x / sum w (sum w = N: asserted in every run). Two ways to step:
x_i -= lr g_i (SGP's, and gossip-async's today: the network's mass moves alike for every step, z_i by
lr g_i / w_i) and x_i -= lr w_i g_i (a plain step z_i -= lr g_i, w_i after mixing in). Rules 1-3 as for the
server, 3. scaling each step by rbar / r_i (true rates), 1. with today's end: a finished peer is sent nothing
more (its neighbours keep that share) and keeps its mass and what was in flight to it. "window" adds
gossip-async's flow control: a peer sends to a neighbour only if it heard from it since its last message
there, else keeps that share, so a link carries about one message per step of its slower end. w_5 is peer
5's mean weight at its steps, right after mixing in.

A. Asynchronous parameter server, lr 0.08 with S = 400 steps, then 0.02 with 4 S

| rule | speeds | err lr, S | err lr/4, 4S | ratio | fixed point | its err | lr/4 to it |
| --- | --- | --- | --- | --- | --- | --- | --- |
| 1. own quota | equal | 0.171 | 0.0794 | 2.15 | mean b | 4.59e-17 | 0.079 |
| 1. own quota | r_5 = 1/4 | 0.965 | 0.965 | 1.00 | b_5, trained alone | 0.965 | 3.2e-11 |
| 2. swarm budget | equal | 0.0606 | 0.0209 | 2.89 | mean b | 4.59e-17 | 0.021 |
| 2. swarm budget | r_5 = 1/4 | 0.158 | 0.141 | 1.12 | sum r b / sum r | 0.138 | 0.014 |
| 3. budget + rbar/r_i (true) | equal | 0.0606 | 0.0209 | 2.89 | mean b | 4.59e-17 | 0.021 |
| 3. budget + rbar/r_i (true) | r_5 = 1/4 | 0.114 | 0.0208 | 5.48 | mean b | 4.59e-17 | 0.021 |
| 3. budget + rbar/r_i (EMA) | equal | 0.0604 | 0.0197 | 3.07 | mean b | 4.59e-17 | 0.02 |
| 3. budget + rbar/r_i (EMA) | r_5 = 1/4 | 0.113 | 0.0212 | 5.34 | mean b | 4.59e-17 | 0.021 |
| 4. budget + memory | equal | 2.09e-16 | 8.57e-16 | 0.24 | mean b | 4.59e-17 | 8.7e-16 |
| 4. budget + memory | r_5 = 1/4 | 1.58e-16 | 7.4e-16 | 0.21 | mean b | 4.59e-17 | 7.5e-16 |

B. Asynchronous push-sum on a ring, lr 0.05 with S = 400 steps, then 0.0125 with 4 S

B, x_i -= lr g_i: the mass moves by every step alike, z_i by lr g_i / w_i (SGP's step)

| rule | speeds | err lr, S | err lr/4, 4S | ratio | fixed point | its err | lr/4 to it | w_5 |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 1. own quota | equal | 0.0183 | 0.00876 | 2.08 | mean b | 4.59e-17 | 0.0088 | 1.43 |
| 1. own quota | r_5 = 1/4 | 0.423 | 0.469 | 0.90 | (others' x + w_5 b_5) / N | 0.477 | 0.0075 | 3.43 |
| 2. swarm budget | equal | 0.00715 | 0.00259 | 2.76 | mean b | 4.59e-17 | 0.0026 | 1.43 |
| 2. swarm budget | r_5 = 1/4 | 0.125 | 0.133 | 0.93 | sum r b / sum r | 0.138 | 0.0097 | 3.68 |
| 3. budget + rbar/r_i | equal | 0.00715 | 0.00259 | 2.76 | mean b | 4.59e-17 | 0.0026 | 1.43 |
| 3. budget + rbar/r_i | r_5 = 1/4 | 0.0345 | 0.00853 | 4.05 | mean b | 4.36e-17 | 0.0085 | 3.68 |
| 1. own quota, window | r_5 = 1/4 | 0.165 | 0.162 | 1.01 | (others' x + w_5 b_5) / N | 0.162 | 3.1e-05 | 1.64 |
| 2. swarm budget, window | r_5 = 1/4 | 0.128 | 0.135 | 0.95 | sum r b / sum r | 0.138 | 0.0051 | 1.66 |
| 3. budget + rbar/r_i, window | r_5 = 1/4 | 0.0143 | 0.00282 | 5.08 | mean b | 4.36e-17 | 0.0028 | 1.66 |

B, x_i -= lr w_i g_i: a plain step on z_i (w_i after mixing in the inbox)

| rule | speeds | err lr, S | err lr/4, 4S | ratio | fixed point | its err | lr/4 to it | w_5 |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 1. own quota | equal | 0.0277 | 0.0129 | 2.14 | mean b | 4.59e-17 | 0.013 | 1.43 |
| 1. own quota | r_5 = 1/4 | 0.49 | 0.535 | 0.91 | (others' x + w_5 b_5) / N | 0.535 | 1.5e-07 | 3.43 |
| 2. swarm budget | equal | 0.00925 | 0.00263 | 3.51 | mean b | 4.59e-17 | 0.0026 | 1.43 |
| 2. swarm budget | r_5 = 1/4 | 0.0404 | 0.0111 | 3.65 | mean b | 4.59e-17 | 0.011 | 3.68 |
| 3. budget + rbar/r_i | equal | 0.00925 | 0.00263 | 3.51 | mean b | 4.59e-17 | 0.0026 | 1.43 |
| 3. budget + rbar/r_i | r_5 = 1/4 | 0.316 | 0.319 | 0.99 | sum b/r / sum 1/r | 0.322 | 0.0051 | 3.68 |
| 1. own quota, window | r_5 = 1/4 | 0.178 | 0.177 | 1.01 | (others' x + w_5 b_5) / N | 0.177 | 8e-08 | 1.64 |
| 2. swarm budget, window | r_5 = 1/4 | 0.106 | 0.115 | 0.92 | sum r W b / sum r W | 0.118 | 0.0071 | 1.66 |
| 3. budget + rbar/r_i, window | r_5 = 1/4 | 0.0502 | 0.0534 | 0.94 | sum r W b / sum r W | 0.0579 | 0.0055 | 1.66 |

error = |model - mean b| / 2.703 (the rms distance of the b_i from mean b), a mean over 8 timing seeds;
b_5 has error 0.965; w_5 = W_5: peer 5's mean weight at its steps, at lr/4

What the numbers say for the parameter server. Own quotas end at the slow worker's optimum, 0.965 at both
learning rates: worker 5 trains alone for the last 3 S of its steps. Even at equal speeds the last worker
trains alone for a few steps, and as the spread of finishing times grows like sqrt(S) the error falls only
about as sqrt(lr) (ratio 2.15). A swarm budget removes the end but not the rates: the runs end 0.014 from
sum r b / sum r (error 0.138, a seventh of b_5's) at both learning rates. Inverse-rate weights reach mean b
with an O(lr) bias (ratio 5.5), and rates measured from step times do as well as the true ones. Memory reaches
it exactly (1e-16; ratios of rounding errors mean nothing): at a fixed point every stored gradient was taken
at the same weights, so staleness costs nothing. Build memory: no bias at any learning rate, no rate to
estimate, and no gradient amplified (rbar / r_i makes the slow worker's stale gradient 3.5 times larger, and
its jumps are what is left at the end: 0.11 at lr 0.08 against 0.06 at equal speeds). Its price is N stored
gradients at the server, and a worker that leaves must have its gradient dropped (the mean taken over those
present), or it pulls forever. Inverse-rate weights with measured rates are the cheap alternative.

What the numbers say for gossip. With SGP's step a swarm budget alone ends at the rate-weighted mean (0.133
and 0.135 against 0.138 predicted, ratios 0.93 and 0.95, without and with the window): the network's mass
moves by lr g_i at every step, whoever takes it, so a peer counts by its rate. Scaling each step by
rbar / r_i leaves an O(lr) bias (ratios 4.05 and 5.08), however the mass is spread (w_5 = 3.68 without the
window, 1.66 with it). The plain step on z_i needs no rate scaling in push-sum without the window, by a
balance of mass: a peer sends two thirds of its mass per own step and gets a third of each neighbour's per
theirs, and as the ring's mixing matrix is doubly stochastic the mass at a step settles where r_i W_i is the
same for all (0.25 x 3.68 = 0.92, the fast peers' W), so every peer counts alike (ratio 3.65). That balance is
fragile: scaled by rbar / r_i as well it corrects twice (sum b/r / sum 1/r, 0.32), and the window, which
holds w_5 near 1.7 against the others' 1.2, makes it count by r_i W_i (0.115, and 0.053 scaled, neither
falling with lr). Build: keep x_i -= lr g_i (no scaling by w_i), stop on a swarm budget and scale each step by
rbar / r_i; only the ratios between peers matter for the fixed point, so any constant common to all peers,
over r_i, does (rbar keeps the mean step size). A swarm budget alone is not enough. With own quotas the slow
peer trains alone to b_5 but moves only its own mass, so the model ends at (others' x + w_5 b_5) / N: with
SGP's step 0.16 with the window and 0.47 without it (w_5 ends at 1.7 and 3.2), less harm than the server's
0.965, but a wrong fixed point all the same.

At equal speeds the ratios are 2.1 (own quotas, above) and 2.8 to 3.5 rather than 4: the jitter makes where
each run stops random, and 8 seeds do not average that out. With JITTER = 0 the server's swarm-budget errors
at equal speeds are 0.0335, 0.00854 and 0.00215 at lr 0.08, 0.02 and 0.005 (ratios 3.9 and 4.0), and
push-sum with SGP's step stays at mean b to 1e-9.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np

PEERS = 6
DIM = 10
SEED = 0  # draws the targets b_i
TIMING_SEEDS = range(8)  # every number is a mean over these draws of the step times
STEPS = 400  # S: each worker's quota at the larger learning rate (4 S at a quarter of it)
JITTER = 0.1  # a step takes (1 +- JITTER) / rate, uniform: equal-speed workers drift out of lockstep
DELAY = 0.05  # a gossip message arrives this long after it is sent (a twentieth of a fast step)
EMA = 0.1  # weight of the newest step time in a measured rate
SPEEDS = {"equal": np.ones(PEERS), "r_5 = 1/4": np.array([1, 1, 1, 1, 1, 0.25])}
SERVER_LR = 0.08
GOSSIP_LR = 0.05
KEEP = 1 / 3  # push-sum on the ring: keep a third of (x, w), send a third to each neighbour


@dataclass(frozen=True)
class Problem:
    targets: np.ndarray  # b_i, one row per worker: f_i(x) = 0.5 |x - b_i|^2

    @classmethod
    def seeded(cls, seed: int) -> Problem:
        return cls(np.random.default_rng(seed).normal(size=(PEERS, DIM)))

    def gradient(self, worker: int, x: np.ndarray) -> np.ndarray:
        return x - self.targets[worker]

    def weighted_optimum(self, weights: np.ndarray) -> np.ndarray:
        """The minimiser of sum_i weights_i f_i: where a rule that weighs worker i by weights_i ends."""
        return weights @ self.targets / weights.sum()

    @property
    def optimum(self) -> np.ndarray:
        return self.targets.mean(axis=0)

    @property
    def spread(self) -> float:
        """The root mean square distance of the workers' own optima from the right model."""
        return float(np.sqrt(((self.targets - self.optimum) ** 2).sum(axis=1).mean()))

    def error(self, x: np.ndarray) -> float:
        """|x - mean b| / spread: 1 is as far off as a typical worker's own optimum. (Dividing by |mean b|
        would make the error depend on where the origin happens to lie.)"""
        return float(np.linalg.norm(x - self.optimum)) / self.spread


class StepClock:
    """How long each step of each worker takes: a seeded stream per worker, so every rule sees the same
    sequence of step times and the rules differ only in what they do with the gradients."""

    def __init__(self, rates: np.ndarray, seed: int) -> None:
        self.rates = rates
        self.streams = [np.random.default_rng([seed, worker]) for worker in range(len(rates))]

    def duration(self, worker: int) -> float:
        return (1.0 + JITTER * self.streams[worker].uniform(-1, 1)) / self.rates[worker]


def describe(weights: np.ndarray, rates: np.ndarray) -> str:
    """The fixed point sum_i weights_i b_i / sum_i weights_i in words."""
    if np.count_nonzero(weights) == 1:
        return f"b_{int(np.flatnonzero(weights)[0])}, trained alone"
    if np.allclose(weights, weights[0]):
        return "mean b"
    if np.allclose(weights / rates, weights[0] / rates[0]):
        return "sum r b / sum r"
    if np.allclose(weights * rates, weights[0] * rates[0]):
        return "sum b/r / sum 1/r"
    return "sum r W b / sum r W"  # W_i: peer i's mean weight at its steps, measured


# ---- A. asynchronous parameter server -----------------------------------------------------------------------

Direction = Callable[[int, np.ndarray, float], np.ndarray]  # (worker, its gradient, its step time) -> step


def plain(rates: np.ndarray) -> Direction:
    return lambda worker, gradient, step_time: gradient


def inverse_true_rate(rates: np.ndarray) -> Direction:
    """Worker i's gradient times rbar / r_i: r_i of them arrive per second, so each worker counts rbar."""
    scale = rates.mean() / rates
    return lambda worker, gradient, step_time: scale[worker] * gradient


def inverse_measured_rate(rates: np.ndarray) -> Direction:
    """As ``inverse_true_rate``, with r_i = 1 / (an EMA of worker i's step times, pull to arrival), all
    the server can know."""
    step_times = np.full(len(rates), np.nan)  # nan until the worker's first gradient

    def direction(worker: int, gradient: np.ndarray, step_time: float) -> np.ndarray:
        previous = step_times[worker]
        step_times[worker] = step_time if np.isnan(previous) else (1 - EMA) * previous + EMA * step_time
        known_rates = 1.0 / step_times[~np.isnan(step_times)]
        return known_rates.mean() * step_times[worker] * gradient

    return direction


def memory(rates: np.ndarray) -> Direction:
    """SAG / MIFA (Gu et al. 2021): step with the mean of every worker's latest gradient (zero until its
    first), so each worker counts 1/N at every step, however often it reports."""
    latest = np.zeros((len(rates), DIM))

    def direction(worker: int, gradient: np.ndarray, step_time: float) -> np.ndarray:
        latest[worker] = gradient
        return latest.mean(axis=0)

    return direction


@dataclass(frozen=True)
class ServerRule:
    name: str
    swarm_budget: bool  # the run ends after N S gradients in all; else each worker stops after its S
    make_direction: Callable[[np.ndarray], Direction]
    fixed_point_weights: Callable[[np.ndarray], np.ndarray]  # rates -> how the fixed point weighs each b_i


def alone_at_the_end(rates: np.ndarray) -> np.ndarray:
    """Own quotas: the slowest worker trains alone long after the others stopped, so it ends at its own
    optimum (with equal speeds all stop within a few steps of each other)."""
    return np.eye(len(rates))[np.argmin(rates)] if rates.min() < rates.max() else np.ones(len(rates))


SERVER_RULES = [
    ServerRule("1. own quota", False, plain, alone_at_the_end),
    ServerRule("2. swarm budget", True, plain, lambda rates: rates),  # r_i gradients per second
    ServerRule("3. budget + rbar/r_i (true)", True, inverse_true_rate, np.ones_like),
    ServerRule("3. budget + rbar/r_i (EMA)", True, inverse_measured_rate, np.ones_like),
    ServerRule("4. budget + memory", True, memory, np.ones_like),
]


def run_parameter_server(problem: Problem, rates: np.ndarray, rule: ServerRule, lr: float, steps: int,
                         seed: int) -> np.ndarray:
    """The server's weights at the end. A worker pulls, computes its gradient for one step time and sends
    it; the server applies it on arrival, by which time the others have moved the weights (staleness)."""
    clock = StepClock(rates, seed)
    direction = rule.make_direction(rates)
    weights = np.zeros(DIM)
    # one gradient in flight per worker: (arrival time, worker, pull time, gradient at the pulled weights)
    in_flight = [(clock.duration(worker), worker, 0.0, problem.gradient(worker, weights)) for worker in range(PEERS)]
    heapq.heapify(in_flight)
    applied = np.zeros(PEERS, dtype=int)
    while in_flight:
        now, worker, pulled_at, gradient = heapq.heappop(in_flight)
        weights = weights - lr * direction(worker, gradient, now - pulled_at)
        applied[worker] += 1
        if rule.swarm_budget and applied.sum() == PEERS * steps:
            break  # everybody stops at once: nobody trains alone at the end
        if rule.swarm_budget or applied[worker] < steps:
            pull = problem.gradient(worker, weights)
            heapq.heappush(in_flight, (now + clock.duration(worker), worker, now, pull))
    return weights


# ---- B. asynchronous gossip, push-sum ---------------------------------------------------------------------


@dataclass
class PushSumPeer:
    numerator: np.ndarray  # x_i; the peer's model is z_i = x_i / w_i
    weight: float  # w_i
    inbox_numerator: np.ndarray  # what arrived since its last step, mixed at the next one
    inbox_weight: float = 0.0
    steps: int = 0
    mass_at_steps: float = 0.0  # sum of w_i over its steps: how much a step on z_i moves the network's mass

    @property
    def model(self) -> np.ndarray:
        return self.numerator / self.weight

    def receive(self, numerator: np.ndarray, weight: float) -> None:
        self.inbox_numerator = self.inbox_numerator + numerator
        self.inbox_weight += weight

    def absorb(self) -> None:
        self.numerator = self.numerator + self.inbox_numerator
        self.weight += self.inbox_weight
        self.inbox_numerator, self.inbox_weight = np.zeros(DIM), 0.0

    def send_shares(self, count: int) -> tuple[np.ndarray, float]:
        """Give away a KEEP share of (x, w) to each of ``count`` neighbours; the shares not sent stay here."""
        numerator, weight = KEEP * self.numerator, KEEP * self.weight
        self.numerator = self.numerator - count * numerator
        self.weight -= count * weight
        return numerator, weight


@dataclass(frozen=True)
class GossipRule:
    name: str
    swarm_budget: bool  # the run ends after N S local steps in all; else each peer stops after its S
    rate_scaled: bool  # each step times rbar / r_i
    flow_window: bool  # send to a neighbour only once it answered our last message (one per slower step)


GOSSIP_RULES = [
    GossipRule("1. own quota", False, False, False),
    GossipRule("2. swarm budget", True, False, False),
    GossipRule("3. budget + rbar/r_i", True, True, False),
    GossipRule("1. own quota, window", False, False, True),
    GossipRule("2. swarm budget, window", True, False, True),
    GossipRule("3. budget + rbar/r_i, window", True, True, True),
]
STEP_KINDS = {  # does a step scale the gradient g_i(z_i) by the mass w_i?
    "x_i -= lr g_i: the mass moves by every step alike, z_i by lr g_i / w_i (SGP's step)": False,
    "x_i -= lr w_i g_i: a plain step on z_i (w_i after mixing in the inbox)": True,
}


@dataclass(frozen=True)
class PushSumOutcome:
    model: np.ndarray  # sum x / sum w
    peers: list[PushSumPeer]


def ring_neighbours(peer: int) -> tuple[int, int]:
    return (peer - 1) % PEERS, (peer + 1) % PEERS


def run_push_sum(problem: Problem, rates: np.ndarray, rule: GossipRule, mass_scaled: bool, lr: float,
                 steps: int, seed: int) -> PushSumOutcome:
    """At the end of each local step a peer mixes in what arrived, steps, keeps a third of (x, w) and sends a
    third to each ring neighbour still training, arriving DELAY later; the gradient is the one of the model
    it started the step from. Every message is mixed exactly once, so mixing never changes sum x or sum w."""
    clock = StepClock(rates, seed)
    peers = [PushSumPeer(np.zeros(DIM), 1.0, np.zeros(DIM)) for _ in range(PEERS)]
    step_scale = rates.mean() / rates if rule.rate_scaled else np.ones(PEERS)
    unanswered = np.zeros((PEERS, PEERS), dtype=bool)  # [i, k]: k sent i nothing since i's last message to k
    finished = np.zeros(PEERS, dtype=bool)
    order = itertools.count()  # breaks ties in time: first scheduled, first handled
    events = [(clock.duration(peer), next(order), peer, None) for peer in range(PEERS)]  # message None: a step
    while events:
        now, _, target, message = heapq.heappop(events)
        if message is not None:
            sender, numerator, weight = message
            peers[target].receive(numerator, weight)
            unanswered[target, sender] = False
            continue
        peer = peers[target]
        gradient = problem.gradient(target, peer.model)
        peer.absorb()
        peer.numerator = peer.numerator - lr * step_scale[target] * (peer.weight if mass_scaled else 1.0) * gradient
        peer.steps += 1
        peer.mass_at_steps += peer.weight
        # a finished neighbour is sent nothing more (today's "bye", less its delay), and with the window one
        # that has not answered our last message waits: either way that share stays here
        destinations = [k for k in ring_neighbours(target)
                        if not finished[k] and not (rule.flow_window and unanswered[target, k])]
        numerator, weight = peer.send_shares(len(destinations))
        for k in destinations:
            heapq.heappush(events, (now + DELAY, next(order), k, (target, numerator, weight)))
            unanswered[target, k] = True
        if rule.swarm_budget and sum(p.steps for p in peers) == PEERS * steps:
            break  # everybody stops at once
        if rule.swarm_budget or peer.steps < steps:
            heapq.heappush(events, (now + clock.duration(target), next(order), target, None))
        else:
            finished[target] = True  # it keeps its mass and what still arrives
    for _, _, target, message in events:  # the messages in flight land; nobody steps any more
        if message is not None:
            peers[target].receive(message[1], message[2])
    for peer in peers:
        peer.absorb()
    total_weight = sum(peer.weight for peer in peers)
    assert abs(total_weight - PEERS) < 1e-9, "mixing lost or made mass"
    return PushSumOutcome(sum(peer.numerator for peer in peers) / total_weight, peers)


def push_sum_fixed_point(problem: Problem, rates: np.ndarray, rule: GossipRule, mass_scaled: bool,
                         outcome: PushSumOutcome) -> tuple[str, np.ndarray]:
    """Where the weighted mean should end. Each step of peer i moves sum x by lr s_i g_i (times w_i when the
    step is on z_i), r_i times per second; the network's mean is where those moves cancel."""
    if not rule.swarm_budget and rates.min() < rates.max():
        # the others stopped with their mass; the slow peer trains alone to b_slow, carrying its weight w_slow
        slow = int(np.argmin(rates))
        others = sum(peer.numerator for k, peer in enumerate(outcome.peers) if k != slow)
        weight = outcome.peers[slow].weight
        return f"(others' x + w_{slow} b_{slow}) / N", (others + weight * problem.targets[slow]) / PEERS
    per_second = rates * (rates.mean() / rates if rule.rate_scaled else 1.0)
    if mass_scaled and rule.flow_window:
        per_second = per_second * np.array([peer.mass_at_steps / peer.steps for peer in outcome.peers])
    elif mass_scaled:
        # each peer sends 2/3 of its mass per own step and receives a third of each neighbour's per theirs;
        # the ring's mixing matrix is doubly stochastic, so the balance is r_i W_i equal for all
        per_second = per_second / rates
    return describe(per_second, rates), problem.weighted_optimum(per_second)


# ---- the table --------------------------------------------------------------------------------------------

LEARNING_RATES = {"server": (SERVER_LR, SERVER_LR / 4), "gossip": (GOSSIP_LR, GOSSIP_LR / 4)}


@dataclass(frozen=True)
class Trial:
    """One timing seed: the final models at lr with S steps and at lr / 4 with 4 S, and the fixed point
    predicted for the second."""
    models: tuple[np.ndarray, np.ndarray]
    prediction: str
    predicted: np.ndarray


def row(problem: Problem, label: str, speeds: str, trials: list[Trial], *extra: str) -> list[str]:
    """The table's cells, each a mean over the timing seeds."""
    coarse, fine = (np.mean([problem.error(trial.models[k]) for trial in trials]) for k in (0, 1))
    predicted_error = np.mean([problem.error(trial.predicted) for trial in trials])
    off_prediction = np.mean([np.linalg.norm(trial.models[1] - trial.predicted) for trial in trials]) / problem.spread
    return [label, speeds, f"{coarse:.3g}", f"{fine:.3g}", f"{coarse / fine:.2f}", trials[0].prediction,
            f"{predicted_error:.3g}", f"{off_prediction:.2g}", *extra]


def server_trial(problem: Problem, rates: np.ndarray, rule: ServerRule, seed: int) -> Trial:
    models = tuple(run_parameter_server(problem, rates, rule, lr, steps, seed)
                   for lr, steps in zip(LEARNING_RATES["server"], (STEPS, 4 * STEPS)))
    weights = rule.fixed_point_weights(rates)
    return Trial(models, describe(weights, rates), problem.weighted_optimum(weights))


def server_rows(problem: Problem) -> list[list[str]]:
    return [row(problem, rule.name, speeds, [server_trial(problem, rates, rule, seed) for seed in TIMING_SEEDS])
            for rule in SERVER_RULES for speeds, rates in SPEEDS.items()]


def gossip_trial(problem: Problem, rates: np.ndarray, rule: GossipRule, mass_scaled: bool,
                 seed: int) -> tuple[Trial, float]:
    """The trial, and the last peer's (the slow one's) mean weight at its steps at lr / 4."""
    outcomes = [run_push_sum(problem, rates, rule, mass_scaled, lr, steps, seed)
                for lr, steps in zip(LEARNING_RATES["gossip"], (STEPS, 4 * STEPS))]
    prediction, predicted = push_sum_fixed_point(problem, rates, rule, mass_scaled, outcomes[1])
    last = outcomes[1].peers[PEERS - 1]
    return Trial((outcomes[0].model, outcomes[1].model), prediction, predicted), last.mass_at_steps / last.steps


def gossip_rows(problem: Problem, mass_scaled: bool) -> list[list[str]]:
    rows = []
    for rule in GOSSIP_RULES:
        for speeds, rates in SPEEDS.items():
            if rule.flow_window and speeds == "equal":
                continue  # the window holds back a link only where one end is slower
            trials, masses = zip(*(gossip_trial(problem, rates, rule, mass_scaled, seed) for seed in TIMING_SEEDS))
            rows.append(row(problem, rule.name, speeds, list(trials), f"{np.mean(masses):.2f}"))
    return rows


def markdown(header: list[str], lines: list[list[str]]) -> str:
    return "\n".join("| " + " | ".join(line) + " |" for line in [header, ["---"] * len(header), *lines])


def main() -> None:
    problem = Problem.seeded(SEED)
    columns = ["speeds", "err lr, S", "err lr/4, 4S", "ratio", "fixed point", "its err", "lr/4 to it"]
    (server_lr, server_fine), (gossip_lr, gossip_fine) = LEARNING_RATES["server"], LEARNING_RATES["gossip"]
    print(f"A. Asynchronous parameter server, lr {server_lr} with S = {STEPS} steps, then {server_fine} with 4 S\n")
    print(markdown(["rule", *columns], server_rows(problem)))
    print(f"\nB. Asynchronous push-sum on a ring, lr {gossip_lr} with S = {STEPS} steps, then {gossip_fine} with 4 S")
    for step_kind, mass_scaled in STEP_KINDS.items():
        print(f"\nB, {step_kind}\n")
        print(markdown(["rule", *columns, "w_5"], gossip_rows(problem, mass_scaled)))
    print(f"\nerror = |model - mean b| / {problem.spread:.3f} (the rms distance of the b_i from mean b), a mean "
          f"over {len(TIMING_SEEDS)} timing seeds;\nb_5 has error {problem.error(problem.targets[PEERS - 1]):.3f}; "
          "w_5 = W_5: peer 5's mean weight at its steps, at lr/4")


if __name__ == "__main__":
    main()

"""What every averager shares: counting steps, deciding when to mix, the link to the others and statistics.

*When* to mix lives here; *how* to mix lives in each subclass's ``_gossip`` (the split of PyTorch's
model-averaging package). ``step()`` is called by the training thread after each optimizer step, so
parameters only ever change between two steps, never inside a forward/backward pass. Two schedules:

- ``steps``: a mixing point every ``gossip_every`` local steps, so every peer does the same steps per round
  and a slow peer sets the pace of its neighbours.
- ``time``: mixing point r is the first step boundary at least r * ``round_seconds`` after the peer started
  (after its first neighbours answered), plus the time it has spent waiting for neighbours. Rounds are
  wall-clock periods, anchored so an overshoot does not accumulate, and a fast peer does as many local steps
  as fit in each: it never idles for a slow one (node-speed-aware scheduling).
  Waiting shifts the anchor, so peers that came up at different moments fall into phase after one round.
  A peer whose single step outlasts a round mixes after every step.

Every peer measures its own pace (``meter``, a ``SpeedMeter``: seconds per step, samples per second, busy
seconds per round), sends it in every message header, and notes what its neighbours report.

The network is whatever ``Link`` (``gossip/link.py``) the constructor's ``connect`` returns for the
averager's mailbox: by default the ZeroMQ transport the run's configuration describes
(``gossip/connect.py connector``); the unit tests pass an in-memory one.

What gossip adds (neighbours, hellos, liveness, rejoining) is ``GossipAverager`` in ``neighbours.py``; the
parameter-server worker builds on ``Averager`` directly.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
from abc import ABC, abstractmethod
from typing import Any

from gossip.config import GossipConfig
from gossip.connect import connector
from gossip.errors import ConfigError, Diverged, GossipError, PeerFailed
from gossip.flat import FlatParams
from gossip.health import model_problem
from gossip.link import Connect, Link
from gossip.mailbox import Mailbox
from gossip.metrics import SpeedMeter
from gossip.naming import as_keywords
from gossip.net.wire import abort_header, encode
from gossip.progress import SwarmProgress

log = logging.getLogger("gossip.averager")
ABORT_FLUSH_SECONDS = 1.0  # how long a peer that stops the run waits for its "abort" to leave


class Averager(ABC):
    """Averages one model's flat parameters with neighbours; use as a context manager or ``close()``.

    It has this many methods because it is the skeleton every mode fills in: the user's API (``start``,
    ``step``, ``close``, ``statistics``, ...), the hooks a mode overrides (how to greet, mix, finish and
    rejoin) and the steps of the schedule between them."""

    sends_gradients = False  # True for parameter-server workers that send gradients instead of stepping
    keyword_errors = False  # errors name ``attach``'s keyword arguments instead of flags (``gossip/naming.py``)
    progress: SwarmProgress | None = None  # gossip-async: the swarm's steps as we know them (gossip/progress.py)

    def __init__(self, flat: FlatParams, config: GossipConfig, connect: Connect | None = None) -> None:
        """``connect(mailbox)``: the link to the others, delivering into our mailbox (default: ZeroMQ's)."""
        self.flat = flat
        self.config = config
        self.rank = config.rank
        self.local_step = 0
        self.rounds = 0  # completed mixes
        self.mixing_points = 0  # calls of _gossip so far
        self.samples = 0
        self._mixed_at = (0, 0)  # (local_step, samples) at the last mixing point
        self._anchor = self._round_began = time.monotonic()  # reset when start() returns
        self.meter = SpeedMeter()  # our own pace
        self.wait_seconds = 0.0  # blocked on neighbours
        self._waited_at_tick = 0.0
        self.mix_seconds = 0.0
        self.resumed_at: int | None = None  # the round we rejoined the others in, after --resume
        self.mailbox = self._make_mailbox()
        self.mailbox.peer_timeout = config.timeouts.peer_timeout
        if not config.parameter_server:  # (a server's version counts every worker's updates)
            self.mailbox.max_rounds, self.mailbox.max_steps = config.bounds.max_rounds, config.bounds.max_steps
            self.mailbox.max_weight = config.bounds.max_weight
        self.transport: Link = (connect or connector(config, self.rank, flat.layout))(self.mailbox)
        self._closed = False
        self.aborted = ""  # the reason we told the others the run stops for (``abort``)

    @abstractmethod
    def _make_mailbox(self) -> Mailbox: ...

    @abstractmethod
    def _gossip(self) -> None:
        """One mixing point: exchange with the neighbours and mix."""

    def _finish(self) -> None:
        """Complete whatever is in flight before the sockets close (sync: the last round)."""

    @abstractmethod
    def _greet(self) -> None:
        """At the start: say hello to whoever we exchange with first, and wait for their answer."""

    def _due(self) -> bool:
        """Is this step a mixing point of the schedule? (When to mix, kept apart from how.)"""
        if self.config.graph.schedule == "steps":
            return self.local_step % self.config.graph.gossip_every == 0
        return time.monotonic() >= self._anchor + (self.mixing_points + 1) * self.config.graph.round_seconds

    def _close_flush_seconds(self) -> float:
        """How long close() may spend delivering what is queued: the final sync round must arrive."""
        return self.config.timeouts.shutdown_timeout

    # -- public ----------------------------------------------------------------------------------------
    def start(self, resume: dict[str, Any] | None = None) -> Averager:
        """Bind, then wait (``startup_timeout``) until the first peers to talk to have answered.

        ``resume`` (a restarted peer, ``--resume``): the counters of its checkpoint (``step``, ``rounds``,
        ``samples``, ``weight``; empty when it has none) and whether its model came from one (``found``);
        it then rejoins the others where they are (``_rejoin``) instead of starting with them."""
        try:
            self._open(resume)
        except BaseException as exc:  # nothing stays bound or running: the caller may try again
            if isinstance(exc, GossipError):
                self._spell(exc)
                if not isinstance(exc, PeerFailed):
                    self.abort(f"peer {self.rank} could not start: {exc}")
            self.close(finish=False)
            raise
        # schedule "time" counts rounds from here (a rejoined peer from the round it rejoined in)
        self._anchor = self._round_began = time.monotonic() - self.mixing_points * self.config.graph.round_seconds
        return self

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint of this peer holds besides the model and the optimizer: its counters and its
        push-sum weight. Save it beside them; pass it back as ``attach(..., resume=state)`` (or ``start``)
        and the restarted peer rejoins the others where they are, with this weight."""
        return {"step": self.local_step, "rounds": self.rounds, "samples": self.samples,
                "weight": float(getattr(self, "weight", 1.0)), "found": True}

    def _open(self, resume: dict[str, Any] | None) -> None:
        if resume is not None:
            check_resume(resume)
            self._prepare_rejoin()
        self.transport.start()
        if resume is None:
            self._greet()
        else:
            self.local_step = self.mailbox.local_step = int(resume.get("step", 0))
            if self.progress is not None:
                self.progress.advance(self.local_step)
            self.rounds = self.mixing_points = int(resume.get("rounds", 0))
            self.samples = int(resume.get("samples", 0))
            self._mixed_at = (self.local_step, self.samples)
            self._restore(resume)
            self._rejoin(found=bool(resume.get("found")), weight=float(resume.get("weight", 1.0)))

    def _restore(self, resume: dict[str, Any]) -> None:
        """Restarted: take back what ``state_dict`` saved beyond the counters (by default nothing)."""

    def _prepare_rejoin(self) -> None:
        """Before the sockets open, when restarted: what the mailbox must know before anything arrives."""

    def _rejoin(self, found: bool, weight: float) -> None:
        """Come back after a restart; by default, as at the start."""
        self._greet()

    def step(self, samples: int = 0) -> bool:
        """Call after every optimizer step; mixes at each mixing point of the schedule. True when it did."""
        self.local_step += 1
        self.samples += samples
        self.mailbox.local_step = self.local_step
        if self.progress is not None:
            self.progress.advance(self.local_step)
        self.meter.tick(samples, waited=self.wait_seconds - self._waited_at_tick)
        self._waited_at_tick = self.wait_seconds
        if not self._due():
            return False
        self.meter.round_done(time.monotonic() - self._round_began)
        if self.progress is not None:
            self.progress.note(time.monotonic())
        waited = self.wait_seconds
        try:
            self._check_health()
            if self.config.world_size > 1 or self.config.parameter_server:  # alone, a mixing point only counts
                self._gossip()
        except GossipError as exc:
            self._spell(exc)
            if isinstance(exc, (Diverged, PeerFailed)):  # the run cannot go on: the others learn why at once
                self.abort(str(exc))
            raise
        # Time spent waiting shifts our rounds instead of shortening the next one: a neighbour whose rounds
        # started later (start-up order, or it was held up) is then in phase with us from the next round on.
        self._anchor += self.wait_seconds - waited
        self.mixing_points += 1
        self._mixed_at = (self.local_step, self.samples)
        self._round_began = time.monotonic()
        return True

    def _spell(self, exc: GossipError) -> None:
        """Make ``exc`` name what our user typed: ``attach``'s keyword arguments, or the launcher's flags."""
        if self.keyword_errors:
            exc.args = (as_keywords(str(exc)),)

    def _check_health(self) -> None:
        """At a mixing point, before anything is sent: are our own weights still a model (one dot product
        per flat buffer, ``gossip/health.py``), and has another peer stopped the run?"""
        problem = model_problem(self.flat.segments)
        if problem is not None:
            raise Diverged(f"peer {self.rank} diverged: {problem} after step {self.local_step}; lower the "
                           "learning rate")
        self.mailbox.raise_if_stopped()

    def abort(self, reason: str) -> None:
        """Tell the peers we exchange with that the run stops, and why (``reason``: one line naming the peer
        at fault), so that they stop at once with it instead of timing out. Once; best effort."""
        if self.aborted or self._closed or not self.transport.started:
            return
        self.aborted = reason
        dests = self._abort_peers()
        if dests:
            try:
                self.transport.post(dests, encode(abort_header(self.rank, reason)), latest_only=True, timeout=1.0)
            except GossipError:
                pass

    def _abort_peers(self) -> list[int]:
        """Whom ``abort`` tells: none here (the gossip averagers tell their neighbours)."""
        return []

    def done(self, steps: int) -> bool:
        """Whether a run of ``steps`` local steps per peer is over for us: by default once we did them; in the
        asynchronous modes once the whole swarm did ``steps`` each on average (``gossip/progress.py``), or
        the parameter server said so."""
        return self.local_step >= steps

    def _past_horizon(self) -> bool:
        """We did every step the run allows any peer (``max_steps``: all of a swarm's budget, alone)."""
        return bool(self.config.bounds.max_steps) and self.local_step >= self.config.bounds.max_steps

    def schedule_step(self) -> int:
        """Where a learning-rate schedule written over ``--steps`` steps is: at our own step, or in the
        asynchronous gossip mode at the average peer's."""
        return self.local_step

    def _represented_since_mix(self) -> int:
        """Samples trained since the last mixing point, or local steps when the task counts no samples."""
        steps, samples = self.local_step - self._mixed_at[0], self.samples - self._mixed_at[1]
        return samples if samples > 0 else steps

    def close(self, finish: bool = True) -> None:
        """Complete the round in flight and flush (``finish``), or drop everything and close at once."""
        if self._closed:
            return
        self._closed = True
        try:
            if finish:
                self._finish()
        finally:
            self.transport.close(flush_timeout=self._flush_seconds(finish))

    def _flush_seconds(self, finish: bool) -> float:
        """How long close() delivers what is queued: all of it when finishing; after an error only an abort
        we sent (briefly); otherwise nothing."""
        if finish:
            return self._close_flush_seconds()
        return min(ABORT_FLUSH_SECONDS, self.config.timeouts.shutdown_timeout) if self.aborted else 0.0

    def __enter__(self) -> Averager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, *rest: object) -> None:
        if isinstance(exc, (Diverged, PeerFailed)):  # raised in the loop (e.g. a loss gone NaN): tell the others
            self.abort(str(exc))
        self.close(finish=exc_type is None)

    def statistics(self) -> dict[str, Any]:
        return {"step": self.local_step, "rounds": self.rounds, "samples": self.samples, "max_rss_mb": max_rss_mb(),
                "speed": self.meter.samples_per_second, "step_seconds": self.meter.step_seconds,
                "round_busy_seconds": self.meter.round_seconds, "wait_seconds": self.wait_seconds,
                "mix_seconds": self.mix_seconds, "neighbour_speeds": self._neighbour_speeds(),
                **self.transport.statistics()}

    def _neighbour_speeds(self) -> dict[str, float]:
        """Samples per second each neighbour last reported."""
        return {str(j): header.speed for j, header in sorted(self.mailbox.reported.items())}

    def _timed_mix(self) -> _Timer:
        return _Timer(self, "mix_seconds")

    def _timed_wait(self) -> _Timer:
        return _Timer(self, "wait_seconds")


def check_resume(resume: Any) -> None:
    """``ConfigError`` unless ``resume`` is what ``state_dict`` returns (or ``{"found": False}``: a peer
    restarted without a checkpoint, which takes its neighbours' mean model)."""
    if not isinstance(resume, dict):
        raise ConfigError(f"resume must be a dict from averager.state_dict(), got {type(resume).__name__}")
    for key in ("step", "rounds", "samples"):
        value = resume.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"resume[{key!r}] is {value!r}, not a count >= 0; pass what averager.state_dict() "
                              "returned")
    weight = resume.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise ConfigError(f"resume['weight'] is {weight!r}, not a push-sum weight > 0; pass what "
                          "averager.state_dict() returned")
    if not isinstance(resume.get("outer", {}), dict):
        raise ConfigError(f"resume['outer'] is a {type(resume['outer']).__name__}, not the outer step's state; "
                          "pass what averager.state_dict() returned")


def max_rss_mb() -> float:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


class _Timer:
    def __init__(self, owner: Averager, attr: str) -> None:
        self.owner, self.attr = owner, attr

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        setattr(self.owner, self.attr, getattr(self.owner, self.attr) + time.perf_counter() - self.start)

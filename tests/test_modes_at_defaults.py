"""Every mode at its defaults, as a user starts it (``python -m launch --mode M``, 4 peers, digits): the
model the mode produces (the server's, or the push-sum average of the copies) is as good as ps-sync's
(DDP's update) in the same pytest process and with the same seed, within TOLERANCE, as docs/choosing-a-mode.md
says (gossip-async, whose one run varies more, clears a floor instead: ``FLOOR``). A default that breaks a
mode (a server optimizer that compounds momentum with staleness, a gossip rule that drags the mean) lands
below that, even where it stays above an absolute bar such as 0.92."""

from __future__ import annotations

import math

import pytest

from gossip.config import GOSSIP_MODES, PS_MODES, SWARM_BUDGET_MODES

pytestmark = pytest.mark.timeout(120)

TOLERANCE = 0.015  # accuracy, "within 1.5 points"
# gossip-async's one run varies with the timing of its messages: at seed 0 six runs on 2 busy cores gave
# 0.922-0.939 against ps-sync's 0.947 (seeds 1 and 2: within 0.3 points), so one run of it is held to the
# floor every healthy run of it clears instead; the 1.5 points hold for it on the mean over seeds.
FLOOR = {"gossip-async": 0.92}
BAR = 0.92  # what every mode clears, ps-sync included (it is measured against itself otherwise)
MODES = ("ps-sync", *(m for m in GOSSIP_MODES + PS_MODES if m != "ps-sync"))  # ps-sync first: the others compare
_ps_sync: list[float] = []  # ps-sync's accuracy, once this pytest process measured it


def ps_sync_accuracy(launch_run) -> float:
    """ps-sync's accuracy at the defaults: the one this pytest process measured, else measured now."""
    if not _ps_sync:
        summary = launch_run("--mode", "ps-sync", "--eval-every", "0", nodes=4, name="ps-sync").summary
        assert summary["error"] is None, summary["error"]
        _ps_sync.append(summary["accuracy"])
    return _ps_sync[0]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_trains_digits_at_its_defaults_as_well_as_ps_sync(launch_run, mode):
    run = launch_run("--mode", mode, "--eval-every", "0", nodes=4)
    summary = run.summary
    assert summary["error"] is None and math.isfinite(summary["final_model"]["loss"])
    if mode == "ps-sync" and not _ps_sync:
        _ps_sync.append(summary["accuracy"])
    reference = ps_sync_accuracy(launch_run)
    bar = max(BAR, FLOOR.get(mode, reference - TOLERANCE))
    assert summary["accuracy"] >= bar, (mode, summary["accuracy"], "ps-sync", reference)
    steps = [p["steps"] for p in summary["peers"]]
    if mode in SWARM_BUDGET_MODES:  # they end together on the swarm's 4 x 300 steps: the server's count is
        # exact (a worker's last gradient may go spare); a gossip peer's knows the others' steps a little late
        assert 4 * 300 - 4 <= sum(steps) <= (1.25 if mode == "gossip-async" else 1) * 4 * 300 + 4, steps
    else:
        assert steps == [300] * 4


@pytest.mark.parametrize("flags", [("--mode", "gossip-sync"), ("--mode", "gossip-async"), ("--compress", "int8")])
def test_a_peer_alone_trains_on_all_the_data(launch_run, flags):
    """``--nodes 1``: no neighbours, so every mixing point only counts (one process on all the data), and it
    trains as well as ps-sync's four workers."""
    summary = launch_run(*flags, "--eval-every", "0", nodes=1).summary
    assert summary["error"] is None and summary["peers"][0]["steps"] == 300
    reference = ps_sync_accuracy(launch_run)
    assert summary["accuracy"] >= reference - TOLERANCE, (flags, summary["accuracy"], "ps-sync", reference)


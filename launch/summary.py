"""After a run: ``summary.json``, ``model-final.pt`` (the exact average of the peers' final models),
``summary.png``, and the summary table on stdout.

The run's product is ``model-final.pt``: the server's model in the ps-* modes, the push-sum weighted
average of the peers' models in the gossip modes. Its test accuracy is the headline (``accuracy`` in
summary.json, the first line of the results); the mean over the peers' own copies is secondary. A product
model that holds NaN or Inf, has blown up (``gossip/health.py``) or has a non-finite test loss is refused:
summary.json records the error and the launcher exits non-zero with one line saying so.

Nothing in the peers' files is trusted: their event logs are read through ``launch/events.py``, their
models and traces through ``launch/runfiles.py``, which turn whatever a file holds (nothing, half a line,
garbage, fields of the wrong type, rounds far beyond the run) into checked values or a named problem. What
was left out is listed in summary.json's ``problems`` (the launcher prints the first as a warning); a run
that made no usable result (no peer or worker finished, the server's model is missing or not one, a
finished peer's model does not load) has an ``error`` and the launcher exits 1 with that one line.
summary.json is written in every case, a bug of our own while summarising included.

``python -m launch.summary DIR`` does the same for a run whose peers were started on their own (on several
hosts, or under torchrun): copy every host's output directory into DIR first."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gossip.config import RunConfig, robust_rules
from gossip.errors import ConfigError, Diverged, GossipError
from gossip.exit import exit_now
from gossip.health import model_problem
from gossip.recipes import recipe
from gossip.tasks import Task, build_task, context_for
from launch.events import read_events, read_log, shown
from launch.runfiles import Trace, first_line, load_model, load_trace
from launch.table import print_table


def average_state_dicts(states: list[dict[str, torch.Tensor]],
                        weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating tensors (accumulated in float64), weighted by ``weights`` (push-sum
    weights: the network's model is sum_i w_i z_i / sum_i w_i) when given; other entries from the first."""
    w = torch.tensor(weights or [1.0] * len(states), dtype=torch.float64)
    w = w / w.sum()
    averaged = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            stacked = torch.stack([s[name].to(torch.float64) for s in states])
            total = torch.tensordot(w, stacked, dims=1)
            averaged[name] = total.to(first.dtype)
        else:
            averaged[name] = first.clone()
    return averaged


def consensus_distance(vectors: np.ndarray) -> float:
    """sqrt(mean_i |x_i - mean x|^2) over the rows of ``vectors``."""
    centred = vectors - vectors.mean(axis=0, keepdims=True)
    return float(np.sqrt((centred ** 2).sum(axis=1).mean()))


def flat_vector(state: dict[str, torch.Tensor]) -> np.ndarray:
    return torch.cat([t.reshape(-1).to(torch.float64) for t in state.values() if t.is_floating_point()]).numpy()


def consensus_trace(traces: dict[int, Trace], numel: int, problems: list[str]
                    ) -> tuple[list[dict[str, float]], float | None, float | None]:
    """Distance per round from the sampled traces (scaled up when coordinates were sampled), and the
    largest drift of the (push-sum weighted) mean from its starting value, over the rounds every peer
    recorded, and its drift after the last round. Under adaptive deadlines the peers record a round at
    different moments, with mass in flight between them, so only the final drift must be ~0 there.
    A trace that samples other coordinates than most is left out; with no round that every remaining peer
    recorded (a peer's rounds jumped: it rejoined far ahead, or believed a forged round) there is no trace
    and no drift (None); each is named in ``problems``."""
    samples = Counter(t.index.tobytes() for t in traces.values())
    if len(samples) > 1:
        usual = samples.most_common(1)[0][0]
        odd = sorted(rank for rank, t in traces.items() if t.index.tobytes() != usual)
        problems.append(f"the consensus traces of peer(s) {_ranks(odd)} sample other coordinates than the others'; "
                        "they are left out of the consensus trace")
        traces = {rank: t for rank, t in traces.items() if rank not in odd}
    if not traces:
        return [], None, None
    by_round = {rank: {int(r): i for i, r in enumerate(t.rounds)} for rank, t in traces.items()}
    common = sorted(set.intersection(*(set(rows) for rows in by_round.values())))
    if not common:
        spans = "; ".join(f"peer {rank}: rounds {min(rows)}-{max(rows)}" for rank, rows in by_round.items())
        problems.append(f"the peers' consensus traces share no round ({spans}): no consensus trace and no drift of "
                        "the mean; a peer's rounds jumped (it rejoined far from the others, or believed a forged "
                        "round)")
        return [], None, None
    scale = math.sqrt(numel / len(next(iter(traces.values())).index))
    rows, drift, final_drift, mean0 = [], 0.0, 0.0, None
    with np.errstate(all="ignore"):  # a diverged run's values overflow to inf and NaN, shown as null
        for round in common:
            stacked = np.stack([t.values[by_round[rank][round]] for rank, t in traces.items()])
            mass = np.array([t.weights[by_round[rank][round]] for rank, t in traces.items()])
            mean = mass @ stacked / mass.sum()  # push-sum: the conserved mean is weighted
            mean0 = mean if mean0 is None else mean0
            final_drift = float(np.linalg.norm(mean - mean0)) * scale
            drift = max(drift, final_drift)
            rows.append({"round": round, "distance": consensus_distance(stacked) * scale})
    return rows, drift, final_drift


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def peer_result(rank: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    """One peer's figures from its (checked, ``launch/events.py``) event log: those of its last ``end`` and
    ``ready`` (a restarted peer's log holds every incarnation's events), how often it was restarted, and the
    error it last stopped on when no ``end`` followed."""
    end = next((e for e in reversed(events) if e["event"] == "end"), {})
    ready = next((e for e in reversed(events) if e["event"] == "ready"), {})
    last_stop = next((e for e in reversed(events) if e["event"] in ("end", "error", "stopped")), {})
    test = end.get("test", {})
    return {"rank": rank, "steps": end.get("step"), "rounds": end.get("rounds"), "shard": ready.get("shard"),
            "test_accuracy": test.get("accuracy"),
            "test_loss": test.get("loss"), "test": test, "wall_seconds": end.get("wall_seconds"),
            "bytes_sent": end.get("bytes_sent"), "bytes_received": end.get("bytes_received"),
            "wait_seconds": end.get("wait_seconds"), "samples_per_second": end.get("speed"),
            "step_seconds": end.get("step_seconds"), "neighbour_speeds": end.get("neighbour_speeds"),
            "staleness": end.get("staleness"), "dropped": end.get("dropped"), "weight": end.get("weight"),
            "deadline_misses": end.get("deadline_misses"), "late_mixed": end.get("late_mixed"),
            "stragglers": end.get("stragglers"), "max_rss_mb": end.get("max_rss_mb"), "routes": end.get("routes"),
            "restarts": max(0, sum(e["event"] == "start" for e in events) - 1),
            "error": None if last_stop.get("event", "end") == "end" else last_stop.get("message", last_stop["event"])}


def chronic_stragglers(peers: list[dict[str, Any]]) -> dict[str, list[int]]:
    """{straggler rank: ranks of the neighbours that reported it as chronic}."""
    reported: dict[str, list[int]] = {}
    for p in peers:
        for straggler in p.get("stragglers") or []:
            reported.setdefault(str(straggler), []).append(p["rank"])
    return dict(sorted(reported.items(), key=lambda item: int(item[0])))


class RunFailed(GossipError):
    """The run's files make no result: no peer (or worker) finished, the server's model is missing or not
    one, or a finished peer's model does not load. summary.json names it, as ``error``."""


def summarise(cfg: RunConfig, out: Path, wall_seconds: float, plot: bool = True,
              failed: list[str] | None = None) -> dict[str, Any]:
    """Write summary.json (and model-final.pt, summary.png), print the table; returns the summary.

    ``failed`` names the processes that died for good (``--keep-going``): they are left out of the
    averages, the consensus distance and ``model-final.pt``; so are the ``--byzantine`` peers (fault
    injection), whose own models stay honest: what a run measures is what their garbage did to the others.

    Whatever the peers' files hold, summary.json is written: ``problems`` names each thing in them that was
    missing, damaged or out of range (and left out), ``error`` the failure when the run made no usable
    result. Then this raises ``Diverged`` (the product model is not a model, or learned nothing) or
    ``RunFailed`` (anything else) with that one line, which the launcher prints and exits 1 on. An error of
    our own while summarising (a bug) is reported the same way, never as a traceback."""
    try:
        summary, events, kind = build_summary(cfg, out, wall_seconds, failed or [])
    except GossipError as exc:  # the task cannot be built here (its data is gone, say)
        summary, events, kind = bare_summary(cfg, wall_seconds, failed, f"cannot summarise the run: {exc}"), [], RunFailed
    except Exception as exc:  # noqa: BLE001 - a bug here must not hide the run's outcome behind a traceback
        where = traceback.extract_tb(exc.__traceback__)[-1]
        summary, events, kind = bare_summary(
            cfg, wall_seconds, failed,
            f"the summary failed ({first_line(exc)}, at {Path(where.filename).name}:{where.lineno}): {BUG}; the "
            f"run's files in {out} are intact: report it with them"), [], RunFailed
    try:
        (out / "summary.json").write_text(json.dumps(strict_json(summary), indent=2, allow_nan=False))
    except OSError as exc:
        raise RunFailed(f"cannot write {out / 'summary.json'}: {exc.strerror}; free space or fix the permissions of "
                        f"{out}, then run python -m launch.summary {out}") from None
    if summary["error"]:
        raise kind(summary["error"])
    if summary["problems"]:
        more = f" (and {len(summary['problems']) - 1} more)" if len(summary["problems"]) > 1 else ""
        print(f"warning: {summary['problems'][0]}{more}; see problems in {out / 'summary.json'}", file=sys.stderr)
    if plot:
        try:
            from launch.plot import plot_run  # matplotlib costs about 2 s; only when asked for

            plot_run(out, events, summary["consensus_trace"], out / "summary.png", summary["headline"])
        except Exception as exc:  # noqa: BLE001 - a figure is no reason to fail a run that worked
            print(f"warning: summary.png not written: {first_line(exc)}", file=sys.stderr)
    try:
        print_table(summary, out)
    except Exception as exc:  # noqa: BLE001 - the results are in summary.json already
        print(f"warning: no summary table ({first_line(exc)}): {BUG}; the results are in {out / 'summary.json'}",
              file=sys.stderr)
    if summary["diverged"]:  # allowed (--allow-divergence), and still worth a line
        which = "the server's model" if "server" in summary else "the peers' averaged model"
        print(f"warning: the run diverged: {which} learned nothing: {summary['diverged']}", file=sys.stderr)
    return summary


BUG = "a bug in launch/summary.py"


def bare_summary(cfg: RunConfig, wall_seconds: float, failed: list[str] | None, error: str) -> dict[str, Any]:
    """What summary.json holds when the summary itself could not be made: the run's settings and the error."""
    return {"mode": cfg.gossip.mode, "nodes": cfg.nodes, "task": cfg.task, "steps": cfg.steps,
            "seed": cfg.gossip.seed, "wall_seconds": wall_seconds, "accuracy": None, "loss": None, "error": error,
            "problems": [], "failed": failed or [], "consensus_trace": [], "diverged": None}


def strict_json(value: Any) -> Any:
    """``value`` for strict JSON: non-finite floats as null (as the peers' logs have them), numpy scalars as
    Python numbers."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def failed_ranks(failed: list[str]) -> set[int]:
    """The ranks among the launcher's names of dead processes ("peer 3"; "server" is none)."""
    return {int(name.split()[1]) for name in failed if name.startswith("peer ") and name.split()[1].isdigit()}


def horizon_problems(cfg: RunConfig, peers: list[dict[str, Any]]) -> list[str]:
    """Peers that report more rounds or steps than the run allows any peer (the mailbox's horizon,
    ``max_rounds`` + 1 and ``max_steps``), or a push-sum weight above the network's whole mass
    (``max_weight``): what no honest peer reaches."""
    problems, bounds = [], cfg.gossip.bounds
    for p in peers:
        if bounds.max_weight and p["weight"] is not None and p["weight"] > bounds.max_weight:
            problems.append(f"peer {p['rank']} ends with push-sum weight {p['weight']:.6g}; the network's whole mass is "
                            f"{bounds.max_weight:g}")
        for key, limit, unit in (("rounds", bounds.max_rounds + 1 if bounds.max_rounds else 0, "rounds"),
                                 ("steps", bounds.max_steps, "steps")):
            if limit and p[key] is not None and p[key] > limit:
                problems.append(f"peer {p['rank']} reports {p[key]} {unit}; the run allows at most {limit}")
    return problems


def build_summary(cfg: RunConfig, out: Path, wall_seconds: float, failed: list[str]
                  ) -> tuple[dict[str, Any], list[list[dict[str, Any]]], type[GossipError]]:
    """The summary of the run's files in ``out`` (written by nobody yet), the peers' events, and the kind of
    error (``Diverged``, ``RunFailed``) that its ``error``, when set, is. Raises for nothing the files hold."""
    problems: list[str] = []
    errors: list[str] = []
    events = []
    for rank in range(cfg.nodes):
        log, found = read_log(out / f"peer-{rank}.jsonl")
        events.append(log)
        problems += found
    peers = [peer_result(rank, ev) for rank, ev in enumerate(events)]
    problems += horizon_problems(cfg, peers)
    byzantine = set(cfg.gossip.robust.byzantine)
    dead = failed_ranks(failed)
    task = build_task(cfg.task, context_for(cfg, 0))
    reference = task.model.state_dict()
    numel = sum(t.numel() for t in reference.values() if t.is_floating_point())
    states, traces, lost = {}, {}, []
    for rank in range(cfg.nodes):
        if rank in byzantine or rank in dead:
            continue
        if not any(e["event"] == "end" for e in events[rank]):
            problems.append(f"peer {rank}'s log peer-{rank}.jsonl has no end event: its figures are missing")
        state, problem = load_model(out / f"model-{rank}.pt", reference)
        if problem:
            lost.append(f"peer {rank}'s {problem}")
        else:
            states[rank] = state
        trace, problem = load_trace(out / f"trace-{rank}.npz", numel)
        if problem:
            problems.append(f"peer {rank}'s {problem}; it is left out of the consensus trace")
            continue
        beyond = trace.rounds[trace.rounds > cfg.gossip.bounds.max_rounds + 1] if cfg.gossip.bounds.max_rounds else []
        if len(beyond):
            problems.append(f"peer {rank}'s trace-{rank}.npz names round {int(beyond.max())}; the run allows at most "
                            f"{cfg.gossip.bounds.max_rounds + 1}")
        if rank in states:
            traces[rank] = trace
    finished = sorted(states)
    vectors = np.stack([flat_vector(states[rank]) for rank in finished]) if finished else None
    trace, drift, final_drift = consensus_trace(traces, numel, problems)
    server, server_ended = server_result(out, problems) if cfg.gossip.parameter_server else (None, False)
    weights = [peers[rank]["weight"] if peers[rank]["weight"] is not None else 1.0 for rank in finished]
    untrained = task.evaluate() if task.trains else {}  # every peer's model before its first step
    product, final_metrics = None, {}
    if server is not None:
        product, problem = load_model(out / "model-final.pt", reference)
        if problem:
            errors.append(f"the server's {problem}: the run has no model; see server.log")
        if not server_ended:
            errors.append("the server did not finish (server.jsonl has no end event): its model-final.pt is not the "
                          "run's; see server.log")
        final_metrics = server.get("test") or {}
    elif finished:
        product = average_state_dicts([states[rank] for rank in finished], weights)
        final_metrics = evaluate_average(task, product, out)
    if not finished:
        errors.insert(0, nobody_finished(peers, server, dead, byzantine, lost))
    elif lost:
        them = "it" if len(lost) == 1 else "them"
        errors.append(f"{', '.join(lost)}: {'the run' if server else 'the average model-final.pt'} leaves {them} out; "
                      f"the file was damaged after the peer wrote it: copy {them} again from the host, or rerun")
    if server_ended:
        problems += server_ended_early(server, events, finished)
    problem = product_problem(product, final_metrics) if product is not None else None
    learned_nothing = None if problem or product is None else divergence(final_metrics, untrained, task.chance)
    accuracies = [p["test_accuracy"] for p in peers
                  if p["test_accuracy"] is not None and p["rank"] not in byzantine]
    losses = [p["test_loss"] for p in peers if p["test_loss"] is not None and p["rank"] not in byzantine]
    summary = {
        "mode": cfg.gossip.mode, "topology": None if cfg.gossip.parameter_server else cfg.gossip.topology_spec,
        "nodes": cfg.nodes, "task": cfg.task,
        "steps": cfg.steps, "schedule": cfg.gossip.graph.schedule, "rounds": cfg.total_rounds,
        "seed": cfg.gossip.seed, "wall_seconds": wall_seconds, "headline": recipe(cfg.task).headline,
        "accuracy": final_metrics.get("accuracy"),  # of the product model, model-final.pt
        "loss": final_metrics.get("loss"),  # its test (charlm: validation) loss
        "error": None, "problems": problems, "data": dataset(events), "partition": cfg.partition,
        "optimizer": training(cfg), "peers": peers,
        "chronic_stragglers": chronic_stragglers(peers),
        "mean_test_accuracy": sum(accuracies) / len(accuracies) if accuracies else None,
        "mean_test_loss": sum(losses) / len(losses) if losses else None,
        "final_model": final_metrics, "consensus_distance": consensus_distance(vectors) if finished else None,
        "consensus_trace": trace, "mean_drift": drift, "final_mean_drift": final_drift, "spectral": spectral(cfg),
        # every process's: the peers' (workers') and, in the ps-* modes, the server's answers
        "bytes_sent": sum(p["bytes_sent"] or 0 for p in peers) + ((server or {}).get("bytes_sent") or 0),
        "failed": failed,
        "aggregate": cfg.gossip.robust.aggregate, "byzantine": sorted(byzantine),
        "untrained_model": untrained, "diverged": learned_nothing,
    }
    if server is not None:
        summary["server"] = server
    which = "the server's model" if server else "the peers' averaged model"
    kind: type[GossipError] = Diverged if not errors else RunFailed  # the first error says which
    if problem:
        errors.append(f"{which} (model-final.pt) is not a usable model: {problem}; {remedy(cfg, server)}")
    elif learned_nothing and not cfg.allow_divergence:
        errors.append(f"the run diverged: {which} (model-final.pt) learned nothing: {learned_nothing}; "
                      f"{remedy(cfg, server)}, or pass --allow-divergence")
    if errors:
        summary["error"] = errors[0] if len(errors) == 1 else f"{errors[0]} (and: {'; '.join(errors[1:])})"
    return summary, events, kind


def nobody_finished(peers: list[dict[str, Any]], server: dict[str, Any] | None, dead: set[int], byzantine: set[int],
                    lost: list[str]) -> str:
    """The error of a run in which no honest peer left a usable model: who died and why, and what became of
    the others' files and of the server."""
    who = "worker" if server is not None else "peer"
    reasons = []
    if dead:
        first = min(dead)
        why = peers[first]["error"]
        reasons.append(f"{', '.join(f'peer {r}' for r in sorted(dead))} died (--keep-going went on without them"
                       f"{f'; peer {first} stopped on: {shown(why, 160)}' if why else ''})")
    reasons += lost
    if byzantine and not reasons:
        reasons.append("every other peer is --byzantine")
    if server is not None and server["updates"] is not None:
        reasons.append(f"the server ended after {server['updates']} updates")
    logs = "peer-<rank>.log" + (" and server.log" if server is not None else "")
    return f"no {who} finished: {'; '.join(reasons) or 'none left a model'}; see {logs} for why, and rerun"


def server_ended_early(server: dict[str, Any], events: list[list[dict[str, Any]]], finished: list[int]) -> list[str]:
    """Workers that logged a training step after the server's end: it took them for finished (their bye,
    or a forged one) while they trained on."""
    ended = server.get("ended")
    late = [rank for rank, ev in enumerate(events)
            if ended is not None and any(e["event"] == "step" and e.get("time", 0.0) > ended for e in ev)]
    if not late:
        return []
    unfinished = "" if set(late) <= set(finished) else "; they did not finish"
    after = f" after {server['updates']} updates" if server["updates"] is not None else ""
    line = (f"the server ended{after} while worker(s) {_ranks(late)} still trained "
            f"(their steps are logged after its end){unfinished}")
    return [line]


def dataset(events: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """What the peers trained on (the task's ``dataset``: name, size, hash), as the first peer reported it;
    ``differs`` lists the peers (rank: hash) whose data hash is another (hosts with another corpus)."""
    reported = [next((e.get("dataset") or {} for e in peer if e["event"] == "ready"), None) for peer in events]
    first = next((d for d in reported if d is not None), {})
    differs = {str(rank): d.get("sha256") for rank, d in enumerate(reported)
               if d is not None and d.get("sha256") != first.get("sha256")}
    return {**first, "differs": differs} if differs else first


def training(cfg: RunConfig) -> dict[str, Any]:
    """Each peer's optimizer and schedule, as resolved from the flags and the task's recipe."""
    return {"name": cfg.optimizer, "lr": cfg.lr, "schedule": cfg.lr_schedule, "warmup_steps": cfg.warmup_steps,
            "min_lr": cfg.min_lr, "weight_decay": cfg.weight_decay, "batch_size": cfg.batch_size,
            **({"betas": list(cfg.betas), "second_moment_of": cfg.swarm_peers} if cfg.optimizer == "adamw"
               else {"momentum": cfg.momentum})}


def remedy(cfg: RunConfig, server: dict[str, Any] | None) -> str:
    """What to change when the run's product model is unusable or learned nothing: keep the garbage of the
    --byzantine peers out of the mean, or else take smaller steps."""
    if cfg.gossip.robust.byzantine and cfg.gossip.robust.aggregate == "mean":
        return ("the --byzantine peers' garbage reached the plain mean: use --aggregate "
                f"{robust_rules(cfg.gossip.mode)}")
    return f"lower --lr (now {cfg.lr:g}){' or set --server-lr' if server and server.get('optimizer') else ''}"


def product_problem(state: dict[str, torch.Tensor], metrics: dict[str, Any]) -> str | None:
    """What makes the run's product model unusable, or None: non-finite or blown-up weights, or a
    non-finite test loss."""
    problem = model_problem(state.values())
    loss = metrics.get("loss")
    if problem is None and loss is not None and not math.isfinite(loss):
        problem = f"its test loss is {loss}"
    return problem


# A product model at most this far above chance has learned nothing: digits' untrained models measure
# 0.106-0.164 against chance 0.101 (seeds 0-2), and a model of one class is chance exactly
CHANCE_MARGIN = 0.02


def divergence(final: dict[str, Any], untrained: dict[str, Any], chance: float | None) -> str | None:
    """Why the run's product model learned nothing, in words, or None: its test loss is no lower than the
    untrained model's (any task), or its test accuracy is within ``CHANCE_MARGIN`` of ``chance`` (a task
    that measures accuracy). A model that blew up is ``product_problem``'s."""
    loss, before = final.get("loss"), untrained.get("loss")
    if loss is not None and before is not None and loss >= before:
        return f"its test loss {loss:.4g} is no lower than the untrained model's {before:.4g}"
    accuracy = final.get("accuracy")
    if chance is not None and accuracy is not None and accuracy <= chance + CHANCE_MARGIN:
        return (f"its test accuracy {accuracy:.3f} is chance (always guessing the commonest label scores "
                f"{chance:.3f})")
    return None


def evaluate_average(task: Task, final: dict[str, torch.Tensor], out: Path) -> dict[str, float]:
    """Write ``model-final.pt``, the exact (push-sum weighted) average of the peers' models, and return its
    test metrics (on ``task``'s model, which it loads)."""
    torch.save(final, out / "model-final.pt")
    if not task.trains:
        return {}
    task.model.load_state_dict(final)
    return task.evaluate()


def server_result(out: Path, problems: list[str]) -> tuple[dict[str, Any], bool]:
    """The parameter server's end event (its last): versions, updates, staleness histogram and its model's
    metrics (the server already wrote ``model-final.pt``), and when it ended (``ended``, its clock); and
    whether server.jsonl has an end event at all. What is wrong with the log goes to ``problems``."""
    events, found = read_log(out / "server.jsonl")
    problems += found
    end = next((e for e in reversed(events) if e["event"] == "end"), None)
    ready = next((e for e in reversed(events) if e["event"] == "ready"), {})
    return {"optimizer": ready.get("optimizer"), "ended": (end or {}).get("time"),
            **{key: (end or {}).get(key) for key in ("versions", "updates", "staleness", "test", "wall_seconds",
                                                     "bytes_sent", "bytes_received", "dropped")}}, end is not None


def spectral(cfg: RunConfig) -> dict[str, Any]:
    if cfg.nodes < 2 or cfg.gossip.parameter_server:
        return {}
    topology = cfg.gossip.build_topology()
    return {"slem": topology.slem(0), "contraction": topology.contraction(0), "directed": topology.directed,
            "time_varying": topology.time_varying}


def wall_seconds_from_events(out: Path, nodes: int) -> float:
    """From the first peer's start to the last peer's end, by the peers' own clocks."""
    events = [e for rank in range(nodes) for e in read_events(out / f"peer-{rank}.jsonl")]
    starts = [e["time"] for e in events if e["event"] == "start"]
    ends = [e["time"] for e in events if e["event"] == "end"]
    return max(ends) - min(starts) if starts and ends else 0.0


def read_config(path: Path) -> RunConfig:
    """The run's settings from its config.json; ``ConfigError`` in one line when it is missing or not one."""
    try:
        return RunConfig.from_dict(json.loads(path.read_text()))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}; DIR must hold the run's config.json") from None
    except ConfigError:
        raise
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:  # not JSON, or not a run's settings
        raise ConfigError(f"{path} is not a run's config.json ({first_line(exc)}); copy it again from the host "
                          "that started the run") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.summary",
                                     description="Summarise a run whose peers' files were collected into DIR.")
    parser.add_argument("out", type=Path, metavar="DIR", help="holds config.json and every peer's files")
    parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True, help="write summary.png")
    parser.add_argument("--allow-divergence", action="store_true", help="exit 0 even when the run's model learned "
                        "nothing (test accuracy at chance, or loss no lower than untrained)")
    args = parser.parse_args(argv)
    try:
        cfg = read_config(args.out / "config.json")
        if args.allow_divergence:
            cfg = dataclasses.replace(cfg, allow_divergence=True)
        missing = [f"{kind}-{rank}.{ext}" for rank in range(cfg.nodes) for kind, ext in
                   (("peer", "jsonl"), ("model", "pt"), ("trace", "npz")) if not (args.out / f"{kind}-{rank}.{ext}").exists()]
        if missing:
            raise ConfigError(f"{args.out} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; copy "
                              "every host's output directory into it (e.g. rsync -a HOST:DIR/ DIR/)")
        summarise(cfg, args.out, wall_seconds_from_events(args.out, cfg.nodes), plot=args.plot)
    except (Diverged, RunFailed) as exc:
        print(f"python -m launch.summary: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError, GossipError) as exc:
        print(f"python -m launch.summary: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_now(main())

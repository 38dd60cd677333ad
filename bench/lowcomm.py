"""Low-communication training over a slow link: DDP, gossip, DiLoCo and decentralized DiLoCo on charlm.

    python bench/lowcomm.py                                    # as root: it makes two network namespaces
    python bench/lowcomm.py --h 50 --every-step-rates 100mbit  # DDP and gossip-sync at 100 Mbit/s only
    python bench/lowcomm.py --steps 300 --h 10 --rates 100mbit # a quick look
    python bench/lowcomm.py --rates 10mbit --every-step-rates none --ddp-reference DIR  # DDP from an earlier run

Two hosts (Linux network namespaces, ``tests/netns.py``) joined by a veth link limited to each of ``--rates``
in turn (``tc tbf``), ``--per-host`` peers on each (4: 8 peers), train the ``charlm`` task at its recipe
(AdamW, cosine schedule) for ``--steps`` steps each, so every row processes the same samples. The rows, for
each rate, one after the other:

- ``ddp``: ``bench/ddp.py --task charlm``, gloo all-reducing the gradients over the link every step;
- ``gossip-sync``: ``python -m launch --mode gossip-sync --second-moment own`` on a ring, averaging every
  step (AdamW's own second moment, as its documented row was measured);
- ``diloco-H``: ``--mode ps-avg --local-steps H --outer-optimizer nesterov`` (the server on the first host:
  DiLoCo, OpenDiLoCo's outer lr 0.7 and momentum 0.9), and ``diloco-H-int8`` with ``--compress int8``
  (int8 pseudo-gradients with error feedback, ``gossip/coordinator/pseudograd.py``);
- ``gossip-outer-H``: ``--mode gossip-sync --gossip-every H --outer-optimizer nesterov`` (decentralized
  DiLoCo, ``gossip/averagers/outer.py``), and ``gossip-outer-H-int8`` with ``--compress int8`` (each peer
  sends its change since its last message in int8, with error feedback: ``gossip/averagers/compressed.py``),

for every H of ``--h``. For each row: the final validation loss of the run's product (DDP: rank 0's model;
ps-avg: the server's; gossip: the peers' averaged model, ``model-final.pt``), the bytes that left both ends
of the limited link during the row, the run time, and the time from the first ``ready`` until the row's
validation loss curve (the mean of the peers' latest evaluations) first reaches DDP's
final loss at that rate. The link's byte counters are read every half second, so each evaluation is placed
at the bytes sent by then: ``lowcomm-<rate>.png`` in ``--out`` plots validation loss against bytes over the
link, one curve per row. Results: ``--out`` (default ``bench/results/lowcomm``), one directory per row and
rate, ``results.json``, the plots, and a markdown table per rate printed at the end.

With ``--every-step-rates`` the two rows that send every step run in full only at the rates named (DDP
alone would take hours over 10 Mbit/s). At the other rates DDP runs ``--ddp-probe-steps`` steps, which
measure its seconds and link bytes per step there; being synchronous it makes the same loss at every step
at any rate, so its loss by step is its full run's at the first rate (or, with ``--ddp-reference DIR``, the
``ddp`` row of an earlier run with the same steps, seed and evaluations). Its time to a loss there is the
steps it needed for that loss times its measured seconds per step, and the table adds, for each row, DDP's
time to that row's final loss and how many times sooner the row got there. ``--include DIR`` adds an earlier
run's rows (and DDP's probe) to this one's table and plot, so that a new row joins the ones measured before.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multihost import link_bytes, run_ddp, run_gossip  # (bench/, the script's directory)
from straggler import mean_eval_curve

from tests import netns
from tests.conftest import free_base_port

TASK = "charlm"
OUTER = ("--outer-optimizer", "nesterov")


def row_specs(hs: list[int]) -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """short name -> (launcher mode, its extra flags; None: DDP), in the table's order."""
    # gossip-sync every step: AdamW's own second moment, as its row in BENCHMARKS.md was measured
    rows: dict[str, tuple[str, tuple[str, ...] | None]] = {"ddp": ("", None),
                                                           "gossip-sync": ("gossip-sync", ("--second-moment", "own"))}
    for h in hs:
        rows[f"diloco-{h}"] = ("ps-avg", ("--local-steps", str(h), *OUTER))
        rows[f"diloco-{h}-int8"] = ("ps-avg", ("--local-steps", str(h), *OUTER, "--compress", "int8"))
        rows[f"gossip-outer-{h}"] = ("gossip-sync", ("--gossip-every", str(h), *OUTER))
        rows[f"gossip-outer-{h}-int8"] = ("gossip-sync", ("--gossip-every", str(h), *OUTER, "--compress", "int8"))
    return rows


class LinkMeter:
    """The link's bytes (both directions) every ``period`` seconds while a row runs: (time, bytes since start)."""

    def __init__(self, hosts: netns.TwoHosts, period: float = 0.5) -> None:
        self.hosts, self.period = hosts, period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._base = link_bytes(hosts)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()

    def _sample(self) -> None:
        self.samples.append((time.time(), link_bytes(self.hosts) - self._base))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def at(self, moment: float) -> int:
        """Bytes by ``moment`` (the last sample at or before it)."""
        sent = 0
        for t, count in self.samples:
            if t > moment:
                break
            sent = count
        return sent


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ddp_steps(out: Path) -> list[tuple[int, float]]:
    """(step, validation loss) of a DDP row's evaluations (rank 0's; every rank holds the same model)."""
    return [(e["step"], e["loss"]) for e in _events(out / "peer-0.jsonl") if e["event"] == "eval"]


def steps_to(curve: list[tuple[int, float]], loss: float) -> int | None:
    """The first evaluated step at which ``curve`` is at or below ``loss``."""
    return next((step for step, value in curve if value <= loss), None)


def analyse(out: Path, peers: int, meter: LinkMeter) -> dict:
    """The row's validation loss curve (time since the first ready, loss, link bytes by then), its final
    loss and its run time."""
    events = [_events(out / f"peer-{rank}.jsonl") for rank in range(peers)]
    t0 = min(e["time"] for peer in events for e in peer if e["event"] == "ready")
    curve = mean_eval_curve(events, t0, metric="loss")
    summary = out / "summary.json"
    if summary.exists():
        final = json.loads(summary.read_text())["loss"]
    else:  # DDP: rank 0's model, which every rank shares
        final = next(e for e in events[0] if e["event"] == "end")["test"]["loss"]
    ends = [e["time"] for peer in events for e in peer if e["event"] == "end"]
    return {"final_loss": final, "wall_seconds": max(ends) - t0,
            "curve": [(t, loss, meter.at(t0 + t)) for t, loss in curve]}


def earlier_rows(folders: list[Path]) -> dict[str, dict]:
    """rate -> {"rows", "probe" (DDP's there), "measured" (the link's rate)} of earlier runs' results.json,
    each row marked with the folder it came from; the first folder that has a row wins."""
    found: dict[str, dict] = {}
    for folder in folders:
        results = json.loads((folder / "results.json").read_text())
        for rate, at in results["rates"].items():
            earlier = found.setdefault(rate, {"rows": {}, "probe": None, "measured": at["link_bytes_per_second"]})
            for name, row in at["rows"].items():
                if name not in earlier["rows"]:
                    earlier["rows"][name] = {**row, "from": str(folder)}
                    if name == "ddp":
                        earlier["probe"] = at.get("ddp_probe")
    return found


def run_row(hosts: netns.TwoHosts, out: Path, args: argparse.Namespace, mode: str,
            extra: tuple[str, ...] | None, probe: bool = False) -> Callable[[], None]:
    """(Every row evaluates every ``--eval-every`` own steps: ps-avg's workers evaluate the model they
    hold, the server by version, which in H-step versions would be H times as rare.) ``probe``: DDP for
    ``--ddp-probe-steps`` steps only."""
    if extra is None:
        ddp_args = argparse.Namespace(**{**vars(args), "steps": args.ddp_probe_steps}) if probe else args
        return lambda: run_ddp(hosts, out, ddp_args, args.per_host, TASK)
    return lambda: run_gossip(hosts, out, mode, args, args.per_host, TASK, extra)


EVERY_STEP = ("ddp", "gossip-sync")  # the rows that send every step


def table(rows: dict[str, dict], reference: dict | None = None, probe: dict | None = None) -> str:
    """The rate's rows against DDP: its own row, else ``reference`` (DDP at another rate: the same steps
    make the same losses and bytes, synchronous as it is). With ``probe`` (DDP's short run at this rate:
    ``seconds_per_step``, ``bytes_per_step``, and the reference's ``steps``, its loss by step), DDP's bytes
    and times here are its steps times those, and two columns give DDP's time to each row's final loss, and
    that over the row's run time (the row has its product, and so its final loss, at its end)."""
    reference = (reference if probe else rows.get("ddp", reference)) or {}
    ddp, ddp_bytes = reference.get("final_loss"), reference.get("link_bytes")
    header = ("| row | final validation loss | vs DDP | over the link | DDP's bytes / row's | time to DDP's final loss "
              "| run time |")
    if probe:
        ddp_bytes = probe["bytes_per_step"] * probe["steps"][-1][0]
        header += " DDP's time to this loss (its steps x its seconds per step here) | row's speed-up |"
    lines = [header, "| --- " * header.count(" | ") + "| --- |"]
    for name, row in rows.items():
        if name == "ddp" and probe:
            final_seconds = steps_to(probe["steps"], ddp) * probe["seconds_per_step"]
            lines.append(f"| ddp ({probe['probe_steps']} steps run: {probe['seconds_per_step']:.2f} s and "
                         f"{probe['bytes_per_step'] / 1e6:.2f} MB a step) | {ddp:.4f} | | about "
                         f"{ddp_bytes / 1e6:.0f} MB | 1x | about {final_seconds:.0f} s | | | |")
            continue
        if "failed" in row:
            lines.append(f"| {name} | failed | | {row['link_bytes'] / 1e6:.1f} MB | | | |" + (" | |" if probe else ""))
            continue
        versus = f"{row['final_loss'] / ddp - 1:+.1%}" if ddp else ""
        ratio = f"{ddp_bytes / row['link_bytes']:.0f}x" if ddp_bytes and row["link_bytes"] else ""
        hit = next((t for t, loss, _ in row["curve"] if ddp is not None and loss <= ddp), None)
        line = (f"| {name} | {row['final_loss']:.4f} | {versus} | {row['link_bytes'] / 1e6:.1f} MB | {ratio} | "
                f"{'not reached' if hit is None else f'{hit:.0f} s'} | {row['wall_seconds']:.0f} s |")
        if probe:
            # the row has its final loss at its end (its product: the server's model, the peers' average)
            needed = steps_to(probe["steps"], row["final_loss"])
            ddp_time = None if needed is None else needed * probe["seconds_per_step"]
            line += (" not reached |  |" if ddp_time is None else
                     f" {ddp_time:.0f} s ({needed} steps) | {ddp_time / row['wall_seconds']:.1f}x |")
        lines.append(line)
    return "\n".join(lines)


def plot(rows: dict[str, dict], rate: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, row in rows.items():
        if row.get("curve"):
            axes.plot([max(b, 1) / 1e6 for _, _, b in row["curve"]], [loss for _, loss, _ in row["curve"]],
                      marker=".", label=name)
    axes.set_xscale("log")
    axes.set_xlabel("bytes over the link (MB, log)")
    axes.set_ylabel("validation loss (nats per character)")
    axes.set_title(f"charlm, {rate} between two hosts")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="steps per peer (and DDP steps)")
    parser.add_argument("--h", default="10,50", help="comma list of inner steps between outer steps")
    parser.add_argument("--rates", default="100mbit,10mbit", help="comma list of link rates, as tc writes them")
    parser.add_argument("--per-host", type=int, default=4, help="peers (DDP ranks, workers) on each host")
    parser.add_argument("--rows", default="", help="comma list of rows to run (default: all; none: only "
                        "--include's)")
    parser.add_argument("--every-step-rates", default="", help="comma list of the rates at which ddp and "
                        "gossip-sync run in full (default: every rate; none: no rate); at the others DDP runs "
                        "--ddp-probe-steps steps and its losses are those of its full run")
    parser.add_argument("--ddp-probe-steps", type=int, default=20, help="DDP's steps at a rate not in "
                        "--every-step-rates, to measure its seconds and bytes per step there")
    parser.add_argument("--ddp-reference", type=Path, default=None, help="the ddp row's output folder of an "
                        "earlier run at the same --steps, --seed and --eval-every: DDP's loss by step, where "
                        "this run has no full DDP row")
    parser.add_argument("--include", type=Path, action="append", default=[], help="an earlier run's --out folder "
                        "(repeatable): its rows at these rates, DDP's probe with its, join this run's table, plot "
                        "and results.json, where this run did not run them")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--compute-ms", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lowcomm")
    args = parser.parse_args()
    try:
        hs = [int(h) for h in args.h.split(",") if h.strip()]
    except ValueError:
        parser.error(f"--h {args.h!r}: use a comma list of whole numbers, e.g. 10,50")
    if not hs or min(hs) < 1:
        parser.error(f"--h {args.h!r}: use a comma list of whole numbers >= 1")
    specs = row_specs(hs)
    order = {name: index for index, name in enumerate(specs)}  # the table's order
    names = [n.strip() for n in args.rows.split(",") if n.strip()] or list(specs)
    names = [] if names == ["none"] else names  # (only --include's rows: their table and plot again)
    if any(n not in specs for n in names):
        parser.error(f"--rows {args.rows!r}: use a comma list of {', '.join(specs)}")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    every_step = [r.strip() for r in args.every_step_rates.split(",") if r.strip()] or rates
    every_step = [] if every_step == ["none"] else every_step
    if any(r not in rates for r in every_step) or (rates[0] not in every_step and "ddp" in names
                                                   and args.ddp_reference is None):
        parser.error(f"--every-step-rates {args.every_step_rates!r}: name some of --rates, the first among them "
                     "(DDP's run there is the others' reference), or give --ddp-reference")
    reference_steps = None  # DDP's (step, loss) of a full run
    if args.ddp_reference is not None:
        try:
            reference_steps = ddp_steps(args.ddp_reference)
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--ddp-reference {args.ddp_reference}: cannot read its peer-0.jsonl ({exc})")
        if not reference_steps or reference_steps[-1][0] != args.steps:
            parser.error(f"--ddp-reference {args.ddp_reference}: its evaluations end at step "
                         f"{reference_steps[-1][0] if reference_steps else 'none'}, not --steps {args.steps}")
    try:
        included = earlier_rows(args.include)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--include: {exc}")
    if names and (reason := netns.unavailable()) is not None:
        parser.error(f"cannot make the two hosts: {reason}")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty; remove it or pass another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    given = vars(args) | {"out": str(args.out), "ddp_reference": str(args.ddp_reference or ""),
                          "include": [str(folder) for folder in args.include]}
    began, peers, results = time.time(), 2 * args.per_host, {"args": given, "rates": {}}
    reference = None  # DDP's row at the first rate
    for rate in rates:
        rows: dict[str, dict] = {}
        probing = rate not in every_step and "ddp" in names
        to_run = [n for n in names if rate in every_step or n not in EVERY_STEP or (n == "ddp" and probing)]
        measured = None
        if to_run:
            with tempfile.TemporaryDirectory(prefix="lc-") as scratch, netns.two_hosts(Path(scratch), rate) as hosts:
                measured = netns.throughput(hosts, hosts.wan[1], 16 << 20, free_base_port(1))
                print(f"{rate}: one TCP stream {measured * 8 / 1e6:.1f} Mbit/s", flush=True)
                for name in to_run:
                    mode, extra = specs[name]
                    out = args.out / rate / name
                    print(f"{rate} {name}{' (probe)' if name == 'ddp' and probing else ''} ...", flush=True)
                    started = time.time()
                    with LinkMeter(hosts) as meter:
                        try:
                            run_row(hosts, out, args, mode, extra, probe=name == "ddp" and probing)()
                        except (subprocess.SubprocessError, RuntimeError, OSError) as exc:
                            print(f"{name} failed: {exc!r}; its output is in {out}", flush=True)
                            rows[name] = {"failed": repr(exc), "seconds": time.time() - started}
                    if name not in rows:
                        try:
                            rows[name] = analyse(out, peers, meter)
                        except (OSError, ValueError, KeyError, StopIteration) as exc:
                            print(f"{name}: its output does not read: {exc!r}; see {out}", flush=True)
                            rows[name] = {"failed": repr(exc), "seconds": time.time() - started}
                    rows[name]["link_bytes"] = meter.samples[-1][1]
        before = included.get(rate, {"rows": {}, "probe": None, "measured": None})  # (--include)
        measured = measured or before["measured"]
        ddp_before = "ddp" in before["rows"] and "ddp" not in rows  # (DDP's row, and probe if any, from --include)
        if ddp_before:
            probing = before["probe"] is not None
        merged = {**before["rows"], **rows}
        rows = {n: merged[n] for n in sorted(merged, key=lambda n: order.get(n, len(order)))}
        if rate == rates[0] and "ddp" in rows and not probing and "failed" not in rows["ddp"]:
            reference = rows["ddp"]
            reference_steps = ddp_steps(Path(rows["ddp"].get("from", args.out)) / rate / "ddp")
        probe = None
        if ddp_before and probing:
            probe = before["probe"]
            reference = reference or {"final_loss": probe["steps"][-1][1]}
        elif probing and "failed" not in rows.get("ddp", {"failed": "not run"}) and reference_steps:
            ran, steps = rows["ddp"], args.ddp_probe_steps
            probe = {"probe_steps": steps, "seconds_per_step": ran["wall_seconds"] / steps,
                     "bytes_per_step": ran["link_bytes"] / steps, "steps": reference_steps}
            reference = reference or {"final_loss": reference_steps[-1][1]}
        results["rates"][rate] = {"link_bytes_per_second": measured, "rows": rows, "ddp_probe": probe}
        plot({n: r for n, r in rows.items() if not (probe and n == "ddp")}, rate, args.out / f"lowcomm-{rate}.png")
        print(f"\n{rate}\n{table(rows, reference, probe)}\n", flush=True)
        if "ddp" not in rows and reference and "failed" not in reference and "link_bytes" in reference:
            # the busier direction carries at least half of the link's bytes, at most at the measured rate
            bound = reference["link_bytes"] / 2 / measured
            results["rates"][rate]["ddp_seconds_at_least"] = bound
            print(f"DDP here (not run): at least {bound:.0f} s for its {reference['link_bytes'] / 1e6:.1f} MB "
                  f"over the link at {measured / 1e6:.2f} MB/s each way\n", flush=True)
    results["machine"] = f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}"
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"bench time {time.time() - began:.0f} s; {results['machine']}; plots: {args.out}/lowcomm-<rate>.png")
    if any("failed" in row for rate in results["rates"].values() for row in rate["rows"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

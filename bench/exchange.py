"""One gossip round in a 3-peer ring: exchange weights with both neighbours, then mix.

Three implementations of the same round, measured in the same run on the same machine:

- ``gossip``: this project: ``gossip.attach`` on a model of the given size, gossip-sync on a ring, one
  ``averager.step()`` per round (send in 8 MiB frames, receive, check, mix chunk by chunk), as a user gets
  it. Nothing writes the weights between two rounds, so the default (overlapping) round sends them
  uncopied (``gossip/writes.py``). ``gossip-copy``: the round of a training loop, whose optimizer writes
  the weights between rounds: a snapshot is copied during each mix (``lazy_snapshot=False`` forces it).
  ``gossip-no-overlap``: ``overlap=False``: the weights themselves are sent uncopied, and the round is
  mixed in place before ``step()`` returns. ``gossip-float16`` and ``gossip-int8``: compressed gossip
  (``--compress``), which sends the encoded change of a public copy instead of the weights. Peers on one
  host reach each other over a Unix socket by default (``--ipc``); the ``-tcp`` variants (``ipc=False``)
  use TCP loopback, as between hosts.
- ``pyzmq``: a plain pyzmq exchange of the same bytes as one zero-copy frame (DEALER -> ROUTER), then the
  same mix. ``pyzmq-frames``: the same bytes in 8 MiB frames, checked for NaN/Inf, mixed block by block;
  ``pyzmq-frames-ipc``: the same over the Unix socket.
- ``gloo``: ``torch.distributed`` with the gloo backend, isend/irecv with both neighbours into
  preallocated buffers, then the same mix; ``gloo-exchange`` is the same without the mix.

Every peer is its own process with one torch thread. Reported: seconds per round (the slowest peer's
mean over the timed rounds, after warm-up rounds; the median of the repeats), the ratio to gloo, and the
CPU time a peer spends per round in all its threads (``getrusage``: the training thread, our event loop,
ZeroMQ's I/O thread, pyzmq's thread that frees zero-copy frames, gloo's threads). With three peers on two
cores, a round's wall time follows its CPU time. The
repeats go round-robin over the variants, so each variant's run has a gloo run beside it, and the ratio
given is the median of those paired ratios (the machines are shared: load moves between minutes).

    python bench/exchange.py                      # sizes 1, 16, 100 MB
    python bench/exchange.py --sizes 100 --rounds 20
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import resource
import socket
import sys
import threading
import time
from functools import partial
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORLD = 3
MB = 1 << 20
KEYDIR = ROOT / "bench" / "results" / "exchange-keys"  # --secure variant: key pairs for the 3 peers
Timing = tuple[float, float, dict[str, float]]  # per round: wall seconds, CPU seconds, CPU seconds by thread


_baseline_mb = 0.0  # resident MB of this peer process with its model built, before any exchange machinery


def mark_baseline() -> None:
    """Note the process's resident memory now: the model exists, nothing that exchanges it yet."""
    global _baseline_mb
    with open("/proc/self/statm") as statm:
        _baseline_mb = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def mix(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    x.mul_(1 / 3).add_(a, alpha=1 / 3).add_(b, alpha=1 / 3)  # Metropolis-Hastings weights of a 3-ring


def run_gossip(rank: int, numel: int, rounds: int, warmup: int, port: int, secure: str = "",
               overlap: bool = True, ipc: bool = True, compress: str = "none",
               lazy: bool = True) -> Timing:
    import gossip

    model = torch.nn.Linear(1, 1, bias=False)
    model.weight = torch.nn.Parameter(torch.full((numel,), float(rank)))
    mark_baseline()
    with gossip.attach(model, rank=rank, world_size=WORLD, base_port=port, topology="ring",
                       secure=secure, overlap=overlap, ipc=ipc, compress=compress, lazy_snapshot=lazy) as averager:
        for _ in range(warmup):
            averager.step()
        return timed(averager.step, rounds)


def _pyzmq_ring(rank: int, port: int, ipc: bool = False):
    """A ROUTER bound for this rank and a DEALER to each ring neighbour: (context, router, dealers); over TCP
    loopback, or with ``ipc`` over the Unix sockets the transport uses for same-host peers."""
    import zmq

    from gossip.net.address import ipc_endpoint

    def address(peer: int) -> str:
        endpoint = f"tcp://127.0.0.1:{port + peer}"
        return ipc_endpoint(endpoint) if ipc else endpoint

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(address(rank))
    dealers = []
    for peer in ((rank + 1) % WORLD, (rank - 1) % WORLD):
        dealer = context.socket(zmq.DEALER)
        dealer.connect(address(peer))
        dealers.append(dealer)
    return context, router, dealers


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each thread of this process, by name: Python's name for a Python thread
    (MainThread: the training loop; gossip-loop-R: our event loop; Thread-N: pyzmq's collector, which frees
    zero-copy frames), the kernel's for the others (ZMQbg/IO/0: ZeroMQ's I/O thread; gloo_tcp_loop)."""
    named = {t.native_id: t.name for t in threading.enumerate()}
    seconds: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            name = named.get(int(tid)) or Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def timed(one_round, rounds: int) -> Timing:
    """Run ``rounds`` rounds: (wall seconds, CPU seconds of the whole process, every thread, and of each
    thread that lived through them) per round."""
    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    threads, begin, cpu_begin = thread_cpu(), time.perf_counter(), cpu()
    for _ in range(rounds):
        one_round()
    elapsed, total, after = (time.perf_counter() - begin) / rounds, (cpu() - cpu_begin) / rounds, thread_cpu()
    return elapsed, total, {name: (after[name] - threads[name]) / rounds for name in after if name in threads}


def _time_pyzmq(context, one_round, rounds: int, warmup: int) -> Timing:
    for _ in range(warmup):
        one_round()
    elapsed = timed(one_round, rounds)
    time.sleep(0.5)  # let the neighbours finish their last receive before the sockets go
    context.destroy(linger=0)
    return elapsed


def run_pyzmq(rank: int, numel: int, rounds: int, warmup: int, port: int) -> Timing:
    x = torch.full((numel,), float(rank))
    mark_baseline()
    context, router, dealers = _pyzmq_ring(rank, port)

    def one_round() -> None:
        for dealer in dealers:
            dealer.send(memoryview(x.numpy()), copy=False)
        received = []
        for _ in dealers:
            _, frame = router.recv_multipart(copy=False)
            received.append(torch.frombuffer(frame.buffer, dtype=torch.float32))
        mix(x, *received)

    return _time_pyzmq(context, one_round, rounds, warmup)


def run_pyzmq_frames(rank: int, numel: int, rounds: int, warmup: int, port: int,
                     ipc: bool = False) -> Timing:
    """The cheapest round we know with pyzmq: the live buffer sent uncopied in 8 MiB frames (tracked, so it
    is not changed while ZeroMQ reads it), every received frame checked by a sum as ``gossip.net.wire`` does,
    then a cache-blocked mix of three arrays. No threads, headers or mailbox: a floor for --no-overlap."""
    import math

    from gossip.alloc import keep_freed_memory

    keep_freed_memory()
    x = torch.full((numel,), float(rank))
    mark_baseline()
    context, router, dealers = _pyzmq_ring(rank, port, ipc)
    frame, block = (8 * MB) // 4, (2 * MB) // 4

    def one_round() -> None:
        views = [memoryview(x[i:i + frame].numpy()) for i in range(0, numel, frame)]
        trackers = [dealer.send_multipart(views, copy=False, track=True) for dealer in dealers]
        received = []
        for _ in dealers:
            chunks = [torch.frombuffer(f.buffer, dtype=torch.float32) for f in router.recv_multipart(copy=False)[1:]]
            if not all(math.isfinite(float(chunk.sum())) for chunk in chunks):
                raise ValueError("non-finite payload")
            received.append(chunks)
        for tracker in trackers:
            tracker.wait()
        for index, first in enumerate(range(0, numel, frame)):
            view = x[first:first + frame]
            for start in range(0, view.numel(), block):
                target = view[start:start + block]
                target.mul_(1 / 3)
                for chunks in received:
                    target.add_(chunks[index][start:start + block], alpha=1 / 3)

    return _time_pyzmq(context, one_round, rounds, warmup)


def run_gloo(rank: int, numel: int, rounds: int, warmup: int, port: int,
             mixing: bool = True) -> Timing:
    import torch.distributed as dist

    x = torch.full((numel,), float(rank))
    mark_baseline()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + WORLD}", rank=rank, world_size=WORLD)
    inbox = [torch.empty(numel), torch.empty(numel)]
    right, left = (rank + 1) % WORLD, (rank - 1) % WORLD

    def one_round() -> None:
        ops = [dist.P2POp(dist.isend, x, right), dist.P2POp(dist.isend, x, left),
               dist.P2POp(dist.irecv, inbox[0], left), dist.P2POp(dist.irecv, inbox[1], right)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        if mixing:
            mix(x, *inbox)

    for _ in range(warmup):
        one_round()
    dist.barrier()
    elapsed = timed(one_round, rounds)
    dist.barrier()
    dist.destroy_process_group()
    return elapsed


RUNNERS = {"gossip": run_gossip, "gossip-no-overlap": partial(run_gossip, overlap=False),
           # the round of a training loop: its weights change between mixing points, so each round copies
           "gossip-copy": partial(run_gossip, lazy=False), "gossip-copy-tcp": partial(run_gossip, lazy=False, ipc=False),
           "gossip-tcp": partial(run_gossip, ipc=False), "gossip-no-overlap-tcp": partial(run_gossip, overlap=False,
                                                                                          ipc=False),
           "pyzmq": run_pyzmq, "pyzmq-frames": run_pyzmq_frames,
           "pyzmq-frames-ipc": partial(run_pyzmq_frames, ipc=True),
           "gloo": run_gloo, "gloo-exchange": partial(run_gloo, mixing=False),
           "gossip-float16": partial(run_gossip, compress="float16"),  # --compress: CHOCO-gossip
           "gossip-int8": partial(run_gossip, compress="int8"),
           # CurveZMQ on every socket (--secure): encryption and authentication
           "gossip-secure": partial(run_gossip, secure=str(KEYDIR))}


def _peer(variant: str, rank: int, numel: int, rounds: int, warmup: int, port: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    elapsed, cpu, threads = RUNNERS[variant](rank, numel, rounds, warmup, port)
    with open("/proc/self/status") as status:  # VmHWM: ru_maxrss would carry the spawning parent's size over
        peak = int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) / 1024
    threads = {re.sub(r"-\d+$", "", name): seconds for name, seconds in threads.items()}  # (gossip-loop-R)
    results.put((rank, elapsed, peak, peak - _baseline_mb, cpu, threads))


def free_port_block(count: int) -> int:
    for base in range(31000, 40000, 17):
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def measure(variant: str, size_mb: float, rounds: int, warmup: int) -> tuple[float, float, float, float, dict]:
    """(seconds per round of the slowest peer, peak resident MB of the largest peer, the largest peak
    beyond a peer's resident memory before its exchange began, with its model built, in models, the CPU
    seconds a peer spends per round in all its threads, and in each thread, the means over the peers)."""
    numel = int(size_mb * MB) // 4
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port_block(WORLD + 1)
    procs = [context.Process(target=_peer, args=(variant, r, numel, rounds, warmup, port, results))
             for r in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        reports = [results.get(timeout=600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return (max(r[1] for r in reports), max(r[2] for r in reports),
            max(r[3] for r in reports) / (numel * 4 / MB), sum(r[4] for r in reports) / len(reports),
            {name: sum(r[5].get(name, 0.0) for r in reports) / len(reports) for name in reports[0][5]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,100", help="model sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (default: 2000 / size in MiB, "
                                                                   "at least 20), after a fifth as many to warm up")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant and size; the median is kept")
    parser.add_argument("--variants", default="gossip,gossip-no-overlap,gossip-tcp,gossip-no-overlap-tcp,pyzmq,gloo,"
                                              "gloo-exchange",
                        help="which of " + ", ".join(RUNNERS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "exchange.json")
    args = parser.parse_args()
    if "gossip-secure" in args.variants:
        from gossip.net.security import generate_keys

        generate_keys(KEYDIR, WORLD)
    rows = []
    for size in (float(s) for s in args.sizes.split(",")):
        # a few seconds per run at every size; the warm-up lets TCP's windows and buffers grow first
        rounds = args.rounds or max(20, int(2000 / size))
        warmup = max(3, rounds // 5)
        row = {"size_mb": size, "rounds": rounds}
        variants = args.variants.split(",")
        # Round-robin: every repeat measures each variant once, back to back, so that a ratio compares runs
        # that met the same load on this shared machine (a variant's repeats in one block would not).
        runs: dict[str, list[tuple[float, float, float, float, dict]]] = {variant: [] for variant in variants}
        for _ in range(args.repeats):
            for variant in variants:
                runs[variant].append(measure(variant, size, rounds, warmup))
        for variant in variants:
            samples = [elapsed for elapsed, *_ in runs[variant]]
            row[variant] = median(samples)
            row[f"{variant}_all"] = [round(s, 5) for s in samples]
            row[f"{variant}_peak_rss_mb"] = [round(rss) for _, rss, *_ in runs[variant]]
            row[f"{variant}_extra_models"] = [round(extra, 2) for _, _, extra, *_ in runs[variant]]
            row[f"{variant}_cpu_ms"] = [round(cpu * 1e3, 3) for _, _, _, cpu, _ in runs[variant]]
            row[f"{variant}_thread_cpu_ms"] = [{name: round(t * 1e3, 3) for name, t in threads.items() if t > 0}
                                               for *_, threads in runs[variant]]
            if "gloo" in runs and variant != "gloo":  # each repeat's ratio to the gloo run beside it
                row[f"{variant}_ratios"] = [round(ours[0] / gloo[0], 3) for ours, gloo in zip(runs[variant],
                                                                                               runs["gloo"])]
        rows.append(row)
        print(f"{size:6.0f} MiB  " + "  ".join(f"{v} {row[v]:.4f} s (peak RSS {max(row[f'{v}_peak_rss_mb'])} MB, "
                                               f"{max(row[f'{v}_extra_models'])} models beyond the model)"
                                               for v in RUNNERS if v in row), flush=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    print_table(rows, [v for v in RUNNERS if v in rows[0]])


LABELS = {"gossip": "gossip round", "gossip-no-overlap": "gossip round, --no-overlap",
          "gossip-copy": "gossip round, copying (training)", "gossip-copy-tcp": "gossip round, copying, --no-ipc",
          "gossip-tcp": "gossip round, --no-ipc", "gossip-no-overlap-tcp": "gossip round, --no-overlap --no-ipc",
          "pyzmq": "pyzmq, one frame + mix", "pyzmq-frames": "pyzmq, 8 MiB frames, checked, + mix",
          "pyzmq-frames-ipc": "pyzmq, 8 MiB frames, checked, + mix, ipc",
          "gloo": "gloo + mix", "gloo-exchange": "gloo exchange only",
          "gossip-float16": "gossip round, --compress float16", "gossip-int8": "gossip round, --compress int8",
          "gossip-secure": "gossip round, --secure"}


def print_table(rows: list[dict], variants: list[str]) -> None:
    """The markdown tables of BENCHMARKS.md: median seconds per round, then each variant's ratio to gloo + mix:
    the median of the repeats' ratios to the gloo run beside each, with their range; then the CPU a peer
    spends per round, in all its threads (median of the repeats, with their range)."""
    ratios = [v for v in variants if v not in ("gloo", "gloo-exchange")] if "gloo" in variants else []
    print("\n| model | " + " | ".join(LABELS[v] for v in variants) + "".join(f" | {LABELS[v]} / gloo + mix"
                                                                             for v in ratios) + " |")
    print("| --- |" + " --- |" * (len(variants) + len(ratios)))
    for row in rows:
        cells = [f"{row[v]:.4f} s" for v in variants] + [
            f"{median(row[f'{v}_ratios']):.2f} ({min(row[f'{v}_ratios']):.2f}-{max(row[f'{v}_ratios']):.2f})"
            for v in ratios]
        print(f"| {row['size_mb']:.0f} MiB | " + " | ".join(cells) + " |")
    print("\nCPU per peer per round, all threads (ms)\n\n| model | " + " | ".join(LABELS[v] for v in variants) + " |")
    print("| --- |" + " --- |" * len(variants))
    for row in rows:
        cells = [f"{median(row[f'{v}_cpu_ms']):.2f} ({min(row[f'{v}_cpu_ms']):.2f}-{max(row[f'{v}_cpu_ms']):.2f})"
                 for v in variants]
        print(f"| {row['size_mb']:.0f} MiB | " + " | ".join(cells) + " |")
    print("\nBy thread, in the repeat of median CPU (ms per round; threads that lived through the timed rounds)\n")
    for row in rows:
        for v in variants:
            cpus = row[f"{v}_cpu_ms"]
            threads = row[f"{v}_thread_cpu_ms"][cpus.index(sorted(cpus)[len(cpus) // 2])]
            print(f"- {row['size_mb']:.0f} MiB, {LABELS[v]}: " + ", ".join(
                f"{name} {ms:.2f}" for name, ms in sorted(threads.items(), key=lambda item: -item[1]) if ms >= 0.01))


if __name__ == "__main__":
    main()

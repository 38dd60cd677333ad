"""One gossip round in a 3-peer ring: exchange weights with both neighbours, then mix.

Three implementations of the same round, measured in the same run on the same machine:

- ``gossip``: this project: ``gossip.attach`` on a model of the given size, gossip-sync on a ring, one
  ``averager.step()`` per round (snapshot copy, send in 8 MiB frames, receive, mix chunk by chunk).
- ``pyzmq``: a plain pyzmq exchange of the same bytes as one zero-copy frame (DEALER -> ROUTER), then the
  same mix.
- ``gloo``: ``torch.distributed`` with the gloo backend, isend/irecv with both neighbours into
  preallocated buffers, then the same mix; ``gloo-exchange`` is the same without the mix.

Every peer is its own process with one torch thread. Reported: seconds per round (the slowest peer's
mean over the timed rounds, after warm-up rounds), and the ratio to gloo.

    python bench/exchange.py                      # sizes 1, 16, 100 MB
    python bench/exchange.py --sizes 100 --rounds 20
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORLD = 3
MB = 1 << 20


def mix(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    x.mul_(1 / 3).add_(a, alpha=1 / 3).add_(b, alpha=1 / 3)  # Metropolis-Hastings weights of a 3-ring


def run_gossip(rank: int, numel: int, rounds: int, warmup: int, port: int, secure: str = "") -> float:
    import gossip

    model = torch.nn.Linear(1, 1, bias=False)
    model.weight = torch.nn.Parameter(torch.full((numel,), float(rank)))
    with gossip.attach(model, rank=rank, world_size=WORLD, base_port=port, topology="ring",
                       secure=secure) as averager:
        for _ in range(warmup):
            averager.step()
        begin = time.perf_counter()
        for _ in range(rounds):
            averager.step()
        return (time.perf_counter() - begin) / rounds


def run_pyzmq(rank: int, numel: int, rounds: int, warmup: int, port: int) -> float:
    import zmq

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port + rank}")
    dealers = []
    for peer in ((rank + 1) % WORLD, (rank - 1) % WORLD):
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port + peer}")
        dealers.append(dealer)
    x = torch.full((numel,), float(rank))

    def one_round() -> None:
        for dealer in dealers:
            dealer.send(memoryview(x.numpy()), copy=False)
        received = []
        for _ in dealers:
            _, frame = router.recv_multipart(copy=False)
            received.append(torch.frombuffer(frame.buffer, dtype=torch.float32))
        mix(x, *received)

    for _ in range(warmup):
        one_round()
    begin = time.perf_counter()
    for _ in range(rounds):
        one_round()
    elapsed = (time.perf_counter() - begin) / rounds
    time.sleep(0.5)  # let the neighbours finish their last receive before the sockets go
    context.destroy(linger=0)
    return elapsed


def run_gloo(rank: int, numel: int, rounds: int, warmup: int, port: int, mixing: bool = True) -> float:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + WORLD}", rank=rank, world_size=WORLD)
    x = torch.full((numel,), float(rank))
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
    begin = time.perf_counter()
    for _ in range(rounds):
        one_round()
    elapsed = (time.perf_counter() - begin) / rounds
    dist.barrier()
    dist.destroy_process_group()
    return elapsed


def run_gossip_secure(rank: int, numel: int, rounds: int, warmup: int, port: int) -> float:
    """The same round with CurveZMQ on every socket (--secure): encryption and authentication."""
    keydir = ROOT / "bench" / "results" / "exchange-keys"
    return run_gossip(rank, numel, rounds, warmup, port, secure=str(keydir))


def run_gloo_exchange(rank: int, numel: int, rounds: int, warmup: int, port: int) -> float:
    return run_gloo(rank, numel, rounds, warmup, port, mixing=False)


RUNNERS = {"gossip": run_gossip, "pyzmq": run_pyzmq, "gloo": run_gloo, "gloo-exchange": run_gloo_exchange,
           "gossip-secure": run_gossip_secure}


def _peer(variant: str, rank: int, numel: int, rounds: int, warmup: int, port: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    results.put((rank, RUNNERS[variant](rank, numel, rounds, warmup, port)))


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


def measure(variant: str, size_mb: float, rounds: int, warmup: int) -> float:
    numel = int(size_mb * MB) // 4
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port_block(WORLD + 1)
    procs = [context.Process(target=_peer, args=(variant, r, numel, rounds, warmup, port, results))
             for r in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        times = dict(results.get(timeout=600) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return max(times.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,100", help="model sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (default: by size)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant and size; the median is kept")
    parser.add_argument("--variants", default="gossip,pyzmq,gloo,gloo-exchange",
                        help="which of " + ", ".join(RUNNERS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "exchange.json")
    args = parser.parse_args()
    if "gossip-secure" in args.variants:
        from gossip.security import generate_keys

        generate_keys(ROOT / "bench" / "results" / "exchange-keys", WORLD)
    rows = []
    for size in (float(s) for s in args.sizes.split(",")):
        rounds = args.rounds or max(10, int(400 / size))
        row = {"size_mb": size, "rounds": rounds}
        for variant in args.variants.split(","):
            samples = sorted(measure(variant, size, rounds, warmup=3) for _ in range(args.repeats))
            row[variant] = samples[len(samples) // 2]
            row[f"{variant}_all"] = samples
        rows.append(row)
        print(f"{size:6.0f} MiB  " + "  ".join(f"{v} {row[v]:.4f} s" for v in RUNNERS if v in row), flush=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    if set(RUNNERS) - set(rows[0]):
        return
    print("\n| model | gossip round | pyzmq, one frame + mix | gloo + mix | gloo exchange only "
          "| gossip / gloo+mix | gossip / gloo exchange | pyzmq / gloo+mix |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['size_mb']:.0f} MiB | {row['gossip']:.4f} s | {row['pyzmq']:.4f} s | {row['gloo']:.4f} s | "
              f"{row['gloo-exchange']:.4f} s | {row['gossip'] / row['gloo']:.2f} | "
              f"{row['gossip'] / row['gloo-exchange']:.2f} | {row['pyzmq'] / row['gloo']:.2f} |")


if __name__ == "__main__":
    main()

"""``gossip-peer`` / ``python -m launch.peer``: one peer started on its own, by hand, by torchrun, srun or
mpirun, or by ``gossip-launch --hosts`` over ssh. It takes the launcher's run flags (except ``--nodes``
and the launcher's own) plus ``--rank``, ``--world-size``, ``--announce``, ``--initial-peers`` and the
rendezvous flags; ``gossip.rendezvous`` says which source wins. For example::

    gossip-peer --world-size 4 --bind 0.0.0.0        # first machine: prints the line for the others
    gossip-peer --initial-peers tcp://10.0.0.1:46999  # every other machine
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --max-restarts 0 -m launch.peer --steps 500

The peer writes ``peer-<rank>.jsonl``, ``model-<rank>.pt`` and ``trace-<rank>.npz`` (and ``config.json``)
into ``--out`` on its own host; collect them into one directory and ``python -m launch.summary DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gossip.config import RendezvousConfig, RunConfig
from gossip.errors import ConfigError, TaskError
from gossip.exit import exit_now
from gossip.net.address import bindable
from gossip.rendezvous import Plan, hosts_server_endpoint, plan_rendezvous
from launch.flags import (
    PEER_COMMAND_FLAGS,
    SHARED_FLAGS,
    FlagParser,
    add_flags,
    config_from_args,
    field_values,
    flag_argv,
    rendezvous_from_args,
)

PROG = "gossip-peer"
# fields that may differ between the peers of one run: where and how each runs, not what it computes
PER_PEER = frozenset({"out", "device", "threads_per_peer", "log_every", "host", "bind", "base_port", "endpoints",
                      "server_endpoint", "rank", "world_size", "nodes", "queue_depth", "round_timeout",
                      "startup_timeout", "send_timeout", "shutdown_timeout"})


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog=PROG, description="One gossip peer started on its own: by hand on each machine, under "
                        "torchrun, srun or mpirun, or by gossip-launch --hosts.")
    add_flags(parser, PEER_COMMAND_FLAGS)
    return parser


def run_flags(cfg: RunConfig) -> dict[str, Any]:
    """The values every peer of one run must share (checked at the rendezvous)."""
    return {name: value for name, value in field_values(cfg).items() if name not in PER_PEER}


def agreed_flags(cfg: RunConfig, args: argparse.Namespace, world_size: int | None) -> dict[str, Any]:
    """``run_flags`` as this peer offers them at the rendezvous. A peer that does not know the world size
    yet checked its flags on a stand-in (``provisional_config``): it offers the topology and speeds it was
    given, not the stand-in's, and no ``peer_speeds``, which ``--speeds`` and the world size make."""
    flags = run_flags(cfg)
    flags.pop("peer_speeds", None)
    if not world_size:
        flags.update(topology=args.topology, speeds=tuple(args.speeds))
    return flags


def next_machine_line(cfg: RunConfig, store: str) -> str:
    shared = {k: v for k, v in field_values(cfg).items() if k not in PER_PEER or k in ("threads_per_peer", "base_port")}
    return " ".join(["python -m launch.peer", "--initial-peers", store, *flag_argv(shared, SHARED_FLAGS)])


def provisional_config(args: argparse.Namespace, world_size: int | None) -> RunConfig:
    """Check the flags before any network: with the world size when it is known, else for a stand-in."""
    if world_size:
        return config_from_args(args, nodes=world_size)
    stand_in = argparse.Namespace(**{**vars(args), "speeds": (), "topology": "ring"})
    return config_from_args(stand_in, nodes=1)


def meet(args: argparse.Namespace, rendezvous: RendezvousConfig, plan: Plan) -> tuple[RunConfig, int, str]:
    """Rendezvous: (this peer's RunConfig, its local rank, the run name agreed on)."""
    from gossip import rendezvous_store as exchange

    base_port = args.base_port
    cfg = provisional_config(args, plan.world_size)
    if plan.endpoints:  # --hosts: nothing to exchange
        server_endpoint = hosts_server_endpoint(rendezvous.hosts, base_port) if cfg.gossip.parameter_server else ""
        return _finish(args, plan.world_size, plan.rank, plan.endpoints, server_endpoint), plan.local_rank, ""
    if plan.store is None:  # alone
        return _finish(args, 1, 0, (), ""), plan.local_rank, ""
    announce = exchange.announce_address(rendezvous.announce, args.bind, plan.store[0] or None)
    # a store this peer serves listens where the peer will (GossipConfig.bind_endpoint), not everywhere
    network = cfg.gossip.network
    meeting = exchange.StoreRendezvous(plan, rendezvous.rendezvous_timeout, bind=network.bind or bindable(announce),
                                       keydir=network.secure)
    meeting.open()
    try:
        if plan.source == "first peer":
            store = f"tcp://{announce}:{plan.store[1]}"
            print(f"{PROG}: first peer of {plan.world_size}, rendezvous at {store}; on every other machine run:\n"
                  f"  {next_machine_line(cfg, store)}", flush=True)

        def endpoint_of(rank: int) -> str:  # the server's rank is the world size: it listens on BASE_PORT + N
            exchange.check_port(cfg.gossip.network.bind or bindable(announce), base_port + rank,
                                "the server" if args.server else f"peer {rank}")
            return f"tcp://{announce}:{base_port + rank}"

        offered = agreed_flags(cfg, args, plan.world_size)
        assignment = meeting.join(endpoint_of, offered, plan.world_size, plan.rank, args.server,
                                  cfg.gossip.parameter_server, time.strftime("%Y%m%d-%H%M%S"))
    finally:
        meeting.close()
    cfg = _finish(args, assignment.world_size, assignment.rank, assignment.endpoints, assignment.server_endpoint)
    return cfg, plan.local_rank, assignment.run_name


def _finish(args: argparse.Namespace, world_size: int, rank: int | None, endpoints: tuple[str, ...],
            server_endpoint: str) -> RunConfig:
    cfg = config_from_args(args, nodes=world_size)
    gossip = cfg.gossip.replace(rank=rank or 0, endpoints=endpoints, server_endpoint=server_endpoint)
    return dataclasses.replace(cfg, gossip=gossip)


def prepare_out(cfg: RunConfig, name: str, given: bool, server: bool) -> Path:
    out = Path(cfg.out if given else f"runs/{name or Path(cfg.out).name}")
    mine = out / ("server.jsonl" if server else f"peer-{cfg.gossip.rank}.jsonl")
    if mine.exists():
        raise ConfigError(f"{out} already holds {mine.name} from an earlier run; choose another --out or remove it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        partial = out / f".config-{os.getpid()}.json"
        partial.write_text(cfg.to_json())
        partial.replace(out / "config.json")  # peers sharing the directory write it whole, one after another
    except OSError as exc:
        raise ConfigError(f"cannot write to the output directory {out}: {exc.strerror}; choose another --out") from exc
    return out


def stop_when_stdin_closes() -> None:
    """Started over ssh by gossip-launch: when the launcher stops us or dies, ssh closes our standard input;
    then stop as on SIGTERM (ssh forwards no signals without a terminal)."""

    def wait_for_eof() -> None:
        while os.read(0, 4096):  # unbuffered: a blocked sys.stdin would hold its lock at interpreter exit
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait_for_eof, name="stop-on-eof", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("GOSSIP_STOP_ON_EOF") == "1":
        stop_when_stdin_closes()
    # torch's C++ side warns, with a stack trace, about every rendezvous-store connection that ends; our own
    # errors say what went wrong in one line (read when torch is imported; a user's setting wins)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        rendezvous = rendezvous_from_args(args)
        plan = plan_rendezvous(rendezvous, args.base_port, os.environ, server=args.server)
        provisional_config(args, plan.world_size)
        from gossip.tasks import load_task

        load_task(args.task)  # an unknown task fails here, before any network
    except (ConfigError, TaskError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    import torch

    from gossip.peer import guarded, name_logs, run_role  # imports torch

    name = "server" if args.server else "peer"

    def body() -> None:
        nonlocal name
        cfg, local_rank, run_name = meet(args, rendezvous, plan)
        if not args.server:
            name = f"peer {cfg.gossip.rank}"
            name_logs(name)
        out = prepare_out(cfg, run_name, bool(args.out), args.server)
        torch.set_num_threads(cfg.threads_per_peer)
        run_role(cfg, out, args.server, local_rank)

    return guarded(lambda: name, body)


def entry_point() -> None:
    exit_now(main())


if __name__ == "__main__":
    exit_now(main())

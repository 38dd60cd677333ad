"""``gossip-launch --hosts a:4,b:2`` (or ``--hostfile FILE``): start every host's peers, here or over ssh.

Ranks are dealt out in host order (0-3 on a, 4-5 on b); peer r listens on port BASE_PORT + r of its host,
and every peer computes every endpoint from the host list, so no rendezvous is needed. The parameter
server of a ps-* run starts on the first host, on port BASE_PORT + world size.

Peers on this machine (localhost, a loopback or local address, this host's name) start like local peers.
The others start through ``REMOTE_SHELL HOST 'cd CWD && exec PYTHON -m launch.peer FLAGS --hosts SPEC
--rank R'``: with ssh (the default ``--remote-shell``) the project must be importable by that python on
every host, at the same working directory (a shared home or the same checkout), and ssh must log in
without a password. A remote peer stops when its standard input closes (``GOSSIP_STOP_ON_EOF``), which
ssh does when the launcher stops it or dies, so no peer outlives the launcher.

Every peer writes into ``--out`` on its own host. When all files are here (one host, or a shared file
system) the launcher summarises; otherwise it says how to collect them for ``python -m launch.summary``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from gossip.config import RendezvousConfig, RunConfig
from gossip.errors import ConfigError
from gossip.net.address import host_of_rank, is_ip, is_loopback, parse_hostfile, parse_hosts
from gossip.rendezvous import hosts_endpoints, hosts_server_endpoint
from gossip.tasks import check_task, load_task
from launch.flags import SHARED_FLAGS, config_from_args, field_values, flag_argv
from launch.local import Member, check_ports, prepare_out, supervise
from launch.procs import start_peer, warm_up_for_fork


def host_spec(rendezvous: RendezvousConfig) -> str:
    if rendezvous.hosts:
        return rendezvous.hosts
    try:
        text = Path(rendezvous.hostfile).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the hostfile {rendezvous.hostfile}: {exc.strerror}") from exc
    return parse_hostfile(text)


def is_local(host: str) -> bool:
    """Is ``host`` this machine? By name, or because one of its addresses can be bound here."""
    if is_loopback(host) or host in (socket.gethostname(), socket.getfqdn()):
        return True
    if not is_ip(host):
        return False
    with socket.socket() as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


def run_config(args: argparse.Namespace, spec: str, nodes_given: bool) -> RunConfig:
    world_size = sum(slots for _, slots in parse_hosts(spec))
    if nodes_given and args.nodes != world_size:
        raise ConfigError(f"--nodes {args.nodes} but --hosts has {world_size} slots; leave --nodes out with --hosts")
    cfg = config_from_args(args, nodes=world_size)
    server = hosts_server_endpoint(spec, cfg.gossip.network.base_port) if cfg.gossip.parameter_server else ""
    gossip = cfg.gossip.replace(endpoints=hosts_endpoints(spec, cfg.gossip.network.base_port), server_endpoint=server)
    return dataclasses.replace(cfg, out=str(Path(cfg.out).absolute()), gossip=gossip)


def remote_command(cfg: RunConfig, rendezvous: RendezvousConfig, spec: str, host: str, role: list[str]) -> list[str]:
    values = field_values(cfg, dataclasses.replace(rendezvous, hosts=spec, hostfile=""))
    argv = flag_argv({k: v for k, v in values.items() if k != "endpoints"}, SHARED_FLAGS) + role
    python = rendezvous.remote_python or sys.executable
    line = (f"cd {shlex.quote(os.getcwd())} && GOSSIP_STOP_ON_EOF=1 OMP_NUM_THREADS={cfg.threads_per_peer} "
            f"PYTHONUNBUFFERED=1 exec {shlex.quote(python)} -m launch.peer {shlex.join(argv)}")
    return [*shlex.split(rendezvous.remote_shell), host, line]


def start_remote(command: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "wb") as log_file:
        try:
            return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as exc:
            raise ConfigError(f"cannot run --remote-shell {command[0]!r}: {exc.strerror}") from exc


def spawn(cfg: RunConfig, rendezvous: RendezvousConfig, spec: str, out: Path, method: str) -> list[Member]:
    """Start the server (first host) and every peer on its host; write peers.json."""
    hosts = parse_hosts(spec)
    env = {"GOSSIP_LAUNCHER_PID": str(os.getpid()), "OMP_NUM_THREADS": str(cfg.threads_per_peer),
           "PYTHONUNBUFFERED": "1"}
    config = str(out / "config.json")
    if method == "fork":
        warm_up_for_fork()
    roles = ([(cfg.nodes, hosts[0][0], ["--server"], "server")] if cfg.gossip.parameter_server else [])
    roles += [(r, host_of_rank(hosts, r), ["--rank", str(r)], f"peer-{r}") for r in range(cfg.nodes)]
    started = {}
    for rank, host, role, name in roles:
        log_path = out / f"{name}.log"
        if is_local(host):
            started[rank] = start_peer(method, [config, *role], log_path, env)
        else:
            started[rank] = start_remote(remote_command(cfg, rendezvous, spec, host, role), log_path)
    order = sorted(started)  # workers first, the server last, as the launcher's watch expects
    peers = [{"rank": r, "role": "server" if r == cfg.nodes else ("worker" if cfg.gossip.parameter_server else "peer"),
              "host": host_of_rank(hosts, r) if r < cfg.nodes else hosts[0][0], "pid": started[r].pid,
              "endpoint": cfg.gossip.endpoint(r)} for r in order]
    (out / "peers.json").write_text(json.dumps(peers, indent=2))
    return [Member("server" if r == cfg.nodes else f"peer {r}", [],
                   out / ("server.log" if r == cfg.nodes else f"peer-{r}.log"), started[r]) for r in order]


def collected(cfg: RunConfig, out: Path, spec: str) -> bool:
    """Are every peer's files here? If not, say where they are and how to summarise them."""
    absent = [r for r in range(cfg.nodes) if not (out / f"trace-{r}.npz").exists()]
    if not absent:
        return True
    hosts = sorted({host_of_rank(parse_hosts(spec), r) for r in absent})
    print(f"gossip-launch: peers on {', '.join(hosts)} wrote their files into {out} on those hosts; collect them "
          f"here (e.g. rsync -a {hosts[0]}:{out}/ {out}/) and run: python -m launch.summary {out}")
    return False


def run_hosts(args: argparse.Namespace, rendezvous: RendezvousConfig, nodes_given: bool, progress: str,
              start_method: str, plot: bool) -> int:
    spec = host_spec(rendezvous)
    cfg = run_config(args, spec, nodes_given)
    load_task(cfg.task)
    check_task(cfg)  # the data as this host has it; every host must hold the same (the summary shows its hash)
    hosts = parse_hosts(spec)
    local_ranks = [r for r in range(cfg.nodes) if is_local(host_of_rank(hosts, r))]
    if cfg.gossip.parameter_server and is_local(hosts[0][0]):
        local_ranks.append(cfg.nodes)
    check_ports(cfg, local_ranks)
    out = prepare_out(cfg)
    return supervise(cfg, out, lambda: spawn(cfg, rendezvous, spec, out, start_method), progress, plot,
                     summarise_ready=lambda: collected(cfg, out, spec))

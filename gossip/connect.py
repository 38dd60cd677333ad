"""Building a process's transport from the run's configuration: the one place that decides which
endpoints, CurveZMQ keys, emulated latencies, liveness callbacks and inbound limits a gossip peer, a
parameter-server worker or the parameter server itself gets. ``connector`` is the ``connect`` argument
(``gossip/link.py``) that ``Averager`` and ``ParameterServer`` call with their mailbox when given none.
"""

from __future__ import annotations

from functools import partial

from gossip.config import GossipConfig
from gossip.link import Connect
from gossip.mailbox import Mailbox
from gossip.net.security import CurveKeys, load_keys
from gossip.net.transport import Transport, TransportConfig
from gossip.net.wire import DTYPES, MAX_CHUNK_BYTES, MAX_HEADER_BYTES, Layout

# complete messages one connection may hold in libzmq beyond one being assembled before the inbound guard
# cuts it: sync, push-sum and the ps modes keep a neighbour at most 2 ahead (lockstep, push-sum's flow
# window, the server's answers); gossip-async's latest rule does not wait, so on TCP a neighbour that runs
# further ahead of a starved receiver is cut and reconnects, and over the Unix socket, which the guard
# cannot count, its messages wait in libzmq
RECV_QUEUE = 4


def connector(config: GossipConfig, rank: int, layout: Layout, *, server: bool = False) -> Connect:
    """``connect(mailbox)``: the ZeroMQ transport of ``rank`` (``build_transport``), delivering to ``mailbox``."""
    return partial(build_transport, config, rank, layout, server=server)


def build_transport(config: GossipConfig, rank: int, layout: Layout, mailbox: Mailbox, *,
                    server: bool = False) -> Transport:
    """The transport of ``rank``, delivering to ``mailbox`` and telling it of dead links and of a failed
    task. The parameter server (``server``) watches no links and adds no emulated latency of its own."""
    ranks = config.world_size + (1 if config.parameter_server else 0)  # the server is the last rank
    endpoints = [config.endpoint(r) for r in range(ranks)]
    latency = [ms / 1000 for ms in config.network.link_latency_ms] or [0.0] * config.world_size
    latency += [0.0] * (ranks - len(latency))  # the parameter server's access has no emulated latency
    # one-way latency of a link = that of the sender's access plus the receiver's
    delays = [0.0] * ranks if server else [latency[rank] + latency[dest] for dest in range(ranks)]
    network, timeouts = config.network, config.timeouts
    options = TransportConfig(queue_depth=network.queue_depth, shutdown_timeout=timeouts.shutdown_timeout,
                              keys=transport_keys(config, rank), delays=tuple(delays),
                              heartbeat_timeout=timeouts.peer_timeout, ipc=network.ipc, **inbound_limits(layout, ranks))
    return Transport(rank, config.bind_endpoint(rank), endpoints, mailbox.deliver, options,
                     on_link=None if server else mailbox.link, on_failure=mailbox.fail,
                     on_closed=mailbox.connection_closed)


def transport_keys(config: GossipConfig, rank: int) -> CurveKeys | None:
    """This process's CurveZMQ keys when ``config.network.secure`` names a key directory."""
    keydir = config.network.secure
    return load_keys(keydir, rank, config.world_size, config.parameter_server) if keydir else None


def inbound_limits(layout: Layout, ranks: int) -> dict[str, int]:
    """What the protocol allows a connection to send us (``Transport``'s limits): frames no larger than
    our largest payload frame, messages no larger than our model, four complete messages queued per
    connection, and a few connections per rank that may talk to us."""
    largest = max((stop - start) * DTYPES[layout.dtypes[segment]].itemsize
                  for segment, start, stop in layout.frame_plan(layout.chunk_bytes or MAX_CHUNK_BYTES))
    return {"recv_queue": RECV_QUEUE, "max_frame_bytes": largest,
            "max_message_bytes": layout.total_bytes + MAX_HEADER_BYTES, "max_connections": 2 * ranks + 16}

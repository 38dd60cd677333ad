"""The network layer: the only code that touches ZeroMQ.

- ``wire``: the message format (a msgpack header and raw tensor frames) and its validation; ``limits``: the
  header's bounds, readable without torch;
- ``transport``: what the library sees of the network (``Transport``): one event loop per process owning
  every socket, composed of ``receiver`` (a ROUTER to receive), ``sender`` and ``outbox`` (a DEALER per
  neighbour behind a bounded queue; heartbeats, link monitors, emulated latency) and supervised tasks;
- ``guard``: what a connection may cost (bytes parked in libzmq, in either direction; connection count;
  descriptors);
- ``loop``: the event-loop thread; ``sockets``: opening one; ``security``: CurveZMQ keys and the allow-list;
  ``address``: endpoints and the same-host Unix socket.

It imports nothing of ``gossip`` but ``gossip.errors`` and ``gossip.alloc``. The rest of the package uses
its pure parts (the wire format, addresses, keys) and gets its sockets from the one transport that
``gossip/connect.py`` (``build_transport``) constructs, whose handler is a mailbox's ``deliver``.
``tests/test_layout.py`` checks these rules.
"""

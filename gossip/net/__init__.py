"""The network layer: the only code that touches ZeroMQ.

- ``wire``: the message format (a msgpack header and raw tensor frames) and its validation;
- ``transport``: what the library sees of the network (``Transport``): one event loop per process owning
  every socket, composed of ``receiver`` (a ROUTER to receive), ``sender`` and ``outbox`` (a DEALER per
  neighbour behind a bounded queue; heartbeats, link monitors, emulated latency) and supervised tasks;
- ``guard``: what a connection may cost (bytes parked in libzmq, in either direction; connection count;
  descriptors);
- ``loop``: the event-loop thread; ``sockets``: opening one; ``security``: CurveZMQ keys and the allow-list;
  ``address``: endpoints and the same-host Unix socket.

It imports nothing of ``gossip`` but ``gossip.errors`` and ``gossip.alloc``; the rest of the package
reaches the network through ``gossip/connect.py`` (``build_transport``) and the mailboxes
(``Mailbox.deliver`` is the transport's handler). ``tests/test_layout.py`` enforces both rules.
"""

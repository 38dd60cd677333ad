"""The network layer: the only code that touches ZeroMQ.

- ``wire``: the message format (a msgpack header and raw tensor frames) and its validation;
- ``transport``: one event loop per process owning every socket (a ROUTER to receive, a DEALER per
  neighbour), heartbeats, link monitors, supervised tasks;
- ``inbound``: what incoming connections may cost (bytes parked in libzmq, connection count);
- ``loop``: the event-loop thread; ``security``: CurveZMQ keys and the allow-list; ``address``: endpoints
  and the same-host Unix socket.

It imports nothing of ``gossip`` but ``gossip.errors`` and ``gossip.alloc``; the rest of the package
reaches the network through ``gossip/connect.py`` (``build_transport``) and the mailboxes
(``Mailbox.deliver`` is the transport's handler). ``tests/test_layout.py`` enforces both rules.
"""

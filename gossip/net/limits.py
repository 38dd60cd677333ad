"""The header's bounds, apart from the wire format (``wire.py``) so that the flag checks can read them
without loading torch."""

MAX_HEADER_BYTES = 4096
# gossip-async's headers carry a step count per peer (gossip/progress.py): at most 9 bytes each in msgpack,
# so 256 of them leave room for the rest of a header
MAX_PROGRESS_PEERS = 256

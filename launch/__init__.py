"""The command line: start a local run of N peers (``python -m launch`` or ``gossip-launch``)."""

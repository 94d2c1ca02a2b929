"""Small networking helpers shared by the trainer and the launchers (no torch import)."""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a local rendezvous or test server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""Free TCP ports on 127.0.0.1 for the servers, clusters and rendezvous the tests start."""

from __future__ import annotations

import socket


def free_port(count: int = 1) -> int:
    """A port no process listens on now, with the `count - 1` after it free too (node i's slurmd listens on the
    first + i)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            first = sock.getsockname()[1]
        if first + count <= 65536 and all(bindable(first + i) for i in range(1, count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True

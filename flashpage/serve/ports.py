"""Free loopback ports for the servers and rendezvous flashpage starts itself (no dependencies)."""

from __future__ import annotations

import socket
from collections.abc import Collection


def free_port(avoid: Collection[int] = ()) -> int:
    """A loopback TCP port free now, other than those in ``avoid``: ports already handed out for this launch,
    not bound yet (the kernel may give a port just released, such as one probed as free a moment ago,
    to the next ``bind(0)``)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port

"""The HTTP server of the trainer's and the rollout pods' endpoints (/status and /metrics,
/livez, the rollout API), on an IPv4 or an IPv6 address (`addresses`)."""

from __future__ import annotations

import errno
import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Any

from rlft.trainer.addresses import ALL

_NO_IPV6 = (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT)


class HTTPServer(ThreadingHTTPServer):
    """A threading HTTP server on an IPv4 or an IPv6 host. `ALL` (`::`) also takes IPv4
    connections (IPV6_V6ONLY off, whatever the node's default); where the kernel has no
    IPv6 it binds `0.0.0.0` instead."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, *args: Any, **kwargs: Any):
        host, port = address
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            super().__init__((host, port), handler, *args, **kwargs)
        except OSError as error:
            if host != ALL or error.errno not in _NO_IPV6:
                raise
            self.address_family = socket.AF_INET
            super().__init__(("0.0.0.0", port), handler, *args, **kwargs)

    def serve_in_background(self, name: str, poll_interval: float = 0.5) -> threading.Thread:
        """Serve on a daemon thread of its own (stop it with `shutdown()`)."""
        thread = threading.Thread(
            target=self.serve_forever,
            kwargs={"poll_interval": poll_interval},
            name=name,
            daemon=True,
        )
        thread.start()
        return thread

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

"""A loopback TCP relay that keeps a copy of every byte it passes: what a wire tap would see."""

from __future__ import annotations

import selectors
import socket
import threading


class TcpTap:
    """Listens on a free loopback port and relays each connection to `target` ("host:port")."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = "tcp://127.0.0.1:%d" % self._listener.getsockname()[1]
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        while not self._stop.is_set():
            for key, _ in selector.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)  # (only sockets are registered)
                if sock is self._listener:
                    client, _ = self._listener.accept()
                    upstream = socket.create_connection(self._target)
                    peers[client], peers[upstream] = upstream, client
                    selector.register(client, selectors.EVENT_READ)
                    selector.register(upstream, selectors.EVENT_READ)
                    continue
                data = sock.recv(1 << 16)
                if not data:
                    for s in (sock, peers.pop(sock)):
                        selector.unregister(s)
                        peers.pop(s, None)
                        s.close()
                    continue
                with self._lock:
                    self.seen += data
                peers[sock].sendall(data)
        for s in peers:
            s.close()
        self._listener.close()

    def saw(self, data: bytes) -> bool:
        with self._lock:
            return data in self.seen

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

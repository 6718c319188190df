"""TCP relays across network namespaces: how the multi-node lab's processes reach what lives elsewhere.

Each node of a multi-node lab is a network namespace of its own (:mod:`podmeter.lab.fabric`), but its
``podmeter node`` and agent must reach the API server, which listens in the runner's namespace (the
embedded one, on loopback) or anywhere the runner can reach (``--kubeconfig``); and the runner must reach
each agent's HTTP endpoints, which answer ``/debug/*`` to loopback clients only. A relay listens in one
namespace and joins every connection it accepts to a new connection made from another, like ``kubectl
port-forward``: the API server relay listens *on the server's own address* inside each node namespace
(the same kubeconfig works everywhere, TLS names included), the agent relays listen on a loopback port of
the runner's namespace and connect to the agent's loopback address inside its node.

A socket belongs to the namespace of the thread that created it, for good: listeners and outgoing sockets
are created inside their namespace (:func:`podmeter.lab.netns.in_namespace`, one thread, a moment), and
everything else happens on plain threads of the runner's namespace. Threads, not a selector: a relay
carries a few dozen connections (watches, requests) of a lab, and a thread per direction keeps half-closes
(a request body's end, a watch's EOF) exactly as the two ends make them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass, field

from podmeter.lab.netns import in_namespace

log = logging.getLogger("podmeter.lab")
CHUNK = 65536


@dataclass
class _Listener:
    sock: socket.socket
    target: tuple[str, int]
    target_netns: str | None
    connections: set[socket.socket] = field(default_factory=set)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET


def _socket_in(netns: str | None, family: socket.AddressFamily) -> socket.socket:
    if netns is None:
        return socket.socket(family, socket.SOCK_STREAM)
    with in_namespace(netns):
        return socket.socket(family, socket.SOCK_STREAM)


class Relays:
    """Every relay of one lab run; :meth:`close` ends them all (listeners and open connections)."""

    def __init__(self) -> None:
        self._listeners: list[_Listener] = []
        self._lock = threading.Lock()
        self._closed = False

    def add(self, listen: tuple[str, int], target: tuple[str, int], *, listen_netns: str | None = None,
            target_netns: str | None = None) -> tuple[str, int]:
        """Listen on ``listen`` (an IP literal and a port, 0: any) inside ``listen_netns`` (None: the
        caller's) and relay each connection to ``target`` reached from ``target_netns``; returns the
        address it listens on."""
        sock = _socket_in(listen_netns, _family(listen[0]))
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(listen)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        listener = _Listener(sock, target, target_netns)
        with self._lock:
            self._listeners.append(listener)
        threading.Thread(target=self._accept, args=(listener,), name=f"lab-relay-{listen[1]}", daemon=True).start()
        host, port = sock.getsockname()[:2]
        return str(host), int(port)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            # shutdown() wakes a thread blocked in accept() or recv(); close() alone does not on Linux.
            for sock in [listener.sock, *list(listener.connections)]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _accept(self, listener: _Listener) -> None:
        while True:
            try:
                client, _ = listener.sock.accept()
            except OSError:
                return  # closed
            try:
                upstream = _socket_in(listener.target_netns, _family(listener.target[0]))
            except OSError as exc:
                log.warning("relay to %s: no socket: %s", listener.target, exc)
                client.close()
                continue
            threading.Thread(target=self._join, args=(listener, client, upstream), daemon=True,
                             name="lab-relay-conn").start()

    def _join(self, listener: _Listener, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            if self._closed:
                client.close()
                upstream.close()
                return
            listener.connections.update((client, upstream))
        try:
            upstream.settimeout(10.0)
            upstream.connect(listener.target)
            upstream.settimeout(None)
        except OSError as exc:
            log.debug("relay to %s: %s", listener.target, exc)
            self._forget(listener, client, upstream)
            return
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True, name="lab-relay-pump")
        back.start()
        _pump(client, upstream)
        back.join()
        self._forget(listener, client, upstream)

    def _forget(self, listener: _Listener, *socks: socket.socket) -> None:
        with self._lock:
            listener.connections.difference_update(socks)
        for sock in socks:
            sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy until ``source`` ends, then end ``sink``'s sending side (a half-close, passed on)."""
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)

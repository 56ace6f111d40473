#!/usr/bin/env python3
"""A Shmipc peer that ends every stream the way both reference
implementations do: the stream's data goes as FallbackData frames on the
socket, and once those writes have completed, the close goes on the IO queue
as an element. Used by ordering_test.go; built on the conformance kit's
shmpeer.py (its directory is in $SHMIPC_KIT).

  fallback_close_peer.py server SOCK
      Serve one session. Each stream carries an 8-byte request (u64
      big-endian n); the reply is n bytes of pattern(id) as FallbackData,
      then a close element.
  fallback_close_peer.py client SOCK MODE COUNT SIZE
      Open COUNT streams one after another; send SIZE + 37·k bytes of
      pattern(id) on the k-th as FallbackData, then a close element. Then
      wait until stdin closes.

pattern(id) is the byte sequence (i + 13·id) mod 251, i = 0, 1, ...
"""

import os
import socket
import struct
import sys

sys.path.insert(0, os.environ["SHMIPC_KIT"])
import shmpeer as sp  # noqa: E402

CHUNK = 4 << 20  # bytes per FallbackData frame
BASE = bytes(range(251))


def pattern(stream_id: int, size: int) -> bytes:
    start = (13 * stream_id) % 251
    reps = (start + size) // 251 + 1
    return (BASE * reps)[start : start + size]


def send_then_close(session: sp.Session, stream_id: int, data: bytes) -> None:
    for i in range(0, len(data), CHUNK):
        session.send(stream_id, data[i : i + CHUNK], fallback=True)  # sendall: written
    session.close_stream(stream_id)  # a close element on the queue


def serve(path: str) -> None:
    listener = sp.listen_socket("unix:" + path)
    print("ready", flush=True)
    conn, _ = listener.accept()
    session = sp.server_handshake(conn)
    replied = set()
    while True:
        try:
            session.receive(5.0)
        except sp.PeerClosed:
            return
        for stream in list(session.streams.values()):
            if stream.id in replied or len(stream.inbox) < 8:
                continue
            (n,) = struct.unpack(">Q", stream.take(8))
            replied.add(stream.id)
            send_then_close(session, stream.id, pattern(stream.id, n))


def client(path: str, mode: str, count: int, size: int) -> None:
    tag = f"{os.getpid()}_{os.urandom(4).hex()}"
    buffer = sp.ClientBuffer(mode, f"/dev/shm/shmipc_order_{tag}_buffer")
    sock = sp.connect_socket("unix:" + path, 5)
    session = sp.client_handshake(sock, mode, buffer, f"/dev/shm/shmipc_order_{tag}_queue_0")
    for k in range(count):
        stream = session.open_stream()
        send_then_close(session, stream.id, pattern(stream.id, size + 37 * k))
    print("sent", flush=True)
    sys.stdin.read()
    session.close()
    buffer.close()


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve(sys.argv[2])
    else:
        client(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))

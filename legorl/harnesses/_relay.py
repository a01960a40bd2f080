"""Inside a trial container: forward each TCP connection to 127.0.0.1:PORT to the unix socket SOCK.

Usage: ``python3 -I _relay.py PORT SOCK``. The container has no network (``--network none``); SOCK
is its proxy session's own socket, bind-mounted in, so the harness's base URL
``http://127.0.0.1:PORT/sess/<id>/v1`` reaches that session and nothing else. Bytes are copied
both ways as they come (streamed responses stay streamed).

This file must not import legorl, and runs on whatever python3 the task image has (3.6+).
"""

import contextlib
import socket
import sys
import threading


def pipe(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def serve(conn, path):
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        upstream.close()
        conn.close()
        return
    back = threading.Thread(target=pipe, args=(upstream, conn), daemon=True)
    back.start()
    pipe(conn, upstream)
    back.join()
    upstream.close()
    conn.close()


def main(port, path):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(128)
    while True:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn, path), daemon=True).start()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])

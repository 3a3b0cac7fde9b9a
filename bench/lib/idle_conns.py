#!/usr/bin/env python3
"""Hold N idle keep-alive connections open to an HTTP server on 127.0.0.1.

Usage: idle_conns.py PORT N [PATH]

Opens N connections, sends one keep-alive GET on each, reads every full response, prints
"READY answered=A of N", then holds the connections idle until SIGUSR1 or SIGTERM (at most
5 minutes). It then
prints "STILL_OPEN K" (connections the server had not closed) and exits. Used by
bench/run.sh to measure the proxy's memory with N idle clients.
"""
import signal
import socket
import sys

port, count = int(sys.argv[1]), int(sys.argv[2])
path = sys.argv[3] if len(sys.argv) > 3 else "/"
request = (
    f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    "User-Agent: levee-bench-idle\r\nConnection: keep-alive\r\n\r\n"
).encode()

# Block the signals now so one sent early is kept until sigwait() below.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT})


def read_response(sock):
    """Read one response (Content-Length or chunked body); True if it was a 200."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return False
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    headers = head.lower()
    if b"transfer-encoding: chunked" in headers:
        while not body.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                return False
            body += chunk
    else:
        length = 0
        for line in headers.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                return False
            body += chunk
    return head.startswith(b"HTTP/1.1 200")


sockets = []
for _ in range(count):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(request)
    sockets.append(s)
answered = sum(1 for s in sockets if read_response(s))
print(f"READY answered={answered} of {count}", flush=True)

# Hold; give up after 5 minutes so a lost client never outlives the benchmark for long.
signal.sigtimedwait({signal.SIGUSR1, signal.SIGTERM, signal.SIGINT}, 300)

still_open = 0
for s in sockets:
    s.setblocking(False)
    try:
        still_open += s.recv(1, socket.MSG_PEEK) != b""  # b"" means the server closed it
    except BlockingIOError:
        still_open += 1  # nothing to read: still open and idle
    except OSError:
        pass
print(f"STILL_OPEN {still_open}", flush=True)

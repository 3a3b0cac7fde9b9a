#!/usr/bin/env python3
"""A stand-in for the external AI API that the forum's /ai_reply.php calls through levee.

It answers `POST /v1/reply` with a canned JSON reply, and can be told to misbehave so you can
watch levee's `ai` breaker open and its fallback answer for the PHP code:

    ok    answer at once (the default)
    slow  answer after --slow-seconds (default 5 s: longer than levee's response_timeout)
    fail  answer 503 at once, like an overloaded API

Switch the mode with `POST /control` and the mode as the body, read it with `GET /control`:

    curl -d fail http://127.0.0.1:PORT/control

It listens on loopback only. Usage: ai_standin.py [--port 8090] [--mode ok] [--slow-seconds 5]
"""

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("ok", "slow", "fail")


class State:
    """The current mode, shared by the request threads."""

    def __init__(self, mode, slow_seconds):
        self.lock = threading.Lock()
        self.mode = mode
        self.slow_seconds = slow_seconds
        self.calls = 0

    def get(self):
        with self.lock:
            return self.mode

    def set(self, mode):
        with self.lock:
            self.mode = mode

    def count(self):
        with self.lock:
            self.calls += 1
            return self.calls


class Handler(BaseHTTPRequestHandler):
    server_version = "ai-standin/1"
    protocol_version = "HTTP/1.1"

    def send_json(self, status, value):
        body = (json.dumps(value) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def read_body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def do_GET(self):
        if self.path == "/control":
            self.send_json(200, {"mode": self.server.state.get(), "calls": self.server.state.calls})
        else:
            self.send_json(404, {"error": "not found; try POST /v1/reply or GET /control"})

    def do_POST(self):
        body = self.read_body()
        state = self.server.state
        if self.path == "/control":
            mode = body.decode(errors="replace").strip()
            if mode not in MODES:
                self.send_json(400, {"error": "send one of: " + ", ".join(MODES)})
                return
            state.set(mode)
            print(f"ai-standin: mode is now {mode}", file=sys.stderr, flush=True)
            self.send_json(200, {"mode": mode})
            return
        if self.path != "/v1/reply":
            self.send_json(404, {"error": "not found; try POST /v1/reply"})
            return
        call = state.count()
        mode = state.get()
        if mode == "fail":
            self.send_json(503, {"error": "overloaded", "call": call})
            return
        if mode == "slow":
            time.sleep(state.slow_seconds)
        try:
            question = json.loads(body or b"{}").get("question", "")
        except ValueError:
            question = ""
        reply = f"(stand-in AI) You asked {len(question)} characters' worth; here is a thoughtful reply."
        self.send_json(200, {"reply": reply, "call": call, "mode": mode})

    def log_message(self, format, *args):
        print("ai-standin: " + (format % args), file=sys.stderr, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--mode", choices=MODES, default="ok")
    parser.add_argument("--slow-seconds", type=float, default=5.0)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.state = State(args.mode, args.slow_seconds)
    print(f"ai-standin: listening on 127.0.0.1:{args.port}, mode {args.mode}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

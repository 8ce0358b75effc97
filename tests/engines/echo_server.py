"""A real OpenAI-compatible streaming server for the engine-registry tests: /health, /v1/models and
streamed /v1/completions that send `max_tokens` one-word chunks, one every --gap-ms. No model: what
the tests check is the engine seam (start, health, first completion, measure, stop), not text.
`--slots K`: at most K completions stream at once, the others wait for a slot (as a serving engine's
parallel slots queue requests), so the server has a capacity of K / (max_tokens x gap) requests/s.

    python tests/engines/echo_server.py serve --port 8123 --model DIR [--gap-ms 2] [--slots 2]
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("verb", choices=["serve"])  # a word the fast tier's no-server guard knows
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--slots", type=int, default=0, help="completions streamed at once (0: no limit)")
    args = parser.parse_args()
    slots = threading.BoundedSemaphore(args.slots) if args.slots else None

    class Handler(BaseHTTPRequestHandler):
        def _json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"data": [{"id": args.model}]})
            else:
                self._json(404, {"error": self.path})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions" or body.get("model") != args.model:
                self._json(404, {"error": f"{self.path} {body.get('model')}"})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            n = int(body["max_tokens"])
            if slots:
                slots.acquire()
            try:
                for i in range(n):
                    time.sleep(args.gap_ms / 1000)
                    chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": "length" if i == n - 1 else None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
            finally:
                if slots:
                    slots.release()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, fmt, *rest):
            print(f"{self.command} {self.path}", flush=True)

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # listen backlog (socketserver's default is 5): a level sends dozens at once

    print(f"serving {args.model} on {args.host}:{args.port}", flush=True)
    Server((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()

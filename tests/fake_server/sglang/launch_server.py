"""A stand-in for ``python3 -m sglang.launch_server`` in the tests of the benchmarks' server helpers: an
HTTP server on ``--port`` whose ``/health`` answers after ``FAKE_UP_AFTER_S`` seconds and whose
``/generate`` returns ``max_new_tokens`` ids (the prompt's last id plus one, counting up); with
``FAKE_EXIT=1`` it exits at once instead."""

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if os.environ.get("FAKE_EXIT") == "1":
    print("fake server: exiting at start")
    sys.exit(3)
port = int(sys.argv[sys.argv.index("--port") + 1])
up_at = time.monotonic() + float(os.environ.get("FAKE_UP_AFTER_S", "0"))


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer(200 if time.monotonic() >= up_at else 503, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last, count = body["input_ids"][-1], body["sampling_params"]["max_new_tokens"]
        self._answer(200, {"output_ids": [last + 1 + k for k in range(count)]})


print(f"sglang-lora-tma-guard: the fake server's one guard line (args: {' '.join(sys.argv[1:])})", flush=True)
if time.monotonic() < up_at:
    time.sleep(up_at - time.monotonic())


class Server(ThreadingHTTPServer):
    request_queue_size = 256  # the waves connect 64 at once (the default backlog is 5)


Server(("127.0.0.1", port), Handler).serve_forever()

"""A stand-in for ``python3 -m sglang.launch_server`` in the tests of the benchmarks' server helpers: an
HTTP server on ``--port`` whose ``/health`` answers after ``FAKE_UP_AFTER_S`` seconds and whose
``/generate`` returns ``max_new_tokens`` ids (the prompt's last id plus one, counting up) and, asked for the
input's log-probabilities, made-up ones laid out as SGLang lays them out; with
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
        ids, count = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        answer = {"output_ids": [ids[-1] + 1 + k for k in range(count)]}
        if body.get("return_logprob") and body.get("logprob_start_len") == 0:
            # As SGLang lays them out: entry i >= 1 of the input's is the distribution that predicts token i, the
            # last position's is the first output token's. Here position j's best tokens are ids[j] + 1, + 2, ...
            def top(j):
                return [[-0.5 * k, ids[j] + 1 + k, None] for k in range(body.get("top_logprobs_num", 0))]
            answer["meta_info"] = {"input_top_logprobs": [None] + [top(j) for j in range(len(ids) - 1)],
                                   "output_top_logprobs": [top(len(ids) - 1)]}
        self._answer(200, answer)


print(f"sglang-lora-tma-guard: the fake server's one guard line (args: {' '.join(sys.argv[1:])})", flush=True)
if time.monotonic() < up_at:
    time.sleep(up_at - time.monotonic())


class Server(ThreadingHTTPServer):
    request_queue_size = 256  # the waves connect 64 at once (the default backlog is 5)


Server(("127.0.0.1", port), Handler).serve_forever()

"""End-to-end: the request log (issue 11: there was none) and client
hang-ups (issue 11: a hang-up was logged as "Application reported internal
error", libmicrohttpd's words, before the project had its own HTTP server;
since then it was not logged at all).

With --log-requests a node writes one JSON line per request to stderr as the
request ends — finished, aborted, failed, or refused by the engine — with the
fields of docs/http-api.md ("The request log"). Without it, a node and the
router still log every client that hung up, as a hang-up, with the rid."""
import json
import re
import socket
import threading
import time

import pdtest
from pdtest import Server
from test_run import Run

FIELDS = ("rid", "role", "outcome", "finish_reason", "status", "prompt_tokens",
          "completion_tokens", "cached_tokens", "queue_ms", "ttft_ms", "e2e_ms")


def log_lines(server):
    """The JSON lines of a server's stderr (its output file also holds stdout)."""
    out = []
    with open(server.log_path) as f:
        for line in f:
            if line.startswith("{"):
                out.append(json.loads(line))
    return out


def line_of(server, rid, role, timeout=10):
    """The one log line of rid on the node of that role, once it is written."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [o for o in log_lines(server) if o.get("rid") == rid and o["role"] == role]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.05)
    raise AssertionError("no %s log line for %s:\n%s" % (role, rid, server.output()))


def check_timings(o):
    for k in FIELDS:
        assert k in o, (k, o)
    assert o["e2e_ms"] >= 0 and o["queue_ms"] >= 0 and o["queue_ms"] <= o["e2e_ms"], o


def stream_then_hang_up(port, body):
    """Starts a streamed /generate, reads its first event, and hangs up."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    s.close()


def test_every_request_gets_a_line_with_log_requests():
    # A small KV pool (a prompt that cannot fit is refused by the engine, 413)
    # and a short transfer timeout (a decode half whose prefill half never
    # comes fails, 504).
    run = Run(["--log-requests", "--max-total-tokens", "2048", "--transfer-timeout-ms", "500"])
    try:
        # Finished: a line on each half, the hand-off on both.
        st, res = run.router.post("/generate", {"rid": "log-done", "text": "Hello there, friend",
                                                "sampling_params": {"max_new_tokens": 5,
                                                                    "ignore_eos": True}})
        assert st == 200, res
        meta = res["meta_info"]
        d = line_of(run.router, "log-done", "decode")
        p = line_of(run.router, "log-done", "prefill")
        for o in (d, p):
            check_timings(o)
            assert o["outcome"] == "finished" and o["status"] == 200 and "message" not in o, o
            assert o["prompt_tokens"] == meta["prompt_tokens"] and o["transfer_bytes"] > 0, o
        assert d["finish_reason"] == "length" and d["completion_tokens"] == 5, d
        assert 0 < d["ttft_ms"] <= d["e2e_ms"] and d["transfer_ms"] > 0, d
        assert p["finish_reason"] == "transferred" and p["completion_tokens"] == 0, p
        assert p["ttft_ms"] is None and p["prefill_ms"] > 0 and p["transfer_ms"] >= 0, p
        assert d["transfer_bytes"] == p["transfer_bytes"], (d, p)
        assert "client_hung_up" not in d and "client_hung_up" not in p

        # Aborted by /abort_request while it streams.
        body = {"rid": "log-abort", "text": "Hello", "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
        streamed = {}
        t = threading.Thread(target=lambda: streamed.update(r=run.router.stream("/generate", body)))
        t.start()
        deadline = time.time() + 30
        while run.d.info()["counters"]["running"] == 0 and time.time() < deadline:
            time.sleep(0.01)  # decoding: past its queue and its hand-off
        st, res = run.router.post("/abort_request", {"rid": "log-abort"})
        assert st == 200, (st, res)
        t.join(60)
        assert streamed["r"][0] == 200, streamed
        d = line_of(run.router, "log-abort", "decode")
        check_timings(d)
        assert d["outcome"] == "aborted" and d["status"] == 499 and d["finish_reason"] is None, d
        assert d["message"] == "aborted by request" and "client_hung_up" not in d, d

        # Refused by the engine: prompt + max_new_tokens cannot fit the KV pool.
        st, res = run.router.post("/generate", {"rid": "log-big", "text": "Hello",
                                                "sampling_params": {"max_new_tokens": 3000}})
        assert st == 413, (st, res)
        d = line_of(run.router, "log-big", "decode")
        assert d["outcome"] == "rejected" and d["status"] == 413 and d["message"], d
        assert d["ttft_ms"] is None and d["completion_tokens"] == 0, d

        # Failed: a decode half whose prefill half never comes.
        st, res = run.d.post("/generate", {"rid": "log-fail", "text": "Hello", "bootstrap_room": 4242,
                                           "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
                                           "sampling_params": {"max_new_tokens": 3}})
        assert st == 504, (st, res)
        d = line_of(run.router, "log-fail", "decode")
        check_timings(d)
        assert d["outcome"] == "failed" and d["status"] == 504 and "timed out" in d["message"], d
        assert d["ttft_ms"] is None and d["transfer_ms"] is None, d
        run.nodes_idle_clean()
    finally:
        run.stop()


def test_a_hang_up_is_logged_as_one_without_log_requests():
    srv = Server(["serve", "--strict"], name="serve-hangup")
    try:
        st, _ = srv.post("/generate", {"rid": "quiet", "text": "Hello",
                                       "sampling_params": {"max_new_tokens": 3}})
        assert st == 200
        for rid, stream in (("gone-streaming", True), ("gone-waiting", False)):
            body = {"rid": rid, "text": "Hello there", "stream": stream,
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
            if stream:
                stream_then_hang_up(srv.port, body)
            else:
                try:
                    srv.post("/generate", body, timeout=0.3)
                    raise AssertionError("answered before the hang-up")
                except socket.timeout:
                    pass
            o = line_of(srv, rid, "serve")
            check_timings(o)
            assert o["outcome"] == "aborted" and o["status"] == 499 and o["client_hung_up"], o
            assert o["message"] == "the client hung up" and o["completion_tokens"] > 0, o
        srv.wait_idle_clean()
        # Only hang-ups without --log-requests, and no "internal error".
        assert [o["rid"] for o in log_lines(srv)] == ["gone-streaming", "gone-waiting"]
        assert not re.search("internal error", srv.output(), re.I), srv.output()
    finally:
        srv.stop()


def test_the_router_logs_its_clients_hang_ups():
    run = Run()
    try:
        stream_then_hang_up(run.router.port, {"rid": "gone-at-router", "text": "Hello there",
                                              "stream": True,
                                              "sampling_params": {"max_new_tokens": 4000,
                                                                  "ignore_eos": True}})
        o = line_of(run.router, "gone-at-router", "router")
        assert o["outcome"] == "aborted" and o["client_hung_up"] is True, o
        assert o["message"] == "the client hung up" and o["e2e_ms"] >= 0, o
        run.nodes_idle_clean()
        assert not re.search("internal error", run.router.output(), re.I), run.router.output()
    finally:
        run.stop()


if __name__ == "__main__":
    pdtest.run_tests([test_every_request_gets_a_line_with_log_requests,
                      test_a_hang_up_is_logged_as_one_without_log_requests,
                      test_the_router_logs_its_clients_hang_ups])

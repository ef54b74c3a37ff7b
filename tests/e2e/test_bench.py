"""End-to-end: `pdserve bench` against real servers.

- 200 requests through `pdserve run`, 30 % aborted (by /abort_request and by
  hanging up): the results JSON has every field, the outcome counts add up
  to the request count, percentiles are ordered, the idle check of both
  nodes passed, and report.html parses as XML with its charts;
- the idle check fails loudly (exit 3, the pool named) against a node that
  holds a request and against a fake node that reports a leak;
- the same seed gives a byte-identical request sequence, for every dataset;
- the OpenAI APIs; bad input gets clear errors.
"""
import http.server
import json
import os
import subprocess
import tempfile
import threading
import xml.etree.ElementTree as ET

import pdtest
from pdtest import Server
from test_run import Run

STATS = ("mean", "median", "p90", "p99", "max")
METRICS = ("ttft", "tpot", "itl", "e2e_latency")
FIELDS = ("backend", "dataset_name", "request_rate", "burstiness", "max_concurrency", "seed",
          "duration", "num_prompts", "completed", "aborted", "failed", "refused",
          "total_input_tokens", "total_output_tokens", "cache_hit_tokens", "request_throughput",
          "input_throughput", "output_throughput", "total_throughput", "goodput", "good_requests",
          "slo", "concurrency", "input_lens", "output_lens", "ttfts", "itls", "errors", "pdserve")


def bench(*args, timeout=300):
    return subprocess.run([pdtest.PDSERVE, "bench", "--no-progress"] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=timeout)


def last_json_line(path):
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    return json.loads(lines[-1])


def check_results(res, n):
    for k in FIELDS:
        assert k in res, "missing field %s" % k
    for m in METRICS:
        for s in STATS + ("std",):
            assert "%s_%s_ms" % (s, m) in res, "missing %s_%s_ms" % (s, m)
    counts = res["completed"] + res["aborted"] + res["failed"] + res["refused"]
    assert counts == res["num_prompts"] == n, (counts, res["num_prompts"], n)
    for m in ("ttft", "tpot", "itl", "e2e_latency"):
        v = [res["%s_%s_ms" % (s, m)] for s in ("median", "p90", "p99", "max")]
        assert None not in v, (m, v)
        assert v == sorted(v), (m, v)
        assert res["mean_%s_ms" % m] <= res["max_%s_ms" % m]
    assert len(res["input_lens"]) == len(res["output_lens"]) == len(res["errors"]) == n
    assert len(res["pdserve"]["requests"]) == n
    outcomes = [r["outcome"] for r in res["pdserve"]["requests"]]
    assert outcomes.count("aborted") == res["aborted"]
    assert outcomes.count("completed") == res["completed"]
    for r in res["pdserve"]["requests"]:
        assert r["start_s"] <= r["end_s"], r
        if r["outcome"] == "completed":
            assert r["ttft_s"] is not None and r["ttft_s"] <= r["end_s"] - r["start_s"] + 1e-9, r


def check_report(path, nodes):
    tree = ET.parse(path)  # well-formed XML, or this raises
    ids = {e.get("id") for e in tree.iter() if e.get("id")}
    text = open(path).read()
    for want in ("cdf-ttft", "cdf-itl", "cdf-e2e", "timeline"):
        assert want in ids, (want, sorted(ids)[:40])
    pools = [i for i in ids if i.startswith("pools-")]
    assert len(pools) >= nodes, pools
    assert "<svg" in text and "<script" not in text


def test_bench_run_with_aborts():
    run = Run(["--max-running-requests", "32"])
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-")
    out, rep = os.path.join(tmp, "results.json"), os.path.join(tmp, "report")
    try:
        r = bench("--base-url", "http://127.0.0.1:%d" % run.router.port, "--num-prompts", 200,
                  "--random-input-len", 48, "--random-output-len", 24, "--max-concurrency", 24,
                  "--abort-fraction", 0.3, "--abort-after-ms", "0:150", "--seed", 3,
                  "--slo", "ttft=5s,tpot=1s", "--check-node", "http://127.0.0.1:%d" % run.p.port,
                  "--check-node", "http://127.0.0.1:%d" % run.d.port, "--output-file", out,
                  "--report", rep)
        assert r.returncode == 0, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
        assert "Serving Benchmark Result" in r.stdout and "IDLE CHECK FAILED" not in r.stdout
        # under each node's idle check line, its pools' ledger counts: nothing held
        for port in (run.p.port, run.d.port):
            after = r.stdout.split("Idle check: http://127.0.0.1:%d" % port)[1].splitlines()[1:]
            names = []
            for x in after:
                if not x.startswith("  "):
                    break
                names.append(x.split()[0])
                assert " 0 held by requests" in x and " 0 quarantined" in x, x
            assert "kv" in names and "mamba" in names, after[:6]
        res = last_json_line(out)
        check_results(res, 200)
        assert res["aborted"] >= 20, res["aborted"]
        assert res["completed"] >= 100, res["completed"]
        assert res["failed"] == 0 and res["refused"] == 0, res["errors"]
        assert res["goodput"] is not None and res["good_requests"] <= res["completed"]
        pd = res["pdserve"]
        assert pd["idle_check_passed"] is True
        assert len(pd["nodes"]) == 2 and all(n["idle_check"]["passed"] for n in pd["nodes"])
        assert all(len(n["samples"]) >= 2 for n in pd["nodes"])
        for n in pd["nodes"]:  # the last look's counts
            pools = n["idle_check"]["pools"]
            assert pools and all(p["req"] == 0 and p["quarantine"] == 0 for p in pools), pools
            assert all(p["free"] + p["cache_evictable"] + p["cache_protected"] == p["total"]
                       for p in pools), pools
        kinds = {a["kind"] for a in pd["aborts"]}
        assert kinds == {"request", "close"}, kinds
        assert sum(pd["timeline"]["requests_done_per_s"]) > 0
        check_report(os.path.join(rep, "report.html"), 2)
        run.nodes_idle_clean()
    finally:
        run.stop()


class FakeNode(http.server.BaseHTTPRequestHandler):
    """A node that always reports one KV page held by a request, idle."""

    def do_GET(self):
        info = {"role": "decode", "idle": True, "idle_clean": False,
                "pools": {"strict": False, "holders": [], "pools": [
                    {"name": "kv", "kind": "kv", "total": 64, "free": 57, "req": 7,
                     "cache_evictable": 0, "cache_protected": 0, "quarantine": 0},
                    {"name": "mamba", "kind": "mamba", "total": 8, "free": 8, "req": 0,
                     "cache_evictable": 0, "cache_protected": 0, "quarantine": 0}]}}
        body = json.dumps(info).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_bench_idle_check_fails_on_a_leak():
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeNode)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    serve = Server(["serve", "--strict"])
    try:
        r = bench("--base-url", "http://127.0.0.1:%d" % serve.port, "--num-prompts", 5,
                  "--random-input-len", 16, "--random-output-len", 4,
                  "--check-node", "http://127.0.0.1:%d" % fake.server_address[1],
                  "--check-node", "http://127.0.0.1:%d" % serve.port, "--idle-timeout-s", 1)
        assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        assert "IDLE CHECK FAILED" in r.stdout and "pool kv: 7 units held by requests" in r.stdout, \
            r.stdout[-2000:]
        assert "pool mamba" not in r.stdout.split("IDLE CHECK FAILED")[1].splitlines()[0]
        assert "  kv             64 units: 57 free, 7 held by requests, 0 cached (0 evictable, " \
            "0 protected), 0 quarantined" in r.stdout, r.stdout[-2000:]
        assert "Idle check: http://127.0.0.1:%d" % serve.port in r.stdout, r.stdout[-2000:]
    finally:
        fake.shutdown()
        serve.stop()


def test_bench_idle_check_fails_on_a_held_request():
    serve = Server(["serve", "--strict"])
    held = serve.conn(timeout=60)
    try:
        held.request("POST", "/generate", body=json.dumps(
            {"text": "hold me", "stream": True, "sampling_params": {"max_new_tokens": 4000,
                                                                  "ignore_eos": True}}),
            headers={"Content-Type": "application/json"})
        resp = held.getresponse()
        assert resp.status == 200
        resp.read1(64)  # the stream is running: the request holds KV pages
        r = bench("--base-url", "http://127.0.0.1:%d" % serve.port, "--num-prompts", 3,
                  "--random-input-len", 16, "--random-output-len", 2,
                  "--check-node", "http://127.0.0.1:%d" % serve.port, "--idle-timeout-s", 1)
        assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        line = [x for x in r.stdout.splitlines() if "IDLE CHECK FAILED" in x]
        assert line and "still busy" in line[0] and "pool kv:" in line[0], r.stdout[-2000:]
    finally:
        held.close()
        serve.wait_idle_clean()
        serve.stop()


def dump(tmp, name, *args):
    path = os.path.join(tmp, name)
    r = bench("--dry-run", "--dump-dataset", path, *args)
    assert r.returncode == 0, (r.returncode, r.stderr)
    with open(path, "rb") as f:
        return f.read()


def test_bench_same_seed_same_requests():
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-ds-")
    trace = os.path.join(tmp, "trace.jsonl")
    with open(trace, "w") as f:
        for i in range(30):
            f.write(json.dumps({"timestamp": 100 * i, "input_length": 40 + i,
                                "output_length": 5 + i % 3, "hash_ids": [1, 2, 100 + i]}) + "\n")
    share = os.path.join(tmp, "sharegpt.json")
    with open(share, "w") as f:
        json.dump([{"id": str(i), "conversations": [
            {"from": "human", "value": "question %d about foxes" % i},
            {"from": "gpt", "value": "answer " * (i + 1)}]} for i in range(12)], f)
    sets = [["--dataset-name", "random", "--request-rate", 20, "--abort-fraction", 0.3],
            ["--dataset-name", "shared-prefix", "--gsp-num-groups", 3, "--burstiness", 0.5,
             "--request-rate", 5],
            ["--dataset-name", "multi-turn", "--multi-turn-turns", 3, "--prompt-kind", "text"],
            ["--dataset-name", "sharegpt", "--dataset-path", share],
            ["--dataset-name", "trace", "--dataset-path", trace, "--trace-block-tokens", 16]]
    for k, s in enumerate(sets):
        common = ["--num-prompts", 25, "--vocab-size", 258] + s
        a = dump(tmp, "a%d" % k, "--seed", 7, *common)
        b = dump(tmp, "b%d" % k, "--seed", 7, *common)
        c = dump(tmp, "c%d" % k, "--seed", 8, *common)
        assert a == b, s
        assert a != c, s
        lines = [json.loads(x) for x in a.decode().splitlines()]
        assert len(lines) == 25 and [x["index"] for x in lines] == list(range(25)), s
    # traces share prefixes by hash id: lines 0 and 1 start with the same 32 tokens
    lines = [json.loads(x) for x in dump(tmp, "t", "--dataset-name", "trace", "--dataset-path",
                                         trace, "--trace-block-tokens", 16, "--vocab-size", 258,
                                         "--num-prompts", 5).decode().splitlines()]
    ids0, ids1 = lines[0]["segments"][0]["ids"], lines[1]["segments"][0]["ids"]
    assert ids0[:32] == ids1[:32] and ids0[32:40] != ids1[32:40]
    arrivals = [x["arrival_s"] for x in lines]
    assert arrivals == [0.0, 0.1, 0.2, 0.3, 0.4], arrivals
    # multi-turn: each turn extends the last
    mt = [json.loads(x) for x in dump(tmp, "m", "--dataset-name", "multi-turn",
                                      "--multi-turn-turns", 3, "--vocab-size", 258,
                                      "--num-prompts", 3).decode().splitlines()]
    flat = [sum((s["ids"] for s in x["segments"]), []) for x in mt]
    assert flat[1][:len(flat[0])] == flat[0] and flat[2][:len(flat[1])] == flat[1]
    assert mt[1]["prev"] == 0 and mt[2]["prev"] == 1


def test_bench_openai_apis():
    serve = Server(["serve", "--strict"])
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-oai-")
    try:
        for backend in ("openai", "openai-chat"):
            out = os.path.join(tmp, backend + ".json")
            r = bench("--base-url", "http://127.0.0.1:%d" % serve.port, "--backend", backend,
                      "--num-prompts", 12, "--random-input-len", 24, "--random-output-len", 6,
                      "--max-concurrency", 4, "--output-file", out,
                      "--check-node", "http://127.0.0.1:%d" % serve.port)
            assert r.returncode == 0, (backend, r.stdout[-2000:], r.stderr[-2000:])
            res = last_json_line(out)
            assert res["completed"] == 12, (backend, res["errors"])
            assert res["total_output_tokens"] == sum(res["output_lens"]) > 0
            assert res["median_ttft_ms"] is not None
    finally:
        serve.stop()


def test_bench_bad_input():
    port = pdtest.free_port()
    r = bench("--base-url", "http://127.0.0.1:%d" % port, "--num-prompts", 2)
    assert r.returncode == 1 and "cannot reach http://127.0.0.1:%d" % port in r.stderr, r.stderr
    for args, want in ((["--num-prompts", "0"], "--num-prompts: bad value '0'"),
                       (["--abort-fraction", "1.5"], "--abort-fraction: bad value"),
                       (["--slo", "ttft=fast"], "ttft=fast"),
                       (["--dataset-name", "nope"], "--dataset-name: bad value 'nope'"),
                       (["--dataset-name", "trace"], "--dataset-path"),
                       (["--request-rate"], "--request-rate needs a value"),
                       (["--frobnicate"], "--frobnicate")):
        r = bench("--dry-run", *args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert want in r.stderr, (args, r.stderr)
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-bad-")
    bad = os.path.join(tmp, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"timestamp": 0, "input_length": 4, "output_length": 2}\n{"timestamp": 1,\n')
    r = bench("--dry-run", "--dataset-name", "trace", "--dataset-path", bad)
    assert r.returncode == 1 and bad + ":2:" in r.stderr, r.stderr
    serve = Server(["serve", "--strict"])
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), EmptyInfo)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    try:
        r = bench("--base-url", "http://127.0.0.1:%d" % serve.port, "--num-prompts", 2,
                  "--check-node", "http://127.0.0.1:%d" % fake.server_address[1])
        assert r.returncode == 1 and "not a pdserve node" in r.stderr, r.stderr
    finally:
        fake.shutdown()
        serve.stop()


class EndlessServer(http.server.BaseHTTPRequestHandler):
    """/health answers; /generate streams 70 MiB that never end an event."""
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(70 << 20))
        self.end_headers()
        chunk = b"x" * (1 << 20)
        try:
            for _ in range(70):
                self.wfile.write(chunk)
        except OSError:
            pass

    def log_message(self, *a):
        pass


def test_bench_bounds_an_endless_answer():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), EndlessServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-big-")
    out = os.path.join(tmp, "r.json")
    try:
        r = bench("--base-url", "http://127.0.0.1:%d" % srv.server_address[1], "--num-prompts", 1,
                  "--vocab-size", 258, "--output-file", out)
        assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        res = last_json_line(out)
        assert res["failed"] == 1 and "passed 64 MiB" in res["errors"][0], res["errors"]
    finally:
        srv.shutdown()


class EmptyInfo(FakeNode):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


if __name__ == "__main__":
    pdtest.run_tests([test_bench_same_seed_same_requests, test_bench_bad_input,
                      test_bench_run_with_aborts, test_bench_idle_check_fails_on_a_leak,
                      test_bench_idle_check_fails_on_a_held_request, test_bench_openai_apis,
                      test_bench_bounds_an_endless_answer])

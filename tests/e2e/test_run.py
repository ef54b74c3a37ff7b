"""End-to-end: `pdserve run` — router, prefill node and decode node in one
process over the loopback transport — answers exactly what `pdserve
generate` computes, survives an abort storm (every client gets exactly one
final response, every node ends idle with every pool back), and refuses bad
input at the router with clear errors."""
import json
import random
import socket
import threading
import time

import pdtest
from pdtest import Server


class Run:
    """A `pdserve run`: the router's port is Server.port; the nodes' ports
    are read from its banner."""

    def __init__(self, extra=()):
        self.router = Server(["run", "--strict"] + list(extra), name="run", wait=False)
        deadline = time.time() + 60
        self.p = self.d = None
        while time.time() < deadline and not (self.p and self.d):
            self.router.clashed()  # its port taken meanwhile: started again on another
            for line in self.router.output().splitlines():
                if "decode node http://" in line:
                    part = line.split("prefill node http://")[1]
                    pport = int(part.split(",")[0].split(":")[1])
                    dport = int(line.split("decode node http://")[1].split(" ")[0].split(":")[1])
                    self.p = Alias(self.router, pport, "prefill")
                    self.d = Alias(self.router, dport, "decode")
            time.sleep(0.05)
        assert self.p, self.router.output()
        self.router.wait_healthy()

    def nodes_idle_clean(self):
        return self.p.wait_idle_clean(60), self.d.wait_idle_clean(60)

    def stop(self):
        self.router.stop()


class Alias(Server):
    def __init__(self, owner, port, name):
        self.port, self.name, self.proc, self.log_path, self.log = port, name, owner.proc, owner.log_path, owner.log


def test_run_matches_generate():
    for extra in (["--page-size", "16", "--chunked-prefill-size", "64"],
                  ["--page-size", "1", "--chunked-prefill-size", "5"]):
        run = Run(extra)
        try:
            for i, prompt in enumerate(pdtest.prompts(24)):
                max_new = 1 + (i % 6) * 3
                want = pdtest.generate_reference(prompt, max_new)
                body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new}}
                if i % 3 == 0:
                    st, events = run.router.stream("/generate", dict(body, stream=True))
                    assert st == 200 and events[-1] == "[DONE]", events[-2:]
                    ids = pdtest.stream_ids(events)
                else:
                    st, res = run.router.post("/generate", body)
                    assert st == 200, res
                    ids = res["output_ids"]
                assert ids == want, (extra, i, ids, want)
            st, res = run.router.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4})
            assert st == 200 and res["usage"]["completion_tokens"] == len(pdtest.generate_reference("Hello", 4))
            run.nodes_idle_clean()
        finally:
            run.stop()


def _final_events(events):
    return [e for e in events if isinstance(e, dict) and
            (e.get("meta_info", {}).get("finish_reason") is not None or "error" in e)]


def test_abort_storm():
    # The bootstrap deadline (30 s by default) is not what this test is about:
    # under ThreadSanitizer on a loaded 2-core machine a request queued behind
    # the decode node's 32 running ones once waited longer than that, and
    # its prefill rightly gave up on it.
    run = Run(["--max-running-requests", "32", "--bootstrap-timeout-ms", "120000"])
    rng = random.Random(2026)
    n = 200
    outcome = [None] * n
    errors = []

    def client(i):
        try:
            rid = "storm-%d" % i
            stream = i % 2 == 0
            body = {"text": "storm request %d " % i * (1 + i % 5), "rid": rid, "stream": stream,
                    "sampling_params": {"max_new_tokens": 20 + (i * 7) % 120, "ignore_eos": True}}
            kind = i % 4  # 0,1: normal; 2: aborted via /abort_request; 3: connection closed
            if kind == 3:
                s = socket.create_connection(("127.0.0.1", run.router.port))
                raw = json.dumps(body).encode()
                s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
                time.sleep(rng.uniform(0, 0.4))
                s.close()
                outcome[i] = "closed"
                return
            if kind == 2:
                def aborter():
                    time.sleep(rng.uniform(0, 0.4))
                    run.router.post("/abort_request", {"rid": rid})
                threading.Thread(target=aborter).start()
            if stream:
                st, events = run.router.stream("/generate", body)
                assert st == 200, (st, events)
                assert events[-1] == "[DONE]", events[-3:]
                finals = _final_events(events[:-1])
                assert len(finals) == 1 and finals[0] is events[-2], events[-3:]
                outcome[i] = finals[0].get("meta_info", {}).get("finish_reason", {}).get("type", "error")
            else:
                st, res = run.router.post("/generate", body)
                assert st == 200, (st, res)
                outcome[i] = res["meta_info"]["finish_reason"]["type"]
            if kind in (0, 1):
                assert outcome[i] == "length", (i, outcome[i])
        except Exception as e:  # collected, reported below
            errors.append("%d: %r" % (i, e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.002)
    for t in threads:
        t.join(300)
    try:
        assert not errors, errors[:5]
        assert all(o is not None for o in outcome)
        aborted = sum(1 for o in outcome if o == "abort")
        assert aborted > 10, outcome  # the aborts really interrupted requests
        p, d = run.nodes_idle_clean()
        for info in (p, d):
            for pool in info["pools"]["pools"]:
                assert pool["req"] == 0 and pool["quarantine"] == 0, pool
            assert info["counters"]["ownership_violations"] == 0
        assert d["counters"]["aborted"] >= aborted
    finally:
        run.stop()


def test_router_bad_input():
    run = Run()
    try:
        for raw, status in (("{oops", 400), ("[1]", 400), (json.dumps({"text": "x", "stream": "yes"}), 400)):
            st, obj = run.router.request("POST", "/generate", raw=raw)
            assert st == status and obj["error"]["code"] == status, (raw, st, obj)
        # A body over the limit: the router may answer 413 before reading it all
        # and close; read the answer whatever happens to the rest of the upload.
        big = json.dumps({"text": "y" * (2 << 20)}).encode()
        s = socket.create_connection(("127.0.0.1", run.router.port))
        s.settimeout(10)
        try:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(big) + big)
        except OSError:
            pass
        answer = b""
        try:
            while b"\r\n" not in answer:
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
        except OSError:
            pass
        s.close()
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        st, obj = run.router.get("/nope")
        assert st == 404
        pdtest.check_ambiguous_requests_refused(run.router.port)
        # A percent-encoded NUL once cut the path: this was served as /generate
        # (issue 10, finding 9). Now the HTTP server refuses it.
        st, obj = run.router.post("/generate%00anything", {"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert st == 400 and obj["error"]["code"] == 400 and "%00" in obj["error"]["message"], (st, obj)
        st, obj = run.router.get("/generate")
        assert st == 405
        st, obj = run.router.post("/abort_request", {"rid": "nobody"})
        assert st == 404, (st, obj)
        st, obj = run.router.post("/generate", {"text": "", "sampling_params": {"max_new_tokens": 2}})
        assert st == 400 and "empty" in obj["error"]["message"], obj
        st, obj = run.router.post("/generate", {"text": "ok", "sampling_params": {"max_new_tokens": 2}})
        assert st == 200 and len(obj["output_ids"]) == 2
        run.nodes_idle_clean()
    finally:
        run.stop()


def test_models_are_listed():
    """OpenAI's /v1/models and /v1/models/{id} (issue 11: both were 404, so
    tools that list models first broke): the nodes answer for the model they
    serve, the router relays a decode node's answer; an unknown id is a 404
    in the error shape."""
    run = Run()
    try:
        for server in (run.router, run.p, run.d):
            st, obj = server.get("/v1/models")
            assert st == 200 and obj["object"] == "list", (server.name, st, obj)
            ids = [m["id"] for m in obj["data"]]
            assert ids == ["pdserve-tiny"] and obj["data"][0]["object"] == "model", obj
            st, obj = server.get("/v1/models/pdserve-tiny")
            assert st == 200 and obj["id"] == "pdserve-tiny", (server.name, st, obj)
            for missing in ("/v1/models/gpt-4", "/v1/models/a%3Fb"):
                st, obj = server.get(missing)
                assert st == 404 and obj["error"]["code"] == 404, (server.name, missing, st, obj)
        st, obj = run.router.request("POST", "/v1/models", body={})
        assert st == 405, (st, obj)
    finally:
        run.stop()


def test_chat_completions():
    """OpenAI's /v1/chat/completions (issue 11: a 404, so most clients and
    every chat UI failed on their first call), through the router and on a
    node: the tiny model's template renders the messages; plain and streamed
    answers agree, token for token (temperature 0); stream_options.include_usage
    puts usage in the last chunk; unsupported parameters and bad messages are
    400s naming them."""
    run = Run()
    try:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
        for server in (run.router,):  # (the nodes of a PD pair take requests from it)
            st, obj = server.post("/v1/chat/completions",
                                  {"model": "pdserve-tiny", "messages": msgs,
                                   "max_completion_tokens": 6})
            assert st == 200 and obj["object"] == "chat.completion", (st, obj)
            choice = obj["choices"][0]
            assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
            assert obj["usage"]["completion_tokens"] == 6, obj
            st, events = server.stream("/v1/chat/completions",
                                       {"messages": msgs, "max_tokens": 6, "stream": True,
                                        "stream_options": {"include_usage": True}})
            assert st == 200 and events[-1] == "[DONE]", events[-2:]
            chunks = events[:-1]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            assert text == choice["message"]["content"], (text, choice)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == 6, chunks[-1]
        for body, words in (({"messages": [{"role": "robot", "content": "x"}]}, "role"),
                            ({"messages": msgs, "tools": [{"type": "function"}]}, "'tools'"),
                            ({"messages": msgs, "n": 0}, "'n'"),
                            ({"messages": msgs, "logprobs": 3}, "'logprobs'"),
                            ({"messages": msgs, "stream_options": {"x": 1}}, "stream_options")):
            st, obj = run.router.post("/v1/chat/completions", body)
            assert st == 400 and words in obj["error"]["message"], (body, st, obj)
        run.nodes_idle_clean()
    finally:
        run.stop()


def test_a_second_run_on_a_busy_port_is_refused():
    """Issue 11, finding 5: a second `pdserve run --port P` started silently
    on a port in use (the router bound with port reuse) and traffic split
    between two clusters. It now exits non-zero, naming the address."""
    import subprocess
    run = Run()
    try:
        r = subprocess.run([pdtest.PDSERVE, "run", "--port", str(run.router.port)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0, (r.returncode, r.stdout, r.stderr)
        assert "Address already in use" in r.stderr and str(run.router.port) in r.stderr, r.stderr
        st, _ = run.router.get("/health")
        assert st == 200
    finally:
        run.stop()


if __name__ == "__main__":
    pdtest.run_tests([test_run_matches_generate, test_abort_storm, test_router_bad_input,
                      test_models_are_listed, test_chat_completions,
                      test_a_second_run_on_a_busy_port_is_refused])

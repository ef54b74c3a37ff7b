"""End-to-end: SGLang's native utility endpoints (issue 11) on a `serve`
node, on prefill and decode nodes, and through `pdserve run`'s router:
/get_model_info, /get_server_info, /tokenize, /detokenize, /flush_cache
and /health_generate. Each was a 404 before."""
import http.client
import json
import threading
import time

import pdtest
from pdtest import Server
from test_run import Run

TEXTS = ["Hello", "h\u00e9llo w\u00f6rld \u2603 \U0001F600", "", "a" * 300, "tab\tnew\nline"]
# 100 bytes: six whole pages of 16 tokens with the begin token, so the
# prefix cache keeps 96 of its tokens.
LONG = "The quick brown fox jumps over the lazy dog. " * 2 + "0123456789"


def check_round_trip(server):
    """tokenize then detokenize gives the text back, one string or a batch."""
    for text in TEXTS:
        st, tok = server.post("/tokenize", {"text": text})
        assert st == 200, (server.name, text, st, tok)
        n_bytes = len(text.encode())
        assert tok["count"] == len(tok["tokens"]) == n_bytes + 1, (text, tok)  # begin token
        assert tok["max_model_len"] == 8192, tok
        st, plain = server.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        assert st == 200 and plain["tokens"] == tok["tokens"][1:], (text, plain, tok)
        st, detok = server.post("/detokenize", {"tokens": tok["tokens"]})
        assert st == 200 and detok["text"] == text, (server.name, text, st, detok)
    st, batch = server.post("/tokenize", {"text": TEXTS})
    assert st == 200 and batch["count"] == [len(t.encode()) + 1 for t in TEXTS], batch
    st, detok = server.post("/detokenize", {"tokens": batch["tokens"]})
    assert st == 200 and detok["text"] == TEXTS, (st, detok)


def check_refusals(server):
    """Bad ids, wrong types and bad JSON are 400s naming what is wrong."""
    cases = [
        ("/detokenize", {"tokens": [104, 105, 999]}, "'tokens'[2] = 999 is outside the vocabulary"),
        ("/detokenize", {"tokens": [[104], [105, -1]]}, "'tokens'[1][1] = -1 is outside the vocabulary"),
        ("/detokenize", {"tokens": [104, "i"]}, "'tokens'[1] is not an integer"),
        ("/detokenize", {"tokens": "hi"}, "'tokens' must be an array of token ids"),
        ("/detokenize", {}, "'tokens' is required"),
        ("/detokenize", {"tokens": [104], "skip_special_tokens": False}, "'skip_special_tokens'"),
        ("/tokenize", {"text": 5}, "'text' must be a string or an array of strings"),
        ("/tokenize", {"text": ["a", 7]}, "'text'[1] must be a string"),
        ("/tokenize", {"text": "a", "add_special_tokens": "yes"}, "'add_special_tokens' must be a boolean"),
        ("/tokenize", {"text": "a", "prompt": "b"}, "not both"),
    ]
    for path, body, words in cases:
        st, obj = server.post(path, body)
        assert st == 400 and obj["error"]["code"] == 400, (server.name, path, body, st, obj)
        assert words in obj["error"]["message"], (server.name, path, body, obj)
    st, obj = server.request("POST", "/tokenize", raw="{not json")
    assert st == 400 and "malformed JSON" in obj["error"]["message"], (st, obj)
    st, obj = server.get("/tokenize")
    assert st == 405, (st, obj)


def generate(server, text, **extra):
    st, res = server.post("/generate", dict({"text": text, "sampling_params": {"max_new_tokens": 2}}, **extra))
    assert st == 200, (st, res)
    return res["meta_info"]


class LongStream:
    """A streaming /generate that runs until aborted; started() once its
    first event arrived (the request is live on every node by then)."""

    def __init__(self, server, rid):
        self.first = threading.Event()
        self.events = []
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = {"text": LONG, "stream": True, "rid": rid,
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        self.conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        self.thread = threading.Thread(target=self._read)
        self.thread.start()
        assert self.first.wait(60), "no first event"

    def _read(self):
        r = self.conn.getresponse()
        for line in r:
            if line.startswith(b"data: "):
                self.events.append(line[6:].strip())
                self.first.set()
        self.first.set()

    def join(self):
        self.thread.join(60)
        assert not self.thread.is_alive(), "the aborted stream did not end"
        self.conn.close()
        assert self.events and self.events[-1] == b"[DONE]", self.events[-2:]
        final = json.loads(self.events[-2])
        assert final["meta_info"]["finish_reason"]["type"] == "abort", final


def check_flush(server, nodes):
    """Before a flush the same prompt reuses its cached pages; after it, none
    (cached_tokens 0) and every node's cache is empty and idle-clean."""
    generate(server, LONG)
    assert generate(server, LONG)["cached_tokens"] > 0
    for method in ("POST", "GET"):
        st, obj = server.request(method, "/flush_cache", body={} if method == "POST" else None)
        assert st == 200 and obj["status"] == "ok", (method, st, obj)
        for n in nodes:
            info = n.wait_idle_clean()
            for pool in info["pools"]["pools"]:
                assert pool["cache_evictable"] == 0 and pool["free"] == pool["total"], (n.name, pool)
    assert generate(server, LONG)["cached_tokens"] == 0
    assert generate(server, LONG)["cached_tokens"] > 0  # caching works again


def check_flush_refused_while_live(server, nodes, rid):
    stream = LongStream(server, rid)
    try:
        st, obj = server.post("/flush_cache", {})
        assert st == 400, (st, obj)
        msg = obj["error"]["message"]
        assert "only when the node is idle" in msg and "1 requests live" in msg, msg
    finally:
        st, obj = server.post("/abort_request", {"rid": rid})
        assert st == 200, (st, obj)
        stream.join()
    for n in nodes:
        n.wait_idle_clean()
    st, obj = server.post("/flush_cache", {})
    assert st == 200, (st, obj)


def test_tokenize_and_detokenize_on_serve():
    srv = Server(["serve", "--strict"])
    try:
        check_round_trip(srv)
        check_refusals(srv)
        srv.wait_idle_clean()
    finally:
        srv.stop()


def test_model_info_and_server_info_on_serve():
    srv = Server(["serve", "--strict", "--served-model-name", "tiny-x"])
    try:
        st, info = srv.get("/get_model_info")
        assert st == 200, (st, info)
        assert info["model_path"] == "tiny-x" and info["tokenizer_path"] == "tiny-x", info
        assert info["is_generation"] is True and info["preferred_sampling_params"] is None, info
        assert info["weight_version"] == "default" and info["vocab_size"] == 258, info
        assert info["max_prompt_tokens"] == 8192 and info["max_context_length"] >= 8192, info
        st, a = srv.get("/get_server_info")
        st2, b = srv.get("/server_info")
        assert st == st2 == 200 and a["role"] == b["role"] == "serve" and a["config"] == b["config"], (a, b)
        st, obj = srv.post("/get_model_info", {})
        assert st == 405, (st, obj)
    finally:
        srv.stop()
    srv = Server(["serve", "--context-length", "100"])
    try:
        st, info = srv.get("/get_model_info")
        assert st == 200 and info["max_context_length"] == 100, info
    finally:
        srv.stop()


def test_flush_cache_on_serve():
    srv = Server(["serve", "--strict"])
    try:
        check_flush(srv, [srv])
        check_flush_refused_while_live(srv, [srv], "long-serve")
    finally:
        srv.stop()


def test_health_generate_on_serve_runs_a_generation():
    srv = Server(["serve", "--strict"])
    try:
        before = srv.info()["counters"]
        st, obj = srv.get("/health_generate")
        assert st == 200 and obj["status"] == "ok", (st, obj)
        after = srv.wait_idle_clean()["counters"]
        assert after["submitted"] == before["submitted"] + 1, (before, after)
        assert after["finished"] == before["finished"] + 1 and after["prefill_tokens"] > before["prefill_tokens"], (before, after)
    finally:
        srv.stop()


def test_through_the_router():
    """The router relays model info, server info, tokenize and detokenize to
    a worker, flushes every worker, and /health_generate runs a real token
    through a prefill and decode pair; the nodes answer /health_generate
    with a scheduler round trip."""
    run = Run()
    try:
        r = run.router
        st, info = r.get("/get_model_info")
        assert st == 200 and info["model_path"] == "pdserve-tiny" and info["role"] == "decode", (st, info)
        st, info = r.get("/get_server_info")
        assert st == 200 and info["role"] == "decode" and "pools" in info, (st, str(info)[:300])
        check_round_trip(r)
        check_refusals(r)
        before = [n.info()["counters"]["submitted"] for n in (run.p, run.d)]
        st, obj = r.get("/health_generate")
        assert st == 200 and obj["status"] == "ok", (st, obj)
        assert obj["prefill"].endswith(":%d" % run.p.port) and obj["decode"].endswith(":%d" % run.d.port), obj
        after = [n.info()["counters"]["submitted"] for n in (run.p, run.d)]
        assert after == [b + 1 for b in before], (before, after)
        for node, role in ((run.p, "prefill"), (run.d, "decode")):
            st, obj = node.get("/health_generate")
            assert st == 200 and obj == {"status": "ok", "role": role}, (role, st, obj)
        check_flush(r, [run.p, run.d])
        st, obj = r.post("/flush_cache", {})
        assert st == 200 and sorted(w["role"] for w in obj["workers"]) == ["decode", "prefill"], obj
        check_flush_refused_while_live(r, [run.p, run.d], "long-run")
        run.nodes_idle_clean()
    finally:
        run.stop()


if __name__ == "__main__":
    pdtest.run_tests([test_tokenize_and_detokenize_on_serve, test_model_info_and_server_info_on_serve,
                      test_flush_cache_on_serve, test_health_generate_on_serve_runs_a_generation,
                      test_through_the_router])

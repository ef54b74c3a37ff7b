"""End-to-end: prefill and decode as separate processes joined by UCX (over
shared memory and over TCP), behind `pdserve router`. The answers are
token-identical to `pdserve generate`; SIGKILL of the decode process in the
middle of transfers makes the router report errors for the affected
requests, the prefill node frees everything once the peer is gone, and a
restarted decode process serves new requests."""
import subprocess
import threading
import time

import pdtest
from pdtest import Server


class Cluster:
    def __init__(self, tls, extra=(), decode_port=None):
        self.env = {"UCX_TLS": tls, "UCX_NET_DEVICES": "lo"} if tls == "tcp" else {"UCX_TLS": tls}
        self.extra = list(extra)
        self.boot = pdtest.free_port()
        self.p = Server(["prefill", "--strict", "--transfer-backend", "ucx", "--disaggregation-bootstrap-port",
                         str(self.boot)] + self.extra, env=self.env, name="prefill")
        self.start_decode()
        self.r = Server(["router", "--prefill", "http://127.0.0.1:%d@%d" % (self.p.port, self.boot),
                         "--decode", "http://127.0.0.1:%d" % self.d.port, "--health-interval-ms", "200"],
                        name="router")

    def start_decode(self, port=None):
        args = ["decode", "--strict", "--transfer-backend", "ucx"] + self.extra
        # A restart reuses the port the router knows.
        self.d = Server(args, env=self.env, name="decode", port=port)

    def stop(self):
        for s in (self.r, self.d, self.p):
            s.stop()


def check_identity(cl, n=22):
    for i, prompt in enumerate(pdtest.prompts(n)):
        max_new = 1 + (i % 5) * 4
        want = pdtest.generate_reference(prompt, max_new)
        body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new}}
        if i % 3 == 0:
            st, events = cl.r.stream("/generate", dict(body, stream=True))
            assert st == 200 and events[-1] == "[DONE]", (st, events[-2:])
            ids = pdtest.stream_ids(events)
        else:
            st, res = cl.r.post("/generate", body)
            assert st == 200, (st, res)
            ids = res["output_ids"]
        assert ids == want, (i, ids, want)
    cl.p.wait_idle_clean()
    cl.d.wait_idle_clean()


def test_ucx_tcp_page_16_chunk_64():
    cl = Cluster("tcp", ["--page-size", "16", "--chunked-prefill-size", "64"])
    try:
        check_identity(cl)
    finally:
        cl.stop()


def test_ucx_shm_page_1_chunk_7():
    cl = Cluster("shm", ["--page-size", "1", "--chunked-prefill-size", "7"])
    try:
        check_identity(cl)
    finally:
        cl.stop()


def test_decode_contacts_only_listed_prefill_peers():
    """Issue 10, finding 2: a /generate sent straight to a decode node could
    name any bootstrap_host, and the decode node connected there (handing
    over its token, worker address and memory keys). With --prefill-peers it
    refuses every other peer with 403 and never contacts it."""
    cl = Cluster("tcp")
    try:
        cl.d.stop()
        cl.d = Server(["decode", "--strict", "--transfer-backend", "ucx", "--prefill-peers",
                       "127.0.0.1:%d" % cl.boot], env=cl.env, name="decode", port=cl.d.port)
        st, obj = cl.d.post("/generate", {"text": "hi", "bootstrap_room": 77, "bootstrap_host": "10.255.255.1",
                                          "bootstrap_port": 9, "sampling_params": {"max_new_tokens": 2}})
        assert st == 403 and obj["error"]["type"] == "permission_error", (st, obj)
        assert "'10.255.255.1:9' is not one of --prefill-peers" in obj["error"]["message"], obj
        deadline = time.time() + 10  # the router sees the restarted decode node healthy
        while time.time() < deadline and not cl.r.get("/server_info")[1].get("healthy_pair"):
            time.sleep(0.1)
        check_identity(cl, n=4)  # the listed peer, through the router, still works
    finally:
        cl.stop()


def test_bootstrap_beyond_loopback_needs_a_token():
    """Issue 10: by default there was no token and the bootstrap channel
    listened on 0.0.0.0. It now listens on --host, and beyond loopback a
    prefill node without a token refuses to start unless told."""
    args = [pdtest.PDSERVE, "prefill", "--transfer-backend", "ucx", "--host", "0.0.0.0", "--port", "0",
            "--disaggregation-bootstrap-port", "0"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--insecure-bootstrap" in r.stderr, (r.returncode, r.stderr)
    p = Server(["prefill", "--transfer-backend", "ucx", "--host", "0.0.0.0", "--bootstrap-token", "s3cret",
                "--disaggregation-bootstrap-port", str(pdtest.free_port())], name="prefill-token")
    try:
        st, obj = p.get("/health")
        assert st == 200, (st, obj)
    finally:
        p.stop()


def test_ucx_refused_half_ends_its_peer():
    cl = Cluster("tcp", ["--bootstrap-timeout-ms", "600000", "--transfer-timeout-ms", "600000",
                         "--max-total-tokens", "1024"])
    try:
        pdtest.check_refused_half_ends_its_peer(cl.p, cl.d, cl.boot, 7000)
    finally:
        cl.stop()


def test_decode_sigkill_mid_transfer_then_restart():
    cl = Cluster("tcp", ["--page-size", "16", "--chunked-prefill-size", "32", "--max-prompt-tokens", "8192"])
    try:
        results = []

        def client(i):
            body = {"text": ("long prompt %d " % i) * 200, "stream": i % 2 == 0,
                    "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
            try:
                if body["stream"]:
                    st, events = cl.r.stream("/generate", body)
                    final = events[-2] if len(events) >= 2 and events[-1] == "[DONE]" else events
                    results.append(("stream", st, final))
                else:
                    results.append(("plain",) + cl.r.post("/generate", body))
            except Exception as e:
                results.append(("exception", 0, repr(e)))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        # Kill the decode process while the prefill node is still computing and sending.
        deadline = time.time() + 30
        while time.time() < deadline:
            c = cl.p.info()["counters"]
            if c["prefill_tokens"] > 3000:
                break
            time.sleep(0.01)
        cl.d.kill()
        for t in threads:
            t.join(120)
        assert len(results) == 8
        # Every client got one final answer, and the affected ones an error.
        errors = 0
        for kind, st, body in results:
            if kind == "plain":
                if st != 200 or body["meta_info"]["finish_reason"]["type"] == "abort":
                    errors += 1
            elif kind == "stream":
                if st != 200 or "error" in body or body.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort":
                    errors += 1
            else:
                raise AssertionError(body)
        assert errors >= 1, results
        # The prefill node frees everything: rooms fail, quarantine drains after the peer is gone.
        info = cl.p.wait_idle_clean(60)
        assert info["counters"]["failed"] + info["counters"]["aborted"] >= 1, info["counters"]
        # A restarted decode process (same port) serves new requests.
        cl.start_decode(port=cl.d.port)
        deadline = time.time() + 30
        while time.time() < deadline:
            st, res = cl.r.post("/generate", {"text": "after the restart", "sampling_params": {"max_new_tokens": 6}})
            if st == 200:
                break
            time.sleep(0.2)
        assert st == 200, (st, res)
        assert res["output_ids"] == pdtest.generate_reference("after the restart", 6)
        cl.p.wait_idle_clean()
        cl.d.wait_idle_clean()
    finally:
        cl.stop()


if __name__ == "__main__":
    pdtest.run_tests([test_ucx_tcp_page_16_chunk_64, test_ucx_shm_page_1_chunk_7,
                      test_decode_contacts_only_listed_prefill_peers, test_bootstrap_beyond_loopback_needs_a_token,
                      test_ucx_refused_half_ends_its_peer, test_decode_sigkill_mid_transfer_then_restart])

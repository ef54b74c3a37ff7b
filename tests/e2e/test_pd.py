"""End-to-end: disaggregated prefill + decode. The decode node's answer is
token-identical to `pdserve generate` for prompts of mixed lengths, page
sizes {1, 16} and several chunk sizes, streaming and not; afterwards both
nodes are idle with every pool back.

Topologies: `pdserve run --no-router` (both nodes in one process, loopback
transport) with this script playing the router, and — when a transport
argument is given — two processes joined by UCX (see test_pd_ucx)."""
import json
import random
import threading

import pdtest
from pdtest import Server

_room = random.Random(7)


def pd_generate(p, d, body, stream=False):
    """What the router does: the same body plus bootstrap fields to both
    nodes, concurrently; returns the decode node's answer (and checks the
    prefill node's)."""
    body = dict(body)
    body["bootstrap_room"] = _room.randrange(1, 2 ** 62)
    body["bootstrap_host"] = "127.0.0.1"
    body["bootstrap_port"] = p.bootstrap_port if hasattr(p, "bootstrap_port") else 8998
    body.setdefault("rid", "r%d" % body["bootstrap_room"])
    out = {}

    def prefill():
        out["p"] = p.post("/generate", dict(body, stream=False))

    t = threading.Thread(target=prefill)
    t.start()
    if stream:
        res = d.stream("/generate", dict(body, stream=True))
    else:
        res = d.post("/generate", body)
    t.join(120)
    st, pb = out["p"]
    return res, (st, pb)


class RunPair:
    """`pdserve run --no-router`: prefill and decode in one process."""

    def __init__(self, extra):
        self.srv = Server(["run", "--no-router", "--strict"] + list(extra), port_flag="--prefill-port",
                          wait=False, name="run")
        import time
        deadline = time.time() + 60
        self.dport = None
        while time.time() < deadline and self.dport is None:
            for line in self.srv.output().splitlines():
                if "decode node http://" in line:
                    self.dport = int(line.split("decode node http://")[1].split(":")[1].split(" ")[0])
            time.sleep(0.05)
        assert self.dport, self.srv.output()
        self.p = self.srv
        self.d = _Alias(self.srv, self.dport, "decode")
        self.p.wait_healthy()
        self.d.wait_healthy()

    def stop(self):
        self.srv.stop()


class _Alias(Server):
    """Another HTTP port of an already running process."""

    def __init__(self, owner, port, name):
        self.port, self.name, self.proc, self.log_path = port, name, owner.proc, owner.log_path
        self.log = owner.log


def check_identity(pair, n_prompts=24):
    for i, prompt in enumerate(pdtest.prompts(n_prompts)):
        max_new = 1 + (i % 5) * 4
        want = pdtest.generate_reference(prompt, max_new)
        body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new}}
        stream = i % 3 == 0
        (st, res), (pst, pbody) = pd_generate(pair.p, pair.d, body, stream=stream)
        assert st == 200, (st, res)
        assert pst == 200 and pbody["meta_info"]["finish_reason"]["type"] == "transferred", pbody
        if stream:
            assert res[-1] == "[DONE]"
            ids = pdtest.stream_ids(res)
            assert res[-2]["meta_info"]["finish_reason"]["type"] in ("length", "stop")
        else:
            ids = res["output_ids"]
        assert ids == want, (i, len(prompt), ids, want)
    pair.p.wait_idle_clean()
    pair.d.wait_idle_clean()


def test_loopback_page_16_chunk_512():
    pair = RunPair(["--page-size", "16", "--chunked-prefill-size", "512"])
    try:
        check_identity(pair)
    finally:
        pair.stop()


def test_loopback_page_1_chunk_7():
    pair = RunPair(["--page-size", "1", "--chunked-prefill-size", "7"])
    try:
        check_identity(pair)
    finally:
        pair.stop()


def test_loopback_page_16_chunk_48_prefix_reuse():
    pair = RunPair(["--page-size", "16", "--chunked-prefill-size", "48"])
    try:
        check_identity(pair)
        check_identity(pair)  # the second round hits both prefix caches
        info = pair.p.info()
        assert info["counters"]["cached_tokens"] > 0, info["counters"]
    finally:
        pair.stop()


def test_refused_half_ends_its_peer():
    pair = RunPair(["--bootstrap-timeout-ms", "600000", "--transfer-timeout-ms", "600000",
                    "--max-total-tokens", "1024"])
    try:
        pdtest.check_refused_half_ends_its_peer(pair.p, pair.d, 8998, 5000)
    finally:
        pair.stop()


def test_pd_node_refuses_requests_without_bootstrap_fields():
    pair = RunPair([])
    try:
        for node in (pair.p, pair.d):
            st, obj = node.post("/generate", {"text": "hi"})
            assert st == 400 and "bootstrap_room" in obj["error"]["message"], obj
        pair.p.wait_idle_clean()
        pair.d.wait_idle_clean()
    finally:
        pair.stop()


if __name__ == "__main__":
    pdtest.run_tests([
        test_loopback_page_16_chunk_512,
        test_loopback_page_1_chunk_7,
        test_loopback_page_16_chunk_48_prefix_reuse,
        test_pd_node_refuses_requests_without_bootstrap_fields,
        test_refused_half_ends_its_peer,
    ])

"""End-to-end: every /metrics text pdserve serves passes Prometheus's own
linter, `promtool check metrics` (Debian's prometheus package; scripts/deps.sh
installs it): the router's and both nodes' of a `pdserve run`, after traffic,
so the histograms and labelled series are populated. Issue 11: the router's
families had no HELP lines and promtool failed on 12 of them. Exits 77
(ctest: skipped) when promtool is not installed.

The node that ends a request measures it (issue 11: the prefill node's TTFT
and ITL histograms stayed at zero): after one streamed request through
`pdserve run`, the decode node's TTFT histogram counts it, under pdserve's
and SGLang's names, the prefill node's prefill-compute histogram counts it,
both halves count its hand-off, and both count the same bytes, at least its
prompt's pages and Mamba state."""
import os
import re
import shutil
import subprocess
import sys

import pdtest
from test_run import Run


def promtool(text):
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    return r.returncode, (r.stdout + r.stderr).strip()


def promtool_check(text, who):
    """promtool passes the text. Its linter reserves ':' for recording rules,
    so it flags SGLang's own metric names (sglang:...), which the nodes export
    for SGLang's dashboards: that is the only thing it may say, and without
    those families it says nothing at all."""
    rc, said = promtool(text)
    colon = re.compile(r"^sglang:[a-z0-9_]+ metric names should not contain ':'$")
    others = [line for line in said.splitlines() if not colon.match(line)]
    assert rc in (0, 3) and not others, "%s: promtool check metrics says:\n%s" % (who, said)
    plain = "".join(line + "\n" for line in text.splitlines()
                    if not re.match(r"^(# (HELP|TYPE) )?sglang:", line))
    rc, said = promtool(plain)
    assert rc == 0 and not said, "%s: promtool check metrics says:\n%s" % (who, said)


def fetch(server):
    c = server.conn(30)
    c.request("GET", "/metrics")
    r = c.getresponse()
    body = r.read().decode()
    c.close()
    assert r.status == 200, (server.name, r.status, body[:300])
    return body


def families(text):
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def documented():
    """The metric names docs/http-api.md's metrics tables list."""
    doc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                       "http-api.md")
    with open(doc) as f:
        return set(re.findall(r"^\| `((?:pdserve_|sglang:)[a-z0-9_]+)` \|", f.read(), re.M))


def test_every_metrics_text_passes_promtool():
    run = Run(["--enable-metrics"])
    try:
        for i in range(6):
            st, obj = run.router.post("/generate", {"text": "metrics %d" % i,
                                                    "sampling_params": {"max_new_tokens": 4}})
            assert st == 200, obj
        st, _ = run.router.post("/generate", {"text": 5})  # one refusal, counted by status
        assert st == 400
        exported = set()
        for server in (run.router, run.p, run.d):
            text = fetch(server)
            assert "# HELP" in text and "# TYPE" in text, server.name
            promtool_check(text, server.name)
            exported |= families(text)
        # Issue 11: the docs listed a metric that did not exist, and left out
        # most that did. The table and the exports agree, both ways.
        docs = documented()
        assert exported - docs == set(), ("exported but not documented", exported - docs)
        assert docs - exported == set(), ("documented but not exported", docs - exported)
        run.nodes_idle_clean()
    finally:
        run.stop()


def series(text):
    """{'name{labels}': value} of every sample of a metrics text."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_the_node_that_ends_a_request_measures_it():
    run = Run(["--enable-metrics"])
    try:
        page_size = run.d.info()["config"]["page_size"]
        kv_page_bytes = run.d.info()["config"]["kv_page_bytes"]
        mamba_slot_bytes = run.d.info()["config"]["mamba_slot_bytes"]
        assert kv_page_bytes > 0 and mamba_slot_bytes > 0, run.d.info()["config"]
        p0, d0 = series(fetch(run.p)), series(fetch(run.d))
        body = {"text": "A prompt of a few pages, to hand over from one node to the other. " * 2,
                "stream": True, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
        st, events = run.router.stream("/generate", body)
        assert st == 200 and events[-1] == "[DONE]", events[-2:]
        meta = events[-2]["meta_info"]
        prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
        assert completion == 6 and prompt > 2 * page_size, meta
        run.nodes_idle_clean()  # the prefill's terminal event is in
        p1, d1 = series(fetch(run.p)), series(fetch(run.d))

        def delta(before, after, key):
            return after.get(key, 0.0) - before.get(key, 0.0)

        m = '{model_name="pdserve-tiny"}'
        # The decode node ends the request: it observes its tokens.
        assert delta(d0, d1, "pdserve_time_to_first_token_seconds_count") == 1
        assert delta(d0, d1, "sglang:time_to_first_token_seconds_count" + m) == 1
        assert delta(d0, d1, "pdserve_inter_token_latency_seconds_count") == completion - 1
        assert delta(d0, d1, "sglang:inter_token_latency_seconds_count" + m) == completion - 1
        assert delta(d0, d1, "sglang:e2e_request_latency_seconds_count" + m) == 1
        assert delta(d0, d1, "sglang:prompt_tokens_total" + m) == prompt
        assert delta(d0, d1, "sglang:generation_tokens_total" + m) == completion
        assert delta(d0, d1, "pdserve_transfer_latency_seconds_count") == 1
        assert "pdserve_prefill_compute_seconds_count" not in d1
        # The prefill node computes the prompt and hands it over; it emits no
        # token, so it exports no token histogram (it was always zero there).
        assert delta(p0, p1, "pdserve_prefill_compute_seconds_count") == 1
        assert delta(p0, p1, "pdserve_prefill_compute_seconds_sum") > 0
        assert delta(p0, p1, "pdserve_transfer_latency_seconds_count") == 1
        assert delta(p0, p1, "pdserve_transfer_throughput_bytes_per_second_count") == 1
        for gone in ("pdserve_time_to_first_token_seconds_count",
                     "pdserve_inter_token_latency_seconds_count",
                     "sglang:time_to_first_token_seconds_count" + m):
            assert gone not in p1, gone
        # Both halves count the same hand-off: the prompt's pages (the decode
        # node had none of it cached), its Mamba state and its metadata row.
        sent = delta(p0, p1, "pdserve_transfer_bytes_total")
        received = delta(d0, d1, "pdserve_transfer_bytes_total")
        pages = -(-prompt // page_size)
        least = pages * kv_page_bytes + mamba_slot_bytes
        assert sent == received and least <= sent <= least + 4096, (sent, received, least)
        for srv in (run.p, run.d):
            promtool_check(fetch(srv), srv.name)
    finally:
        run.stop()


if __name__ == "__main__":
    if not shutil.which("promtool"):
        print("SKIPPED: promtool is not installed (Debian package prometheus; scripts/deps.sh)")
        sys.exit(77)
    pdtest.run_tests([test_every_metrics_text_passes_promtool,
                      test_the_node_that_ends_a_request_measures_it])

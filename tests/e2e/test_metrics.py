"""End-to-end: every /metrics text pdserve serves passes Prometheus's own
linter, `promtool check metrics` (Debian's prometheus package; scripts/deps.sh
installs it): the router's and both nodes' of a `pdserve run`, after traffic,
so the histograms and labelled series are populated. Issue 11: the router's
families had no HELP lines and promtool failed on 12 of them. Exits 77
(ctest: skipped) when promtool is not installed."""
import os
import re
import shutil
import subprocess
import sys

import pdtest
from test_run import Run


def promtool_check(text, who):
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), \
        "%s: promtool check metrics says:\n%s%s" % (who, r.stdout, r.stderr)


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
        return set(re.findall(r"^\| `(pdserve_[a-z0-9_]+)` \|", f.read(), re.M))


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


if __name__ == "__main__":
    if not shutil.which("promtool"):
        print("SKIPPED: promtool is not installed (Debian package prometheus; scripts/deps.sh)")
        sys.exit(77)
    pdtest.run_tests([test_every_metrics_text_passes_promtool])

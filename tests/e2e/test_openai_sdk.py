"""End-to-end with the official OpenAI SDK (npm `openai`, installed by
scripts/deps.sh into tests/e2e/sdk): tests/e2e/sdk/check_openai.mjs points it
at `pdserve run` and at a three-process UCX deployment (prefill, decode,
router) and checks models.list, chat and completions, plain and streamed,
stream_options.include_usage, an abort mid-stream and 400s that name the
unsupported options; afterwards every node is idle and clean. Exits 77
(ctest: skipped) when Node.js or the SDK is not installed."""
import os
import shutil
import subprocess
import sys

import pdtest
from test_run import Run

HERE = os.path.dirname(os.path.abspath(__file__))
SDK = os.path.join(HERE, "sdk")


def run_checks(base_url):
    r = subprocess.run(["node", os.path.join(SDK, "check_openai.mjs"), base_url], cwd=SDK,
                       capture_output=True, text=True, timeout=300)
    print(r.stdout, end="")
    assert r.returncode == 0 and "all checks passed" in r.stdout, r.stdout + r.stderr


def test_openai_sdk_against_pdserve_run():
    run = Run()
    try:
        run_checks("http://127.0.0.1:%d/v1" % run.router.port)
        run.nodes_idle_clean()
        assert run.d.info()["counters"]["aborted"] >= 1, "the SDK's abort aborted nothing"
    finally:
        run.stop()


def test_openai_sdk_against_three_processes_over_ucx():
    token = "sdk-test-token"
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    boot = pdtest.free_port()
    p = pdtest.Server(["prefill", "--strict", "--bootstrap-token", token,
                       "--disaggregation-bootstrap-port", str(boot)], env=env, name="prefill")
    d = pdtest.Server(["decode", "--strict", "--bootstrap-token", token,
                       "--prefill-peers", "127.0.0.1:%d" % boot], env=env, name="decode")
    r = pdtest.Server(["router", "--prefill", "http://127.0.0.1:%d@%d" % (p.port, boot),
                       "--decode", "http://127.0.0.1:%d" % d.port], name="router")
    try:
        run_checks("http://127.0.0.1:%d/v1" % r.port)
        p.wait_idle_clean()
        d.wait_idle_clean()
        assert d.info()["counters"]["aborted"] >= 1, "the SDK's abort aborted nothing"
    finally:
        for s in (r, d, p):
            s.stop()


if __name__ == "__main__":
    if not shutil.which("node") or not os.path.isdir(os.path.join(SDK, "node_modules", "openai")):
        print("SKIPPED: Node.js or the openai SDK is missing (scripts/deps.sh installs them)")
        sys.exit(77)
    pdtest.run_tests([test_openai_sdk_against_pdserve_run,
                      test_openai_sdk_against_three_processes_over_ucx])

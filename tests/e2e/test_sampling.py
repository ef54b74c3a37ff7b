"""End-to-end (issue 11): the sampling parameters, choices, stop strings and
logprobs that real clients send.

- Identity: with a seed, top_k, min_p, the three penalties and top
  logprobs, `pdserve serve` at two page and chunk sizes (and one or two
  executor threads) and `pdserve run`
  (prefill and decode apart) answer token for token and logprob for
  logprob the same; the parameters change the answer.
- Choices: n and a batch of prompts are numbered as OpenAI numbers them;
  greedy choices equal the single requests; seeded ones differ from each
  other and are the same again when streamed.
- Stop strings: the text ends where the stop string begins, the token that
  completed it counts, no event of a stream (cumulative or incremental)
  ever shows it, and a stop string that spans tokens is found.
- Aborting a request's rid aborts all its choices; every node ends idle.
"""
import pdtest
from pdtest import Server
from test_run import Run

PROMPT = "The quick brown fox jumps over the lazy dog"


def body(extra_sampling=None, **top):
    sp = {"max_new_tokens": 24}
    sp.update(extra_sampling or {})
    b = {"text": PROMPT, "sampling_params": sp}
    b.update(top)
    return b


SAMPLED = [
    ({"temperature": 0.9, "seed": 11}, {}),
    ({"temperature": 1.2, "top_k": 5, "seed": 12}, {}),
    ({"temperature": 1.0, "min_p": 0.5, "sampling_seed": 13}, {}),
    ({"temperature": 0.7, "top_p": 0.8, "top_k": 40, "min_p": 0.05, "seed": 14}, {}),
    ({"repetition_penalty": 1.5}, {}),
    ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {}),
    ({"temperature": 0.8, "presence_penalty": -1.0, "seed": 15}, {}),
    ({"temperature": 0.6, "seed": 16}, {"return_logprob": True, "top_logprobs_num": 4}),
    ({}, {"return_logprob": True, "top_logprobs_num": 20}),
]


def answers(server, path="/generate"):
    out = []
    for sp, top in SAMPLED:
        st, obj = server.post(path, body(sp, **top))
        assert st == 200, (sp, st, obj)
        m = obj["meta_info"]
        out.append((obj["output_ids"], m.get("output_token_logprobs"),
                    m.get("output_top_logprobs")))
    return out


def test_sampling_is_identical_across_page_chunk_and_placement():
    runs = []
    for extra in (["--page-size", "16", "--chunked-prefill-size", "512"],
                  ["--page-size", "1", "--chunked-prefill-size", "3", "--threads", "2"]):
        srv = Server(["serve", "--strict"] + extra)
        try:
            runs.append(answers(srv))
            srv.wait_idle_clean()
        finally:
            srv.stop()
    run = Run(["--page-size", "4", "--chunked-prefill-size", "7"])
    try:
        runs.append(answers(run.router))
        run.nodes_idle_clean()
    finally:
        run.stop()
    assert runs[0] == runs[1], "serve differs across page/chunk size and threads"
    assert runs[0] == runs[2], "pdserve run differs from serve"
    greedy = pdtest.generate_reference(PROMPT, 24)
    changed = [ids != greedy for ids, _, _ in runs[0][:7]]
    assert all(changed), ("a parameter did not change the greedy answer", changed)
    ids, lps, tops = runs[0][8]
    assert ids == greedy and len(lps) == 24 and all(len(t) == 20 for t in tops)
    for (lp, tok, _), top in zip(lps, tops):
        assert top[0][1] == tok and top[0][0] == lp, (lp, tok, top[0])  # greedy = likeliest
        assert all(a[0] >= b[0] for a, b in zip(top, top[1:])), top


def test_choices_and_batches():
    run = Run()
    try:
        prompts = ["Hello there", "General Kenobi"]
        singles = [pdtest.generate_reference(p, 6) for p in prompts]
        st, objs = run.router.post("/generate", {"text": prompts,
                                                 "sampling_params": {"max_new_tokens": 6, "n": 2}})
        assert st == 200 and len(objs) == 4, (st, objs)
        for i, o in enumerate(objs):
            assert o["index"] == i and o["output_ids"] == singles[i // 2], (i, o)
        st, one = run.router.post("/generate", {"input_ids": [[1, 2, 3]],
                                                "sampling_params": {"max_new_tokens": 3}})
        assert st == 200 and isinstance(one, list) and len(one) == 1, one
        seeded = {"prompt": "Once", "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 5}
        st, obj = run.router.post("/v1/completions", seeded)
        texts = [c["text"] for c in obj["choices"]]
        assert st == 200 and [c["index"] for c in obj["choices"]] == [0, 1, 2], obj
        assert len(set(texts)) == 3, texts
        assert obj["usage"]["completion_tokens"] == 24, obj["usage"]
        st, events = run.router.stream("/v1/completions", dict(seeded, stream=True))
        got = ["", "", ""]
        for e in events[:-1]:
            for c in e["choices"]:
                got[c["index"]] += c["text"]
        assert got == texts, (got, texts)
        st, obj = run.router.post("/v1/completions", {"prompt": ["ab", [10, 11]], "max_tokens": 2,
                                                      "echo": True})
        assert st == 200 and obj["choices"][0]["text"].startswith("ab"), obj
        assert obj["choices"][1]["text"].startswith("\n\x0b"), obj
        run.nodes_idle_clean()
    finally:
        run.stop()


def stop_case(server, stop, stream):
    b = body({"max_new_tokens": 40, "stop": [stop, "never-there"]})
    if not stream:
        st, obj = server.post("/generate", b)
        assert st == 200, obj
        return obj, [obj]
    st, events = server.stream("/generate", dict(b, stream=True))
    assert st == 200 and events[-1] == "[DONE]", events[-2:]
    for e in events[:-1]:
        assert stop not in e["text"], (stop, e)
    return events[-2], events[:-1]


def test_stop_strings_end_the_text_and_are_never_shown():
    greedy = pdtest.generate_reference(PROMPT, 40)
    raw = bytes(t for t in greedy if t < 256)
    # Two printable ASCII bytes (two tokens of the byte tokenizer) from the
    # middle: the answer must end where they first occur.
    at = next(i for i in range(8, len(raw) - 2) if all(32 < b < 127 for b in raw[i:i + 2]))
    stop = raw[at:at + 2].decode()
    first = raw.index(raw[at:at + 2])
    for incremental in (False, True):
        srv = Server(["serve", "--strict"] + (["--incremental-streaming-output"]
                                              if incremental else []))
        try:
            # The text before the stop string: the answer of `first` tokens.
            st, cut = srv.post("/generate", body({"max_new_tokens": first}))
            assert st == 200 and stop not in cut["text"], cut
            for stream in (False, True):
                final, _ = stop_case(srv, stop, stream)
                m = final["meta_info"]
                assert final["text"] == cut["text"], (final["text"], cut["text"])
                assert m["finish_reason"] == {"type": "stop", "matched": stop}, m
                # the token that completed the stop string counts; none after
                assert m["completion_tokens"] == first + 2, (m, first)
                assert final["output_ids"] == greedy[:first + 2], final["output_ids"]
            text = cut["text"]
            # Chat and completions end there too.
            st, obj = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 40,
                                                   "stop": stop})
            assert obj["choices"][0]["text"] == text, obj
            assert obj["choices"][0]["finish_reason"] == "stop", obj
            srv.wait_idle_clean()
        finally:
            srv.stop()


def test_abort_by_rid_ends_every_choice():
    srv = Server(["serve", "--strict"])
    try:
        import threading
        result = {}

        def long():
            result["r"] = srv.post("/generate", {
                "text": ["a", "b"], "rid": "many",
                "sampling_params": {"max_new_tokens": 4000, "n": 3, "ignore_eos": True}})
        t = threading.Thread(target=long)
        t.start()
        import time
        deadline = time.time() + 30
        while time.time() < deadline and srv.info()["counters"].get("submitted", 0) < 6:
            time.sleep(0.02)
        st, obj = srv.post("/abort_request", {"rid": "many"})
        assert st == 200 and obj["aborted"] == 6, (st, obj)
        t.join(60)
        st, objs = result["r"]
        assert st == 200 and len(objs) == 6, (st, objs)
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in objs), objs
        assert [o["meta_info"]["id"] for o in objs] == ["many"] + ["many#%d" % i
                                                                   for i in range(1, 6)]
        srv.wait_idle_clean()
    finally:
        srv.stop()


if __name__ == "__main__":
    pdtest.run_tests([test_sampling_is_identical_across_page_chunk_and_placement,
                      test_choices_and_batches, test_stop_strings_end_the_text_and_are_never_shown,
                      test_abort_by_rid_ends_every_choice])

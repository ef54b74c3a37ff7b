#!/usr/bin/env python3
"""Writes the tokenizer test corpus: a JSON array of strings, generated (no
copied prose) from a fixed seed, so every run and every machine gets the same
bytes. Usage: gen_corpus.py OUT.json [MIN_BYTES]
       gen_corpus.py --sweep OUT.json

--sweep writes every code point from U+0020 to U+2FFFF that this Python's
Unicode database assigns (surrogates, private use and the three below left
out), each in a few contexts (between letters, before digits, doubled, after
a contraction): the regex classes \\p{L}, \\p{N}, \\s and NFC of PCRE2 and
utf8proc checked against JavaScript's one code point at a time. Code points
assigned after the Unicode version of PCRE2 (10.42: Unicode 14) would differ,
which is why the sweep follows Python 3.11's database (also Unicode 14).

Each document mixes the pieces a tokenizer gets wrong first: English-like
words with contractions and capitals, code, numbers of every length, CJK,
Hangul, Thai, Arabic, Cyrillic, emoji (ZWJ sequences, skin tones, flags,
keycaps), combining marks (NFC and NFD spellings), runs of spaces, tabs and
newlines, Unicode spaces, and special tokens embedded mid-text.

Characters whose class differs between the JS reference and the Rust
tokenizers crate are left out here and pinned by test_hf_tokenizer.c:
U+0085 and U+FEFF (\\s in one engine, not the other), U+180E (PCRE2's \\s
only). Invalid UTF-8 cannot live in a JS string; tok_dump splices it in."""
import json
import random
import sys
import unicodedata

SYLLABLES = ["ka", "lo", "mi", "ren", "tas", "vo", "qui", "stra", "bel", "don", "fi", "gor",
             "hun", "jex", "pla", "zu", "the", "ing", "ous", "tion", "er", "an", "pre", "con"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ll", "n't"]
PUNCT = [".", ",", "!", "?", ";", ":", "...", "--", "(", ")", "\"", "'", "“", "”", "«", "»", "—"]
SPECIALS = {
    "qwen3": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
              "<|fim_prefix|>", "<think>", "</think>", "<|vision_pad|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>", "<|reserved_special_token_7|>"],
}
EMOJI = ["😀", "🚀", "👍", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵", "🇫🇷", "1️⃣", "❤️", "🧑🏿‍🔬",
         "🤷‍♀️", "✊🏻", "🫠", "🐍", "☕"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2009",
          "\u2028", "        ", "\t\t", " \t\n"]
CODE = [
    "def f(x):\n    return x * 2  # double\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\n",
    "if err != nil {\n\treturn fmt.Errorf(\"load: %w\", err)\n}\n",
    "const y = arr.map((v) => v ** 2).filter(Boolean);\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }\n",
    "    let s: Vec<u8> = b\"bytes\".to_vec();\n",
    "x=1;y=2;z=x+y*3//4\n",
    "<div class=\"a\">&amp; &lt;tag&gt;</div>\n",
    "{\"key\": [1, 2.5, -3e10, null, true], \"k2\": \"v\"}\n",
]


def rand_cjk(r):
    ranges = [(0x4E00, 0x9FFF), (0x3040, 0x309F), (0x30A0, 0x30FF), (0xAC00, 0xD7A3),
              (0x3400, 0x4DBF), (0x20000, 0x2A6DF)]
    lo, hi = r.choice(ranges)
    return "".join(chr(r.randint(lo, hi)) for _ in range(r.randint(1, 12)))


def rand_script(r):
    ranges = [(0x0E01, 0x0E2E), (0x0627, 0x064A), (0x0410, 0x044F), (0x03B1, 0x03C9),
              (0x05D0, 0x05EA), (0x0905, 0x0939)]
    lo, hi = r.choice(ranges)
    return "".join(chr(r.randint(lo, hi)) for _ in range(r.randint(2, 9)))


def combining(r):
    base = r.choice("aeiouncAEOZ")
    marks = "".join(chr(r.choice([0x0301, 0x0300, 0x0308, 0x0303, 0x0327, 0x030A, 0x0323,
                                  0x0336, 0x20DD])) for _ in range(r.randint(1, 3)))
    return r.choice([base + marks, "é", "e\u0301", "Å", "A\u030a", "ñ", "n\u0303", "ﬁ", "Ω",
                     "\u212b", "가", "\u1100\u1161"])


def word(r):
    w = "".join(r.choice(SYLLABLES) for _ in range(r.randint(1, 4)))
    roll = r.random()
    if roll < 0.1:
        w = w.capitalize()
    elif roll < 0.13:
        w = w.upper()
    if r.random() < 0.08:
        w += r.choice(CONTRACTIONS)
    return w


def number(r):
    return r.choice([str(r.randint(0, 9)), str(r.randint(10, 99999)), str(r.randint(10**6, 10**12)),
                     "%.3f" % r.uniform(-1000, 1000), "1,234,567", "٣٤٥", "１２３", "½", "2²"])


def piece(r, family):
    kind = r.random()
    if kind < 0.45:
        return word(r) + r.choice([" ", " ", " ", ""] + PUNCT[:4])
    table = [(0.52, lambda: number(r) + " "), (0.58, lambda: rand_cjk(r)),
             (0.62, lambda: rand_script(r) + " "), (0.68, lambda: r.choice(EMOJI)),
             (0.73, lambda: combining(r)), (0.80, lambda: r.choice(SPACES)),
             (0.85, lambda: r.choice(PUNCT)), (0.90, lambda: r.choice(CODE)),
             (0.95, lambda: r.choice(SPECIALS[family] + SPECIALS["qwen3" if family == "llama3"
                                                                else "llama3"]))]
    for bound, make in table:
        if kind < bound:
            return make()
    return r.choice(["'s", " 's", "it's", "I'M", "don't", "   x", "\n\n\n", "a  b", "!!!?", "ﬀ"])


def sweep(out):
    skip = {0x85, 0xFEFF, 0x180E}
    docs, chunk = [], []
    for c in range(0x20, 0x30000):
        ch = chr(c)
        if c in skip or unicodedata.category(ch) in ("Cn", "Cs", "Co"):
            continue
        chunk.append("a" + ch + "1 " + ch + ch + "'s" + ch + "\n")
        if len(chunk) == 2000:
            docs.append("".join(chunk))
            chunk = []
    docs.append("".join(chunk))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(docs, f, ensure_ascii=False)


def main():
    if sys.argv[1] == "--sweep":
        return sweep(sys.argv[2])
    out = sys.argv[1]
    min_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 120_000
    r = random.Random(20261130)
    docs, total = [], 0
    while total < min_bytes:
        family = r.choice(["qwen3", "llama3"])
        d = "".join(piece(r, family) for _ in range(r.randint(5, 160)))
        docs.append(d)
        total += len(d.encode("utf-8"))
    # Long pre-tokens: BPE must stay O(n log n) in their length.
    docs += ["", " ", "a", "\n", "  \n\t ", "<|im_start|>", "<|im_start|><|im_end|>", "x" * 3000,
             " " * 700 + "z", "😀" * 50, "ab" * 10000, " " * 20000 + "z", "7" * 5000]
    with open(out, "w", encoding="utf-8") as f:
        json.dump(docs, f, ensure_ascii=False)


if __name__ == "__main__":
    main()

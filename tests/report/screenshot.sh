#!/usr/bin/env bash
# The report as a browser draws it: renders RESULTS.json with report_render,
# takes a screenshot with headless Chromium, and checks that a PNG came out
# that is not a blank page (its signature, its size in bytes, and the width
# and height in its IHDR chunk). Prints where the PNG is, to look at.
# Exit 77 (SKIPPED) when chromium is not installed (scripts/deps.sh has it).
#
# usage: screenshot.sh REPORT_RENDER RESULTS.json OUTDIR
set -u
render=$1 results=$2 out=$3

browser=""
for b in chromium chromium-browser google-chrome; do
    if command -v "$b" >/dev/null 2>&1; then browser=$b; break; fi
done
if [ -z "$browser" ]; then
    echo "SKIP: no chromium (apt-get install chromium, or scripts/deps.sh): no screenshot taken"
    exit 77
fi

rm -rf "$out"
mkdir -p "$out" || { echo "FAIL: cannot create $out"; exit 1; }
"$render" "$results" "$out" >/dev/null || { echo "FAIL: report_render failed"; exit 1; }
page=$(cd "$out" && pwd)/report.html
png=$(cd "$out" && pwd)/report.png

# A private profile and home: nothing of the user's is read or written.
export HOME="$out/home"
mkdir -p "$HOME"
timeout 90 "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --user-data-dir="$out/profile" --screenshot="$png" --window-size=1280,2400 \
    "file://$page" >"$out/chromium.log" 2>&1
rc=$?
if [ ! -s "$png" ]; then
    echo "FAIL: $browser wrote no screenshot (exit $rc); its output:"
    tail -n 20 "$out/chromium.log"
    exit 1
fi

/usr/bin/python3 - "$png" <<'PY'
import struct, sys
path = sys.argv[1]
data = open(path, "rb").read()
if data[:8] != b"\x89PNG\r\n\x1a\n":
    sys.exit("FAIL: %s is not a PNG" % path)
width, height = struct.unpack(">II", data[16:24])
# A blank 1280x2400 page compresses to a few kilobytes; charts, tables and
# text take far more.
if len(data) < 60000:
    sys.exit("FAIL: %s is %d bytes: a blank page?" % (path, len(data)))
if width < 1000 or height < 1000:
    sys.exit("FAIL: %s is %dx%d" % (path, width, height))
print("screenshot: %s (%dx%d, %d bytes)" % (path, width, height, len(data)))
PY

#!/usr/bin/python3
"""Checks a pdserve bench report.html with an XML parser (standard library only).

usage: report_check.py REPORT.html
       report_check.py --render REPORT_RENDER RESULTS.json DIR   (renders, then checks)
       report_check.py --cases DIR     (every DIR/*/report.html; at least one)

A report must parse as XML; carry the charts cdf-ttft, cdf-itl, cdf-e2e and
timeline, and a pools-<node>... chart per node; each chart either draws (a
polyline or path) or says "no data"; and it loads nothing (no script, no
external href or src). With --render, the results JSON is read too, and the
charts that have data must draw: a curve per CDF with values, the timeline
with intervals, a band per pool sampled.
"""
import glob
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"
XHTML = "{http://www.w3.org/1999/xhtml}"


def fail(msg):
    print("report_check: FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def local(tag):
    return tag.rsplit("}", 1)[-1]


def text_of(el):
    return "".join(el.itertext())


def charts(root):
    out = {}
    for el in root.iter(SVG + "svg"):
        cid = el.get("id")
        if not cid:
            fail("an svg without an id")
        if cid in out:
            fail("two charts with the id " + cid)
        out[cid] = el
    return out


def draws(svg):
    return any(local(e.tag) in ("polyline", "path") for e in svg.iter())


def check_page(path, results=None):
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        fail("%s does not parse as XML: %s" % (path, e))
    if root.tag != XHTML + "html":
        fail("%s: the root is %s, not XHTML's html" % (path, root.tag))
    for el in root.iter():
        name = local(el.tag)
        if name in ("script", "link", "img", "iframe", "object"):
            fail("%s: a <%s> element (the page must load nothing)" % (path, name))
        for attr in ("href", "src"):
            v = el.get(attr) or el.get("{http://www.w3.org/1999/xlink}" + attr)
            if v and not v.startswith("#"):
                fail("%s: an external %s=%r" % (path, attr, v))
    found = charts(root)
    for cid in ("cdf-ttft", "cdf-itl", "cdf-e2e", "timeline"):
        if cid not in found:
            fail("%s: no chart %s" % (path, cid))
    for cid, svg in found.items():
        nodata = "no data" in text_of(svg)
        if not nodata and not draws(svg):
            fail("%s: chart %s neither draws nor says no data" % (path, cid))
    if results is not None:
        check_against(path, found, results)
    return found


def check_against(path, found, r):
    pd = r["pdserve"]
    done = [q for q in pd["requests"] if q["outcome"] == "completed"]
    want = {
        "cdf-e2e": bool(done),
        "cdf-ttft": any(q.get("ttft_s") is not None for q in done),
        "cdf-itl": any(x for x in (r.get("itls") or []) if x),
        "timeline": bool((pd.get("timeline") or {}).get("t_s")),
    }
    for i, node in enumerate(pd.get("nodes") or []):
        names = []
        for s in node["samples"]:
            for p in s["pools"]:
                if p["name"] not in names:
                    names.append(p["name"])
        if not names:
            want["pools-%d" % i] = False
        for name in names:
            cid = "pools-%d-%s" % (i, "".join(c if c.isalnum() or c in "-_" else "_" for c in name))
            want[cid] = True
            if cid in found and not any(
                    (e.get("class") or "") == "band-req" for e in found[cid].iter()):
                fail("%s: chart %s has no band for the units held by requests" % (path, cid))
    for cid, has_data in want.items():
        if cid not in found:
            fail("%s: no chart %s" % (path, cid))
        if has_data and not draws(found[cid]):
            fail("%s: chart %s has data but draws no line nor area" % (path, cid))
        if has_data and "no data" in text_of(found[cid]):
            fail("%s: chart %s has data but says no data" % (path, cid))
    print("report_check: %s: %d charts, %d with data" % (path, len(found),
                                                         sum(1 for v in want.values() if v)))


def main(argv):
    if len(argv) == 5 and argv[1] == "--render":
        render, results, out = argv[2:5]
        proc = subprocess.run([render, results, out], capture_output=True, text=True)
        if proc.returncode != 0:
            fail("%s %s %s: exit %d: %s" % (render, results, out, proc.returncode, proc.stderr))
        with open(results, encoding="utf-8") as f:
            check_page(os.path.join(out, "report.html"), json.load(f))
    elif len(argv) == 3 and argv[1] == "--cases":
        pages = sorted(glob.glob(os.path.join(argv[2], "*", "report.html")))
        if not pages:
            fail("no report.html under %s" % argv[2])
        for page in pages:
            found = check_page(page)
            print("report_check: %s: %d charts, well-formed" % (page, len(found)))
    elif len(argv) == 2:
        check_page(argv[1])
        print("report_check: %s: well-formed" % argv[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

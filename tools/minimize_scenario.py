#!/usr/bin/env python3
"""Shrinks a failing scenario file while `pdserve sim --scenario` still fails
with the same kind of message (delta debugging over lines; 'step N' lines are
also shortened). Usage: minimize_scenario.py PDSERVE IN OUT 'needle'"""
import subprocess, sys

pdserve, src, dst, needle = sys.argv[1:5]
lines = [l for l in open(src).read().splitlines() if l.strip() and not l.startswith('#')]
head, body = lines[0], lines[1:]

def fails(body):
    text = '\n'.join([head] + body) + '\n'
    open(dst, 'w').write(text)
    r = subprocess.run([pdserve, 'sim', '--scenario', dst], capture_output=True, text=True)
    return r.returncode != 0 and needle in (r.stdout + r.stderr)

assert fails(body), 'the input does not fail'
n = 2
while len(body) >= 2:
    chunk = max(1, len(body) // n)
    reduced = False
    for i in range(0, len(body), chunk):
        cand = body[:i] + body[i + chunk:]
        if cand and fails(cand):
            body, n, reduced = cand, max(n - 1, 2), True
            break
    if not reduced:
        if chunk == 1:
            break
        n = min(len(body), n * 2)
# Shorten step counts.
for i, l in enumerate(body):
    if l.startswith('step '):
        k = int(l.split()[1])
        while k > 1:
            cand = body[:i] + ['step %d' % (k // 2)] + body[i + 1:]
            if fails(cand):
                body, k = cand, k // 2
            else:
                break
fails(body)
print('\n'.join([head] + body))

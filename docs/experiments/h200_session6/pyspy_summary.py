#!/usr/bin/env python3
"""Summarise a py-spy raw (collapsed) profile: the main thread's share in our code, by innermost frame.

    python3 docs/experiments/h200_session6/pyspy_summary.py docs/experiments/h200_session6/callC/pyspy_nvfp4.txt.gz
"""
import collections
import gzip
import re
import sys

path = sys.argv[1]
opener = gzip.open if path.endswith(".gz") else open
total = main = 0
incl: collections.Counter = collections.Counter()
ours: collections.Counter = collections.Counter()
with opener(path, "rt") as f:
    for line in f:
        line = line.rstrip()
        if not line:
            continue
        stack, n = line.rsplit(" ", 1)
        n = int(n)
        total += n
        frames = stack.split(";")
        if not any("bench_case" in fr for fr in frames):
            continue  # other threads (compile workers, tqdm monitor): idle waits
        main += n
        for fr in set(re.sub(r":\d+\)$", ")", fr) for fr in frames):
            incl[fr] += n
        mine = [fr for fr in frames if "nvfp4_train/" in fr or "kernels/" in fr]
        if mine:
            ours[mine[-1]] += n
print(f"samples: {total}, main thread: {main}")
print("\n## main thread, inclusive (function)")
for fr, n in incl.most_common(40):
    print(f"{100 * n / main:5.1f}%  {fr[:150]}")
print("\n## main thread, innermost frame in nvfp4_train/ or kernels/ (file:line)")
for fr, n in ours.most_common(25):
    print(f"{100 * n / main:5.1f}%  {fr[:150]}")

#!/usr/bin/env python3
"""Reads a callgrind dump (bench/callgrind.sh): prints one Markdown row, `| NAME | REQUESTS |
instructions per request |`, and writes the TOP functions by their own instructions per
request to TOPFILE. Usage: callgrind_per_request.py DUMP REQUESTS NAME TOP TOPFILE
"""
import collections
import re
import sys

dump, requests, name, top, topfile = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]

own = collections.Counter()
names = {}
current = None
after_call = False
for line in open(dump, errors="replace"):
    line = line.rstrip("\n")
    # fn=(id) name defines a function (the name only the first time); cfn= names a callee.
    match = re.match(r"^(c?)fn=\((\d+)\)(?: (.*))?$", line)
    if match:
        if match.group(3):
            names[match.group(2)] = match.group(3)
        if not match.group(1):
            current = names.get(match.group(2), match.group(2))
        continue
    if line.startswith("calls="):
        # The next cost line is the call's inclusive cost, not the caller's own.
        after_call = True
        continue
    if re.match(r"^[+\-*]?\d*\s*\d+$", line) and current is not None:
        if after_call:
            after_call = False
            continue
        own[current] += int(line.split()[-1])

total = sum(own.values())
per_request = total // max(requests, 1)
print(f"| {name} | {requests} | {per_request:,} |")
with open(topfile, "w") as out:
    out.write(f"{name}: functions with the most instructions of their own per request\n\n")
    for function, cost in own.most_common(top):
        out.write(f"    {cost // max(requests, 1):>9,}  {function[:100]}\n")
    out.write("\n")

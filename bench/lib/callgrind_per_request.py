#!/usr/bin/env python3
"""Reads a callgrind dump (bench/callgrind.sh): prints one Markdown row, `| NAME | REQUESTS |
instructions per request |`, followed, when the dump also counted the simulated caches
(`--cache-sim=yes`), by the first-level misses per request: instruction fetches, data reads,
data writes. Writes the TOP functions by their own instructions per request (and, with the
caches, their own data misses) to TOPFILE.
Usage: callgrind_per_request.py DUMP REQUESTS NAME TOP TOPFILE
"""
import collections
import re
import sys

dump, requests, name, top, topfile = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
requests = max(requests, 1)

events = ["Ir"]
own = collections.defaultdict(lambda: [0] * len(events))
names = {}
current = None
after_call = False
for line in open(dump, errors="replace"):
    line = line.rstrip("\n")
    if line.startswith("events:"):
        events = line.split()[1:]
        continue
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
    # A cost line: a position (absolute, relative or `*`), then one count per event, trailing
    # zeros left out.
    if re.match(r"^[+\-*]?\d*(\s+\d+)+$", line) and current is not None:
        if after_call:
            after_call = False
            continue
        costs = own[current]
        for index, count in enumerate(line.split()[1:]):
            costs[index] += int(count)


def total(event):
    if event not in events:
        return None
    index = events.index(event)
    return sum(costs[index] for costs in own.values())


misses = ["I1mr", "D1mr", "D1mw"]
row = f"| {name} | {requests} | {total('Ir') // requests:,} |"
if all(event in events for event in misses):
    row += "".join(f" {total(event) / requests:,.0f} |" for event in misses)
print(row)

instructions = events.index("Ir")
data_misses = [events.index(event) for event in ("D1mr", "D1mw") if event in events]
with open(topfile, "w") as out:
    out.write(f"{name}: functions with the most instructions of their own per request")
    out.write(" (and their own first-level data misses)\n\n" if data_misses else "\n\n")
    ranked = sorted(own.items(), key=lambda item: -item[1][instructions])[:top]
    for function, costs in ranked:
        count = f"{costs[instructions] // requests:>9,}"
        if data_misses:
            count += f" {sum(costs[index] for index in data_misses) / requests:>7,.1f}"
        out.write(f"    {count}  {function[:100]}\n")
    out.write("\n")

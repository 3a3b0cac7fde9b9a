#!/usr/bin/env python3
"""Print N distinct free TCP ports on 127.0.0.1, one per line.

Ports are drawn below the kernel's ephemeral range, so no client socket of the benchmark
(wrk, curl, the proxies' upstream connections) can be holding one when a server binds it,
and never from the well-known range. Each port is checked by binding it.
"""
import random
import socket
import sys

count = int(sys.argv[1])
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
except OSError:
    ephemeral_low = 32768
low, high = 20000, max(20000 + 10 * count, ephemeral_low - 1)

chosen = []
for port in random.sample(range(low, high), high - low):
    if len(chosen) == count:
        break
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    chosen.append(port)
if len(chosen) < count:
    sys.exit(f"free_ports.py: found only {len(chosen)} of {count} free ports")
print("\n".join(map(str, chosen)))

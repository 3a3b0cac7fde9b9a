#!/usr/bin/env python3
"""Write the benchmark's HTML page: SIZE bytes (default 50 KiB) that look like a legacy PHP
site's page, with a <div id="ranking">...</div> module in the middle (what the `hide` case
removes). Usage: make_page.py OUT [SIZE]
"""
import sys

out = sys.argv[1]
size = int(sys.argv[2]) if len(sys.argv) > 2 else 50 * 1024

head = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Example community site</title>
<link rel="stylesheet" href="/css/site.css">
<script src="/js/site.js"></script>
</head>
<body>
<div id="header"><a href="/">Example</a> | <a href="/forum.php">Forum</a> | <a href="/login.php">Log in</a></div>
<div id="content">
"""
tail = """</div>
<div id="footer">Example community site. Powered by PHP.</div>
</body>
</html>
"""


def article(i):
    return (
        f'<div class="post" id="post-{i}">\n'
        f'<h3><a href="/post.php?id={i}">Post number {i}</a></h3>\n'
        f"<p>Posted by member{i % 97} in <a href=\"/forum.php?board={i % 7}\">board {i % 7}</a>. "
        "This paragraph stands in for user content rendered by the legacy templates, with "
        "enough text that the page weighs as much as a real one.</p>\n</div>\n"
    )


rows = "".join(
    f'<tr><td>{rank}</td><td><a href="/member.php?id={rank * 13}">member{rank * 13}</a></td>'
    f"<td>{10000 - rank * 97}</td></tr>\n"
    for rank in range(1, 31)
)
ranking = (
    '<div id="ranking">\n<h2>Top members this week</h2>\n'
    '<table class="ranking">\n<tr><th>#</th><th>Member</th><th>Points</th></tr>\n'
    + rows
    + "</table>\n</div>\n"
)

parts = [head] + [article(i) for i in range(1, 11)] + [ranking]
i = 11
while sum(len(p) for p in parts) + len(article(i)) + len(tail) + 8 < size:
    parts.append(article(i))
    i += 1
body = "".join(parts)
pad = size - len(body) - len(tail)  # filled with a comment of exactly `pad` bytes
if pad < 8:
    sys.exit("make_page.py: SIZE too small")
body += "<!--" + "." * (pad - 8) + "-->\n"
with open(out, "w", encoding="ascii") as f:
    f.write(body + tail)

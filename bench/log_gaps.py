"""Longest silence in a command's output: the time between two consecutive output events.

An event is a line or a progress-bar redraw (tqdm ends a redraw with a carriage return), on
stdout or stderr. A serious tool never leaves its user staring at a still terminal for more
than a few seconds; this script checks that figure for any command, e.g. the default run:

    python bench/log_gaps.py --max-gap 10 -- drafttrain train recipe=eagle train.max_minutes=1

It prints the command's own output (prefixed with the elapsed seconds), then the longest gaps
with the event that ended each, and exits 1 when the longest exceeds --max-gap (or the command's
own code when it fails). Not a test: it runs whole commands, minutes long.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="python bench/log_gaps.py [--max-gap S] [--top N] -- COMMAND ...")
    ap.add_argument("--max-gap", type=float, default=10.0, help="seconds of silence allowed (default 10)")
    ap.add_argument("--top", type=int, default=5, help="how many of the longest gaps to list")
    ap.add_argument("--quiet", action="store_true", help="do not echo the command's output")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command to watch after --")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, bufsize=0)
    events: list[tuple[float, str]] = []
    buf = b""
    last = t0
    gaps: list[tuple[float, float, str]] = []  # (gap, at, event text)
    while True:
        chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(1)
        if not chunk:
            break
        buf += chunk
        while True:
            cut = min((i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0), default=-1)
            if cut < 0:
                break
            text = buf[:cut].decode("utf-8", "replace").strip()
            buf = buf[cut + 1:]
            if not text:
                continue
            now = time.monotonic()
            gaps.append((now - last, now - t0, text))
            last = now
            events.append((now - t0, text))
            if not args.quiet:
                print(f"[{now - t0:7.1f}s] {text}", flush=True)
    code = proc.wait()
    end = time.monotonic()
    gaps.append((end - last, end - t0, "<exit>"))
    gaps.sort(reverse=True)
    print(f"\n{len(events)} output events in {end - t0:.1f} s; command exit code {code}")
    for gap, at, text in gaps[: args.top]:
        print(f"  {gap:6.1f} s of silence before t={at:7.1f}s: {text[:100]}")
    longest = gaps[0][0] if gaps else 0.0
    verdict = "OK" if longest <= args.max_gap else "TOO LONG"
    print(f"longest gap {longest:.1f} s (limit {args.max_gap:g} s): {verdict}")
    if code != 0:
        return code
    return 0 if longest <= args.max_gap else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where each thread of a process spends its time, from ``py-spy record --threads --idle -f raw``.

Usage::

    py-spy record --pid PID --threads --idle -r 200 -f raw -o stacks.txt
    python benchmarks/spy_threads.py stacks.txt [--rate 200] [--top 12] [--thread NAME]

Threads are grouped by name without their trailing numbers (``jpeg-decode_3`` and
``jpeg-decode_5`` are one group). For each group it prints its sampled seconds and, under them,
the seconds per call site: the deepest frame of this project in the stack and the stack's leaf
(the call it was in, or waiting on), largest first.
"""

from __future__ import annotations

import argparse
import collections
import re

THREAD = re.compile(r"thread \(\d+\): ?(.*)")


def group(name: str) -> str:
    return re.sub(r"[-_]?\d+$", "", name) or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stacks")
    ap.add_argument("--rate", type=float, default=200.0, help="py-spy's samples a second (-r)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--thread", help="only thread groups whose name holds this")
    args = ap.parse_args()
    totals: collections.Counter[str] = collections.Counter()
    sites: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(args.stacks) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            thread = next((m for fr in frames if (m := THREAD.match(fr))), None)
            name = group(thread.group(1)) if thread else "?"
            if args.thread and args.thread not in name:
                continue
            n = int(count)
            totals[name] += n
            own = [fr for fr in frames if "wsi_pipeline/" in fr or "benchmarks/" in fr]
            site = own[-1].split(" (")[0] if own else "-"
            leaf = frames[-1].split(" (")[0]
            sites[name][site if leaf == site else f"{site} > {leaf}"] += n
    for name, n in totals.most_common():
        print(f"{name}: {n / args.rate:.2f} s")
        for site, k in sites[name].most_common(args.top):
            print(f"    {k / args.rate:7.2f} s  {site}")


if __name__ == "__main__":
    main()

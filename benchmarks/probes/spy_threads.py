"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 23:0x–23:4x UTC: the heatmap's rows handed over without
waiting for the device".

Where each thread of a process spends its time, from ``py-spy record --threads --idle -f raw``.

Usage::

    py-spy record --pid PID --threads --idle -r 200 -f raw -o stacks.txt
    python benchmarks/probes/spy_threads.py stacks.txt [--rate 200] [--top 12] [--thread NAME]

With ``py-spy record --subprocesses``, each group's name begins with its process's module or
script. Threads are grouped by name without their trailing numbers (``jpeg-decode_3`` and
``jpeg-decode_5`` are one group). For each group it prints its sampled seconds and, under them,
the seconds per call site: the deepest frame of this project in the stack and the stack's leaf
(the call it was in, or waiting on), largest first.
"""

from __future__ import annotations

import argparse
import collections
import re

THREAD = re.compile(r"thread \(\d+\): ?(.*)")
# The root frame py-spy adds with --subprocesses (a command line with ";" in it spans frames).
PROCESS = re.compile(r'process \d+:"([^"]*)')


def group(name: str) -> str:
    return re.sub(r"[-_]?\d+$", "", name) or "?"


def _short(cmdline: str) -> str:
    """A process's command line, short: its module or script and its first argument."""
    words = cmdline.split()
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    if "-c" in words[:-1]:  # multiprocessing's children: "-c from multiprocessing.spawn import ..."
        return next((w for w in words if w.startswith("multiprocessing.")), "-c")
    return next((w.rsplit("/", 1)[-1] for w in words[1:] if w.endswith(".py")), words[0] if words else "?")


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
            if not count.isdigit():  # a command line with a newline in it
                continue
            frames = stack.split(";")
            thread = next((m for fr in frames if (m := THREAD.match(fr))), None)
            name = group(thread.group(1)) if thread else "?"
            processes = [m for fr in frames[:8] if (m := PROCESS.match(fr))]
            if processes:  # the innermost: a child's frames follow its parents'
                name = f"{_short(processes[-1].group(1))}: {name}"
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

"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 20:5x–21:4x UTC: the heatmap file written by a writer
process, job arrays through files".

CPU use of a command and every process it starts, sampled while it runs.

Usage: ``python benchmarks/probes/sample_cpu.py [--json FILE] -- COMMAND ARGS...`` (Linux: reads ``/proc``).

Every 50 ms it reads the machine's busy time (``/proc/stat``), every 200 ms each process's CPU
seconds (``/proc/PID/stat``). Prints the mean number of busy cores over the command's life and the
CPU seconds of each process that used any (with its parent and command line), largest first; a
process that ended between two samples is counted up to its last sample.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU jiffies used, user + system)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        out[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the busy-cores timeline and the processes here")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    before = processes()
    t0 = time.perf_counter()
    proc = subprocess.Popen(command)
    timeline: list[tuple[float, float]] = []
    names: dict[int, tuple[int, str]] = {}
    used: dict[int, int] = {}
    last = machine_busy()
    k = 0
    while proc.poll() is None:
        time.sleep(0.05)
        now = machine_busy()
        timeline.append((time.perf_counter() - t0, (now[0] - last[0]) / max(1, now[1] - last[1]) * os.cpu_count()))
        last = now
        k += 1
        if k % 4 == 0:
            for pid, (ppid, cpu) in processes().items():
                if pid not in names:
                    names[pid] = (ppid, command_line(pid))
                used[pid] = cpu - before.get(pid, (0, 0))[1]
    seconds = time.perf_counter() - t0
    rows = sorted(((c / HZ, pid, *names[pid]) for pid, c in used.items() if c > 0), reverse=True)
    mean = sum(b for _, b in timeline) / max(1, len(timeline))
    print(f"{seconds:.2f} s, exit code {proc.returncode}; busy cores: mean {mean:.2f} of {os.cpu_count()}")
    for cpu, pid, ppid, name in rows:
        print(f"  {cpu:7.2f} CPU s  pid {pid} (parent {ppid})  {name[:120]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "timeline": timeline, "processes": rows}, f)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

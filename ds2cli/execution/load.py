"""How many of this process's cores other programs leave it, measured as it runs.

A helper process or pool thread on a core that another program also wants gets a share of
that core's time slices, and work handed to it waits for the kernel to schedule it: on a
machine doing other things, one core used well beats two used in turns. So the cores a pass
uses follow the cores that are free, read from the kernel's own accounting: the busy time of
the CPUs this process may run on (/proc/stat) minus this process's and its helpers' own CPU
time (/proc/PID/stat), over the last INTERVAL seconds at least. `--threads N` stays the upper
bound (Machine's `threads`); where /proc is not there, every allowed core counts as free.

Niced programs' time counts as free (while this process is not niced itself): the kernel gives a
nice 10 job about a tenth of a core that a nice 0 thread also wants, and nice 19 about 1/70, so
a pass that takes the core is slowed by little, and a batch job (`nice make -j`) would otherwise
hold ds2 at one core for nothing.
"""

from __future__ import annotations

import functools
import os
import time

INTERVAL = 0.1       # seconds between two readings: the kernel counts CPU time in ticks (10 ms
                     # on most Linux systems), so a shorter window reads mostly rounding
SMOOTHING = 0.5      # weight of the newest reading in the running estimate
ROUND_UP = 0.3       # a core counts as free once other programs leave it 70% of its time


class Load:
    """The CPU time other programs take on this process's CPUs, as a number of cores."""

    def __init__(self, cpus: set[int] | None = None, clock=time.perf_counter, busy=None, ticks=None,
                 tick: int | None = None, running=None):
        """`clock`, `busy(cpus)`, `ticks(pids)`, `tick` (ticks a second) and `running()` read the
        time and the kernel's accounting (/proc, sysconf): given, they replace it (a test's script)."""
        self.cpus = cpus if cpus is not None else allowed_cpus()
        self.clock, self.ticks, self.running = clock, ticks or process_ticks, running or procs_running
        self.busy = busy or functools.partial(cpus_busy, niced=niced_busy())
        self.tick = tick or (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        self.others: float | None = None      # cores other programs keep busy (smoothed)
        self.last: tuple[float, int, int] | None = None     # (time, CPUs' busy ticks, ours)
        self.read(self.clock(), ())          # the first window starts now (the model loads meanwhile)

    def free(self, most: int, own_pids=()) -> int:
        """How many cores to use now: at least 1, at most `most`, one for each allowed core that
        other programs leave free; re-read at most every INTERVAL seconds."""
        now = self.clock()
        if self.last is None or now - self.last[0] >= INTERVAL:
            self.read(now, own_pids)
        others = self.others
        if others is None:
            # before the first window has passed (a small model's first steps take less): the
            # tasks runnable right now but this thread; one sample, read until a window has passed
            running = self.running()
            if running is None:
                return most
            others = max(0, running - 1)
        return max(1, min(most, int(len(self.cpus) - others + ROUND_UP)))

    def read(self, now: float, own_pids) -> None:
        busy, ours = self.busy(self.cpus), self.ticks([0, *own_pids])
        if busy is None or ours is None:
            return
        if self.last is not None:
            seconds = now - self.last[0]
            others = max(0.0, (busy - self.last[1]) - (ours - self.last[2])) / self.tick / seconds
            self.others = others if self.others is None else SMOOTHING * others + (1 - SMOOTHING) * self.others
        self.last = (now, busy, ours)


def allowed_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def niced_busy() -> bool:
    """Whether niced programs' time counts as busy: when this process is niced itself (they then
    compete with it as equals, or above it)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0) > 0
    except (AttributeError, OSError):
        return True


def cpus_busy(cpus: set[int], niced: bool = True) -> int | None:
    """Ticks the given CPUs have spent on anything but idling (iowait counts as idle), since boot;
    without `niced`, niced programs' user time counts as idle too."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *ticks = line.split()
            if int(name[3:]) in cpus:
                values = [int(t) for t in ticks[:8]]          # user nice system idle iowait irq softirq steal
                total += sum(values) - values[3] - values[4] - (0 if niced else values[1])
    return total


def procs_running() -> int | None:
    """The tasks runnable on the machine at this instant, this one included (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def process_ticks(pids) -> int | None:
    """User and system ticks of each process (0: this one, all its threads), summed; a process
    that has ended counts nothing."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid or 'self'}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            if pid == 0:
                return None
            continue
        total += int(fields[11]) + int(fields[12])            # utime, stime (fields 14 and 15)
    return total

"""How many CPUs this process may use: the smaller of its CPU affinity and its cgroup CPU quota.

Kubernetes CPU limits and `docker --cpus` set a CFS quota, not an affinity: the
process sees every core but gets only `quota / period` CPU-seconds per second.
Both cgroup versions are read, from the files of the process's own cgroup and
of its ancestors visible in the mount (a parent's quota limits its children too):
- v2: `cpu.max` = "<quota> <period>" or "max <period>";
- v1: `cpu.cfs_quota_us` (-1 = unlimited) and `cpu.cfs_period_us` of the cpu controller.
The process's cgroup comes from /proc/self/cgroup, the mounts from /proc/self/mountinfo
(a container may see its own cgroup mounted as the root of the hierarchy).
`root` lets tests point every path at a fake file tree.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuBudget:
    cpus: float  # min(affinity, quota), or a share of it (shared_by)
    affinity: int  # CPUs the process may be scheduled on
    quota: float | None  # CPUs allowed by the cgroup quota; None = no quota

    def shared_by(self, processes: int) -> CpuBudget:
        """One process's share when `processes` processes (e.g. frontend workers) split this budget."""
        return self if processes <= 1 else dataclasses.replace(self, cpus=self.cpus / processes)


def native_io_threads(budget: CpuBudget, override: int = 0) -> int:
    """pygrpc-native's Rust I/O threads: they share the budget with the one Python loop, which limits a worker
    long before one I/O thread does. A second thread only adds hand-offs (5-14 % more CPU per token on 2 cores,
    docs/benchmarks.md, "CPU budget"). So one thread below 4 CPUs, two from 4."""
    if override > 0:
        return override
    return 1 if budget.cpus < 4 else 2


def cpu_budget(root: str = "/", affinity: int | None = None) -> CpuBudget:
    if affinity is None:
        affinity = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root)
    return CpuBudget(cpus=affinity if quota is None else min(float(affinity), quota), affinity=affinity, quota=quota)


def cgroup_cpu_quota(root: str = "/") -> float | None:
    """The tightest CPU quota over the process's cgroups (v1 and v2) and their ancestors, in CPUs; None = none."""
    try:
        memberships = _read(os.path.join(root, "proc/self/cgroup")).splitlines()
        mounts = cgroup_mounts(_read(os.path.join(root, "proc/self/mountinfo")))
    except OSError:
        return None
    quotas = []
    for line in memberships:
        hierarchy_id, controllers, path = line.split(":", 2)
        if hierarchy_id == "0" and controllers == "":
            candidates = [(mount_root, point) for fstype, _, mount_root, point in mounts if fstype == "cgroup2"]
            read_quota = _v2_quota
        elif "cpu" in controllers.split(","):
            candidates = [
                (mount_root, point)
                for fstype, options, mount_root, point in mounts
                if fstype == "cgroup" and "cpu" in options
            ]
            read_quota = _v1_quota
        else:
            continue
        for mount_root, point in candidates:
            for directory in _cgroup_dirs(os.path.join(root, point.lstrip("/")), mount_root, path):
                quota = read_quota(directory)
                if quota is not None:
                    quotas.append(quota)
    return min(quotas) if quotas else None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cgroup_mounts(mountinfo: str) -> list[tuple[str, set[str], str, str]]:
    """(fstype, super options, root inside the hierarchy, mount point) of every cgroup mount."""
    mounts = []
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        if not sep:
            continue
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mounts.append((tail[0], set(tail[2].split(",")), _unescape(fields[3]), _unescape(fields[4])))
    return mounts


def _cgroup_dirs(mount_point: str, mount_root: str, cgroup_path: str) -> list[str]:
    """The directories of the cgroup and of its ancestors down to the mount point; [] when the cgroup is not
    inside this mount (then the mount does not show it)."""
    relative = os.path.relpath(cgroup_path, mount_root)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return []
    parts = [] if relative == os.curdir else relative.split(os.sep)
    return [os.path.join(mount_point, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def _v2_quota(directory: str) -> float | None:
    try:
        quota, period = _read(os.path.join(directory, "cpu.max")).split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else _ratio(quota, period)


def _v1_quota(directory: str) -> float | None:
    try:
        quota = _read(os.path.join(directory, "cpu.cfs_quota_us")).strip()
        period = _read(os.path.join(directory, "cpu.cfs_period_us")).strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        value = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return value if value > 0 and math.isfinite(value) else None

"""A real cgroup with a CPU quota (how `docker --cpus` and Kubernetes limits work); needs root.

Used by the benchmark's `quota` and `budget` placements and by the integration tests of the CPU budget.
`throttling()` reads the quota's accounting (`cpu.stat`): periods, throttled periods and throttled time.
"""

from __future__ import annotations

import os
import time

from openengine_serve.common.cpu_budget import cgroup_mounts


class CgroupUnavailable(RuntimeError):
    pass


class QuotaCgroup:
    """A fresh cgroup limited to `cpus` CPUs: the v1 cpu controller's cfs quota, else cgroup v2 `cpu.max`.
    Every core stays visible (no cpuset). `close()` moves anything left to the parent and removes it."""

    PERIOD_US = 100_000

    def __init__(self, cpus: float, name: str = "") -> None:
        self.cpus = cpus
        self.name = name or f"openengine-test-{os.getpid()}-{time.monotonic_ns()}"
        self.path = ""

    def create(self) -> QuotaCgroup:
        if os.geteuid() != 0:
            raise CgroupUnavailable("creating a cgroup needs root")
        with open("/proc/self/mountinfo") as f:
            mounts = cgroup_mounts(f.read())
        quota = str(round(self.cpus * self.PERIOD_US))
        v1 = [point for fstype, options, _, point in mounts if fstype == "cgroup" and "cpu" in options]
        v2 = [
            point
            for fstype, _, _, point in mounts
            if fstype == "cgroup2" and "cpu" in _read(os.path.join(point, "cgroup.controllers")).split()
        ]
        try:
            if v1:
                self.path = os.path.join(v1[0], self.name)
                os.mkdir(self.path)
                _write(os.path.join(self.path, "cpu.cfs_period_us"), str(self.PERIOD_US))
                _write(os.path.join(self.path, "cpu.cfs_quota_us"), quota)
            elif v2:
                if "cpu" not in _read(os.path.join(v2[0], "cgroup.subtree_control")).split():
                    _write(os.path.join(v2[0], "cgroup.subtree_control"), "+cpu")
                self.path = os.path.join(v2[0], self.name)
                os.mkdir(self.path)
                _write(os.path.join(self.path, "cpu.max"), f"{quota} {self.PERIOD_US}")
            else:
                raise CgroupUnavailable("no cgroup v1 cpu controller and no cgroup v2 mount with the cpu controller")
        except OSError as exc:
            self.close()
            raise CgroupUnavailable(f"cannot create a CPU-quota cgroup: {exc}") from exc
        return self

    def enter(self) -> None:
        """Moves the calling process in (a `preexec_fn`: the child starts inside the cgroup)."""
        self.add(os.getpid())

    def add(self, pid: int) -> None:
        """Moves a running process in, with all its threads."""
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def throttling(self) -> dict[str, float]:
        """Cumulative CFS accounting of the cgroup: periods, throttled periods, throttled seconds (v1 reports
        `throttled_time` in ns, v2 `throttled_usec`); {} when the cgroup has no cpu.stat."""
        stat = {}
        for line in _read(os.path.join(self.path, "cpu.stat")).splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                stat[key] = int(value)
        if "nr_periods" not in stat:
            return {}
        throttled_s = stat["throttled_usec"] / 1e6 if "throttled_usec" in stat else stat.get("throttled_time", 0) / 1e9
        return {
            "periods": float(stat["nr_periods"]),
            "throttled_periods": float(stat.get("nr_throttled", 0)),
            "throttled_s": throttled_s,
        }

    def close(self) -> None:
        if not self.path or not os.path.isdir(self.path):
            return
        parent_procs = os.path.join(os.path.dirname(self.path), "cgroup.procs")
        for pid in _read(os.path.join(self.path, "cgroup.procs")).split():
            try:
                _write(parent_procs, pid)
            except OSError:
                pass  # it ended meanwhile
        for attempt in range(50):  # a process that just ended may hold it for a moment
            try:
                os.rmdir(self.path)
                break
            except OSError:
                if attempt == 49:
                    raise
                time.sleep(0.1)
        self.path = ""

    def __enter__(self) -> QuotaCgroup:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.close()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)

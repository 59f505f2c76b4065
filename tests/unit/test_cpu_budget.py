"""CPU budget from fake /proc and cgroup file trees (v1, v2, containers, nested limits)."""

from __future__ import annotations

from pathlib import Path

import pytest

from openengine_serve.common.cpu_budget import CpuBudget, cgroup_cpu_quota, cpu_budget, native_io_threads

V1_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
"""
V2_MOUNTINFO = "29 23 0:26 {root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def tree(tmp_path: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def v2(tmp_path, cgroup: str, limits: dict[str, str], mount_root: str = "/") -> str:
    files = {"proc/self/cgroup": f"0::{cgroup}\n", "proc/self/mountinfo": V2_MOUNTINFO.format(root=mount_root)}
    files.update({f"sys/fs/cgroup/{d}/cpu.max".replace("//", "/"): v for d, v in limits.items()})
    return tree(tmp_path, files)


def v1(tmp_path, cgroup: str, limits: dict[str, tuple[str, str]], mount_root: str = "/") -> str:
    files = {
        "proc/self/cgroup": f"4:memory:/other\n2:cpu,cpuacct:{cgroup}\n0::/\n",
        "proc/self/mountinfo": V1_MOUNTINFO.format(root=mount_root),
    }
    for d, (quota, period) in limits.items():
        base = f"sys/fs/cgroup/cpu,cpuacct/{d}".rstrip("/")
        files[f"{base}/cpu.cfs_quota_us"] = quota + "\n"
        files[f"{base}/cpu.cfs_period_us"] = period + "\n"
    return tree(tmp_path, files)


def test_v2_fractional_quota(tmp_path):
    root = v2(tmp_path, "/kubepods/pod1/c1", {"kubepods/pod1/c1": "150000 100000\n"})
    assert cgroup_cpu_quota(root) == 1.5
    assert cpu_budget(root, affinity=8) == CpuBudget(cpus=1.5, affinity=8, quota=1.5)


def test_v2_unlimited_is_no_quota(tmp_path):
    root = v2(tmp_path, "/user.slice/session", {"user.slice/session": "max 100000\n", "user.slice": "max 100000\n"})
    assert cgroup_cpu_quota(root) is None
    assert cpu_budget(root, affinity=4) == CpuBudget(cpus=4, affinity=4, quota=None)


def test_v2_parent_limit_applies_to_an_unlimited_child(tmp_path):
    root = v2(tmp_path, "/a/b/c", {"a/b/c": "max 100000", "a/b": "max 100000", "a": "50000 100000"})
    assert cgroup_cpu_quota(root) == 0.5


def test_v2_tightest_of_nested_limits(tmp_path):
    root = v2(tmp_path, "/a/b", {"a/b": "300000 100000", "a": "200000 100000"})
    assert cgroup_cpu_quota(root) == 2.0


def test_v2_container_sees_its_cgroup_as_the_mount_root(tmp_path):
    # cgroup namespace: /proc/self/cgroup says "/", the mount's root is the container's cgroup
    root = v2(tmp_path, "/", {"": "100000 100000"})
    assert cpu_budget(root, affinity=2).cpus == 1.0


def test_v2_without_cgroupns_the_mount_root_is_stripped(tmp_path):
    root = v2(tmp_path, "/docker/abc", {"": "25000 100000"}, mount_root="/docker/abc")
    assert cgroup_cpu_quota(root) == 0.25


def test_v1_quota(tmp_path):
    root = v1(
        tmp_path, "/docker/abc", {"docker/abc": ("100000", "100000"), "docker": ("-1", "100000"), "": ("-1", "100000")}
    )
    assert cgroup_cpu_quota(root) == 1.0
    assert cpu_budget(root, affinity=2) == CpuBudget(cpus=1.0, affinity=2, quota=1.0)


def test_v1_unlimited(tmp_path):
    root = v1(tmp_path, "/", {"": ("-1", "100000")})
    assert cgroup_cpu_quota(root) is None


def test_v1_fractional_and_nested(tmp_path):
    root = v1(tmp_path, "/k/pod/c", {"k/pod/c": ("-1", "100000"), "k/pod": ("75000", "50000"), "k": ("-1", "1")})
    assert cgroup_cpu_quota(root) == 1.5


def test_v1_container_mount_root(tmp_path):
    root = v1(tmp_path, "/docker/abc", {"": ("50000", "100000")}, mount_root="/docker/abc")
    assert cgroup_cpu_quota(root) == 0.5


def test_quota_above_affinity_leaves_affinity(tmp_path):
    root = v2(tmp_path, "/", {"": "400000 100000"})
    assert cpu_budget(root, affinity=2) == CpuBudget(cpus=2, affinity=2, quota=4.0)


def test_hybrid_v1_cpu_and_v2_without_cpu_max(tmp_path):
    root = v1(tmp_path, "/x", {"x": ("200000", "100000")})
    (tmp_path / "proc/self/mountinfo").write_text(
        V1_MOUNTINFO.format(root="/") + "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    assert cgroup_cpu_quota(root) == 2.0


def test_escaped_mount_point(tmp_path):
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/g\n",
            "proc/self/mountinfo": "29 23 0:26 / /cg\\040root rw - cgroup2 cgroup2 rw\n",
            "cg root/g/cpu.max": "200000 100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == 2.0


def test_cgroup_outside_the_mount_is_not_read(tmp_path):
    root = v2(tmp_path, "/elsewhere", {"": "100000 100000"}, mount_root="/docker/abc")
    assert cgroup_cpu_quota(root) is None


@pytest.mark.parametrize("content", ["", "garbage", "0 100000", "100000 0", "abc 100000"])
def test_unreadable_cpu_max_is_no_quota(tmp_path, content):
    root = v2(tmp_path, "/", {"": content})
    assert cgroup_cpu_quota(root) is None


def test_no_proc_files_is_no_quota(tmp_path):
    assert cgroup_cpu_quota(str(tmp_path)) is None
    assert cpu_budget(str(tmp_path), affinity=3).cpus == 3


@pytest.mark.parametrize(
    "cpus, override, expected",
    [(0.5, 0, 1), (1.0, 0, 1), (2.0, 0, 1), (3.99, 0, 1), (4.0, 0, 2), (16, 0, 2), (0.5, 3, 3), (16, 1, 1)],
)
def test_native_io_threads(cpus, override, expected):
    assert native_io_threads(CpuBudget(cpus=cpus, affinity=16, quota=None), override) == expected


def test_this_machine():
    import os

    budget = cpu_budget()
    assert budget.affinity == len(os.sched_getaffinity(0))
    assert 0 < budget.cpus <= budget.affinity


def test_workers_share_the_budget():
    budget = CpuBudget(cpus=2.0, affinity=4, quota=2.0)
    assert budget.shared_by(1) is budget
    assert budget.shared_by(4) == CpuBudget(cpus=0.5, affinity=4, quota=2.0)
    eight = CpuBudget(cpus=8.0, affinity=8, quota=None)
    assert native_io_threads(eight.shared_by(4)) == 1 and native_io_threads(eight.shared_by(2)) == 2

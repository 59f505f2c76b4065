"""`openengine-bench`: the benchmark's command (package openengine_bench, tools/ of a source checkout).

setuptools installs this command with every install of the project, the container images' too, which hold
neither the benchmark nor its extra: there it says in one line what to install instead of a traceback. The
benchmark registers its command as an entry point (group `openengine_serve.commands`), found here by name:
the service never imports the benchmark.
"""

from __future__ import annotations

import sys

ENTRY_POINT_GROUP = "openengine_serve.commands"
COMMAND = "openengine-bench"


def require_bench_extra() -> None:
    """Exits 2 with one line naming the extra when the benchmark or a module of its extra is missing."""
    from .common.extras import DependencyError, require_extra

    try:
        require_extra(COMMAND, "bench")
    except DependencyError as exc:
        print(f"{COMMAND}: error: {exc}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    require_bench_extra()
    from importlib.metadata import entry_points

    found = entry_points(group=ENTRY_POINT_GROUP, name=COMMAND)
    if not found:
        print(
            f"{COMMAND}: error: no entry point {COMMAND!r} in group {ENTRY_POINT_GROUP!r}; reinstall the project",
            file=sys.stderr,
        )
        return 2
    command = next(iter(found)).load()
    return command(sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())

"""`openengine-bench`: the benchmark's command (package openengine_bench, tools/ of a source checkout).

setuptools installs this command with every install of the project, the container images' too, which hold
neither the benchmark nor its extra: there it says in one line what to install instead of a traceback.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .cli import require_extra
    from .common.grpc_server import DependencyError

    try:
        require_extra("openengine-bench", "bench")
    except DependencyError as exc:
        print(f"openengine-bench: error: {exc}", file=sys.stderr)
        return 2
    from openengine_bench.cli import main as bench_main

    return bench_main(sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())

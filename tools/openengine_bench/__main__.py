"""`python -m openengine_bench`: the same as the `openengine-bench` command."""

import sys

from openengine_serve.bench_command import require_bench_extra

require_bench_extra()

from openengine_bench.cli import main  # noqa: E402  (after the check: it imports the extra's modules)

sys.exit(main(sys.argv[1:]))

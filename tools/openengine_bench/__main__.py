"""`python -m openengine_bench`: the same as the `openengine-bench` command."""

import sys

from openengine_serve.bench_command import main

sys.exit(main())

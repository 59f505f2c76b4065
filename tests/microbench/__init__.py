"""Micro-benchmarks of internal code, white-box like the unit tests: the frontend's per-token path
(token_path), its span work (span_cost), the batched Reserve's own wait (reserve_wait), and the coordinator
driven through the internal protocol by simulated frontends and nodes using the components' own client classes
(coordinator). Run from a source checkout: `python -m tests.microbench.<name> --help`. The benchmark of the
stack, `openengine-bench`, drives it through its public entry points only (docs/architecture.md)."""

"""`openengine-bench`: the frontend's cost per token on grpcio and on pygrpc-native.

cli       arguments and orchestration (rounds alternate the two servers)
stack     component processes: start, pin to cores, CPU accounting from /proc
load      the load generator (grpc.aio clients in pinned worker processes)
baseline  a trivial streaming servicer: the bare per-message cost of each server
report    statistics, target verdicts, tables, JSON and the chart (pure functions)
"""

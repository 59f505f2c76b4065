"""KV events on the real model (llama.cpp engine), on both gRPC servers: a subscriber replays them into each
node's set of cached blocks, which matches the node's own count, and finds a prompt's blocks under the hashes it
computes itself (common/kv_blocks.py); the coordinator, following them, routes a prompt to the node that caches
its prefix."""

from __future__ import annotations

import os
import signal
import threading
import uuid

import grpc
import pytest

from openengine_serve.api.openengine.v1 import kv_pb2, server_pb2
from openengine_serve.client import Client
from openengine_serve.common.kv_blocks import BLOCK_SIZE, HASH_ENCODING, block_hashes

from . import processes
from .conftest import SERVERS, THREADS, generate, make_request, real_cluster_with
from .processes import engine_worker_pids, wait_for

CACHED_TOKENS = 256  # about three of this test's requests: older ones are evicted


@pytest.fixture(scope="module")
def small_cache():
    with real_cluster_with("--prefix-cache-tokens", str(CACHED_TOKENS)) as cluster:
        yield cluster


@pytest.fixture(params=SERVERS)
def kv_target(request, small_cache) -> str:
    return small_cache.frontends[request.param].target


class Subscriber:
    """A router's view of one node: SubscribeKvEvents with a snapshot, replayed into a set of blocks."""

    def __init__(self, target: str) -> None:
        self.held: set[bytes] = set()
        self.sequence_numbers: list[int] = []
        self.removed = 0
        self.errors: list = []
        self._client = Client(target, retries=False)
        request = kv_pb2.SubscribeKvEventsRequest(include_snapshot=True)
        self._call = self._client.control.SubscribeKvEvents(request)
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                if response.HasField("error"):
                    self.errors.append(response.error)
                    continue
                with self._lock:
                    self._apply(response.batch)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.errors.append(exc)

    def _apply(self, batch: kv_pb2.KvEventBatch) -> None:
        self.sequence_numbers.append(batch.sequence_number)
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                assert event.block_stored.block_size == BLOCK_SIZE
                for block in event.block_stored.block_hashes:
                    assert block.encoding == HASH_ENCODING
                    self.held.add(block.value)
            elif kind == "block_removed":
                for block in event.block_removed.block_hashes:
                    self.held.remove(block.value)  # KeyError: a removal of a block never stored
                    self.removed += 1
            else:
                self.held.clear()

    def blocks(self) -> set[bytes]:
        with self._lock:
            return set(self.held)

    def close(self) -> None:
        self._call.cancel()
        self._reader.join(10)
        self._client.close()


def test_a_subscriber_rebuilds_the_nodes_cached_blocks(kv_target, small_cache):
    with Client(kv_target) as client:
        sources = client.control.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest(), timeout=5).sources
        info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
    assert [(s.data_parallel_rank, s.encoding, s.transport) for s in sources] == [(0, HASH_ENCODING, "grpc")]
    assert info.capacity.kv_block_size == BLOCK_SIZE
    endpoint = sources[0].endpoint_addr
    assert f"{endpoint.host}:{endpoint.port}" == kv_target, "the address the frontend serves on"
    subscriber = Subscriber(f"{endpoint.host}:{endpoint.port}")
    try:
        salt = f"kv-events-{uuid.uuid4()}"  # the namespace of the hashes: no API keys, so the salt alone
        prompts = [[100 + system] * 64 + list(range(500, 500 + user)) for system in range(3) for user in (5, 9)]
        for prompt in prompts:
            generate(kv_target, make_request(prompt, max_tokens=4, kv__cache_salt=salt))
        cached = lambda: int(small_cache.node_metric("openengine_node_kv_cached_blocks"))  # noqa: E731
        wait_for(lambda: len(subscriber.blocks()) == cached(), 10, "the subscriber's blocks to match the node's")
        held = subscriber.blocks()
        assert subscriber.removed > 0, "the small cache evicted blocks, and said so"
        latest = block_hashes(salt, prompts[-1])
        assert len(latest) == 4 and set(latest) <= held, "the last prompt's blocks, under the hashes it computes"
        assert not set(block_hashes(salt, prompts[0])[4:]) & held
        assert not set(block_hashes(salt, [100] * 64)) & held, "the first system prompt's blocks were evicted"
        numbers = subscriber.sequence_numbers
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "batches follow each other"
        assert not subscriber.errors
    finally:
        subscriber.close()


def test_a_rank_no_node_has_is_refused(kv_target):
    with Client(kv_target, retries=False) as client:
        with pytest.raises(grpc.RpcError) as err:
            request = kv_pb2.SubscribeKvEventsRequest(data_parallel_ranks=[0, 7])
            next(iter(client.control.SubscribeKvEvents(request, timeout=10)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "[7]" in err.value.details() and "ready ranks: 0" in err.value.details()


def test_a_start_the_node_no_longer_holds_ends_the_stream_with_an_error(kv_target):
    with Client(kv_target, retries=False) as client:
        request = kv_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9)
        responses = list(client.control.SubscribeKvEvents(request, timeout=10))
    assert len(responses) == 1 and responses[0].HasField("error")
    assert "start_sequence_number 1000000000 is not held" in responses[0].error.message
    assert not responses[0].error.retryable


def test_a_new_engine_worker_starts_its_subscribers_from_no_blocks(small_cache):
    """The worker's cache died with it: a subscriber is told (AllBlocksCleared), then sees the new one's blocks."""
    target = small_cache.frontends["grpcio"].target
    salt = f"kv-restart-{uuid.uuid4()}"
    prompt = [42] * 40
    generate(target, make_request(prompt, max_tokens=2, kv__cache_salt=salt))
    subscriber = Subscriber(target)
    try:
        wait_for(lambda: set(block_hashes(salt, prompt)) <= subscriber.blocks(), 10, "the prompt's blocks")
        os.kill(engine_worker_pids(small_cache.node.proc.pid)[0], signal.SIGKILL)
        wait_for(lambda: not subscriber.blocks(), 60, "the subscriber's blocks to be cleared")

        def served_again() -> bool:
            try:
                generate(target, make_request(prompt, max_tokens=2, kv__cache_salt=salt))
                return True
            except grpc.RpcError:
                return False

        wait_for(served_again, 60, "the new worker to serve")
        wait_for(lambda: set(block_hashes(salt, prompt)) <= subscriber.blocks(), 10, "the new worker's blocks")
        assert not subscriber.errors
    finally:
        subscriber.close()


@pytest.fixture(scope="module")
def two_nodes():
    """A coordinator (routing by KV events, its default) with its metrics, two llama.cpp nodes with theirs, and a
    frontend per gRPC server."""
    deployment = processes.Deployment()
    try:
        coordinator, coordinator_metrics = processes.with_metrics(processes.coordinator())
        deployment.add(coordinator)
        node_metrics = []
        for rank in (0, 1):
            node, metrics_port = processes.with_metrics(
                processes.node(coordinator.target, rank, "--engine", "llama.cpp", "--threads", str(THREADS))
            )
            deployment.add(node)
            node_metrics.append(metrics_port)
        frontends = {server: deployment.add(processes.frontend(coordinator.target, server)) for server in SERVERS}
        yield frontends, coordinator_metrics, node_metrics
    finally:
        deployment.close()


@pytest.mark.parametrize("server", SERVERS)
def test_the_coordinator_routes_a_prompt_to_the_node_caching_its_prefix(two_nodes, server):
    """Four prompts, each first read on one node (alternately, by target rank), come back without a routing key
    and each finds its prefix cached: it went to its node. Placed blindly (or by a hash of the first tokens), all
    four would land on their node once in 16 runs."""
    frontends, coordinator_metrics, node_metrics = two_nodes
    target = frontends[server].target
    salt = f"kv-routing-{uuid.uuid4()}"
    systems = [[300 + i] * 3 * BLOCK_SIZE for i in range(4)]
    for i, system in enumerate(systems):
        with Client(target) as client:
            request = make_request(system + [11, 12, 13], max_tokens=2, kv__cache_salt=salt)
            list(client.generate(request, timeout=120, metadata=(("openengine-target-dp-rank", str(i % 2)),)))

    def coordinator_follows() -> bool:
        followed = [
            value
            for (name, _), value in processes.scrape(coordinator_metrics).items()
            if name == "openengine_coordinator_kv_cached_blocks"
        ]
        cached = [processes.metric(processes.scrape(port), "openengine_node_kv_cached_blocks") for port in node_metrics]
        return sorted(followed) == sorted(cached) and min(cached) > 0

    wait_for(coordinator_follows, 15, "the coordinator's view of both nodes' blocks")
    routed_before = processes.metric(
        processes.scrape(coordinator_metrics), "openengine_coordinator_routing_decisions_total", reason="kv_blocks"
    )
    for system in systems:
        responses = generate(target, make_request(system + [21, 22], max_tokens=2, kv__cache_salt=salt))
        assert responses[-1].usage.cached_prompt_tokens >= len(system), "it went where its prefix is cached"
    routed = processes.metric(
        processes.scrape(coordinator_metrics), "openengine_coordinator_routing_decisions_total", reason="kv_blocks"
    )
    assert routed - routed_before == len(systems)

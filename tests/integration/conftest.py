"""One deployment per session: a coordinator, two nodes, and two frontends per gRPC server.

Every integration test that takes `stack` runs once per server implementation
(grpcio, pygrpc-native): the fixture parameter is the only difference.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from google.protobuf.message import Message

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.client import AsyncClient, Client

from ..greedy_reference import THREADS, llama_reference  # noqa: F401 (the integration tests import them here)
from . import processes
from .processes import Deployment

SERVERS = ("grpcio", "pygrpc-native")
MODEL = "Qwen/Qwen3-0.6B"


def request(
    prompt="The quick brown fox", *, max_tokens=24, seed=7, ignore_eos=True, model=MODEL, **stopping
) -> G.GenerateRequest:
    req = G.GenerateRequest(
        request_id=f"t-{uuid.uuid4()}",
        model=model,
        prompt=prompt,
        stopping=G.StoppingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos, **stopping),
    )
    req.sampling.seed = seed
    return req


def collect(client, req, metadata=()) -> list[G.GenerateResponse]:
    return list(client.inference.Generate(req, timeout=60, metadata=metadata))


def by_output(responses):
    outputs: dict[int, dict] = {}
    for r in responses:
        event = r.WhichOneof("event")
        if event == "token":
            o = outputs.setdefault(r.token.output_index, {"ids": [], "text": "", "finished": []})
            o["ids"] += [t.token_id for t in r.token.tokens]
            o["text"] += r.token.text
        elif event == "finished":
            outputs.setdefault(r.finished.output_index, {"ids": [], "text": "", "finished": []})["finished"].append(
                r.finished
            )
    return outputs


@pytest.fixture
def deployment():
    """A private deployment for one test (it kills or restarts parts); everything it started is stopped."""
    d = Deployment()
    yield d
    d.close()


@dataclass
class Stack:
    server: str
    coordinator: processes.Component
    nodes: list[processes.Component]
    frontend: processes.Component
    second_frontend: processes.Component
    http_url: str = ""  # the first frontend's OpenAI-compatible API (.../v1)

    def client(self, **kwargs) -> Client:
        return Client(self.frontend.target, **kwargs)

    def async_client(self, second: bool = False, **kwargs) -> AsyncClient:
        return AsyncClient((self.second_frontend if second else self.frontend).target, **kwargs)


@pytest.fixture(scope="session")
def cluster():
    coord = processes.coordinator().start()
    nodes = []
    try:
        coord.wait_ready()
        nodes = [processes.node(coord.target, rank).start() for rank in (0, 1)]
        for n in nodes:
            n.wait_ready(90)
        yield coord, nodes
    finally:
        for n in nodes:
            n.stop()
        coord.stop()


@pytest.fixture(scope="session", params=SERVERS)
def stack(request, cluster):
    coord, nodes = cluster
    first, http_url = processes.with_http(processes.frontend(coord.target, request.param))
    frontends = [first.start(), processes.frontend(coord.target, request.param).start()]
    try:
        for f in frontends:
            f.wait_ready(60)
        # both nodes known and ready before tests spread load over them
        processes.wait_for(lambda: _ready_ranks(frontends[0].target) == 2, 20, "both nodes ready on the frontend")
        yield Stack(request.param, coord, nodes, *frontends, http_url=http_url)
    finally:
        for f in frontends:
            f.stop()


SLOW_STEP_MS = 50


class SlowCluster:
    """A coordinator and one node whose engine steps every 50 ms, so a long request visibly runs for
    seconds: a request of 8000 tokens cannot finish by itself within any wait of a test. Frontends (one
    per gRPC server) start on first use. The node serves its metrics, to see a request running on it."""

    def __init__(self, coordinator: processes.Component, node: processes.Component, node_metrics: int) -> None:
        self.coordinator, self.node, self.node_metrics = coordinator, node, node_metrics
        self.frontends: dict[str, processes.Component] = {}

        self.http_urls: dict[str, str] = {}

    def frontend(self, server: str) -> processes.Component:
        if server not in self.frontends:
            frontend, self.http_urls[server] = processes.with_http(processes.frontend(self.coordinator.target, server))
            self.frontends[server] = frontend.start()
            self.frontends[server].wait_ready(60)
        return self.frontends[server]

    def node_running(self) -> float:
        return processes.metric(processes.scrape(self.node_metrics), "openengine_node_running_requests")


@pytest.fixture(scope="session")
def slow_cluster():
    coord = processes.coordinator().start()
    node = None
    cluster = None
    try:
        coord.wait_ready()
        node, node_metrics = processes.with_metrics(processes.node(coord.target, 0, "--step-ms", str(SLOW_STEP_MS)))
        node.name = "slow-node0"
        node.start().wait_ready(90)
        cluster = SlowCluster(coord, node, node_metrics)
        yield cluster
    finally:
        for fe in cluster.frontends.values() if cluster else ():
            fe.stop()
        if node is not None:
            node.stop()
        coord.stop()


def _ready_ranks(target: str) -> int:
    from openengine_serve.api.openengine.v1 import server_pb2

    with Client(target) as client:
        info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=2)
    return info.parallelism.data_parallel_size


# ------------------------------------------------------------------ the real model (llama.cpp engine)

REAL_MODEL = "SmolLM2-135M-Instruct"


@dataclass
class RealCluster:
    coordinator: processes.Component
    node: processes.Component
    node_metrics: int
    frontends: dict[str, processes.Component]
    http_urls: dict[str, str]  # each frontend's OpenAI-compatible API (.../v1)

    def node_metric(self, name: str) -> float:
        return processes.metric(processes.scrape(self.node_metrics), name)


@contextlib.contextmanager
def real_cluster_with(*node_args: str) -> Iterator[RealCluster]:
    """A coordinator, one llama.cpp node serving SmolLM2-135M-Instruct (with `node_args`), and a frontend per
    gRPC server; all stopped on exit."""
    deployment = processes.Deployment()
    try:
        coord = deployment.add(processes.coordinator())
        node, node_metrics = processes.with_metrics(
            processes.node(coord.target, 0, "--engine", "llama.cpp", "--threads", str(THREADS), *node_args)
        )
        deployment.add(node)
        frontends, http_urls = {}, {}
        for server in SERVERS:
            frontend, http_urls[server] = processes.with_http(processes.frontend(coord.target, server))
            frontends[server] = deployment.add(frontend)
        yield RealCluster(coord, node, node_metrics, frontends, http_urls)
    finally:
        deployment.close()


@pytest.fixture(scope="session")
def real_cluster():
    with real_cluster_with() as cluster:
        yield cluster


@pytest.fixture(params=SERVERS)
def target(request, real_cluster) -> str:
    """The public address of a frontend (each gRPC server in turn) of the real-model cluster."""
    return real_cluster.frontends[request.param].target


def make_request(
    prompt: str | list[int] = "The capital of France is", *, max_tokens: int = 24, temperature: float = 0.0, **fields
) -> G.GenerateRequest:
    """A request to the real model, greedy unless `temperature`; `fields`: stopping fields by name, others as
    message__field (lists extend repeated fields). Unless a `kv__` field is given, it bypasses the prefix cache:
    its prompt is read whole, as the reference reads it (a prompt read from the cache computes its last token
    in another batch shape, whose rounding can flip a close greedy choice: docs/engines.md, batch invariance)."""
    req = G.GenerateRequest(
        request_id=f"real-{uuid.uuid4()}", model=REAL_MODEL, stopping=G.StoppingOptions(max_tokens=max_tokens)
    )
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.token_ids.ids.extend(prompt)
    req.sampling.temperature = temperature
    if not any(name.startswith("kv__") for name in fields):
        req.kv.bypass_prefix_cache = True
    for name, value in fields.items():
        message, field = name.split("__") if "__" in name else ("stopping", name)
        if isinstance(value, list):
            getattr(getattr(req, message), field).extend(value)
        elif isinstance(value, Message):  # a message field, e.g. guided__choice
            getattr(getattr(req, message), field).CopyFrom(value)
        else:
            setattr(getattr(req, message), field, value)
    return req


def generate(target: str, req: G.GenerateRequest, timeout: float = 120) -> list[G.GenerateResponse]:
    with Client(target) as client:
        return list(client.generate(req, timeout=timeout))


def output_ids(responses, index: int = 0) -> list[int]:
    return by_output(responses)[index]["ids"]

"""The attacker of test_amplification, a process of its own (its CPU must not slow the test's own client):
`python -m tests.integration.attacker '<json settings>'`.

It holds two connections full of open streams (health watches on one, reflection on the other) and fills
the frontend's connections to their maximum, prints "ready", then sends every amplifier over and over, paced,
until a line arrives on stdin; it then prints one JSON line: for each amplifier, how many times each answer
came."""

from __future__ import annotations

import collections
import json
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine.v1 import server_pb2
from openengine_serve.client import Client

PAUSE_S = 0.02  # between rounds of every amplifier
BEYOND_THE_CAP = 3  # connections opened past OPENENGINE_MAX_CONNECTIONS


class Attacker:
    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.target = settings["target"]
        self.stop = threading.Event()  # the test said stop
        self.release = threading.Event()  # the held streams may end
        self.answers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.clients: list[Client] = []

    def client(self) -> Client:
        client = Client(self.target, retries=False)
        self.clients.append(client)
        return client

    def record(self, name: str, call) -> None:
        try:
            result = call()
            answer = "OK"
            if hasattr(result, "__next__"):  # a stream: its first message, or its error
                next(result)
                result.cancel()
        except grpc.RpcError as exc:
            answer = f"{exc.code().name}: {exc.details()}"
        self.answers[name][answer] += 1

    def request(self, **fields) -> G.GenerateRequest:
        fields.setdefault("prompt", "Hello")
        conditions = fields.pop("conditions", ())
        return G.GenerateRequest(
            request_id=f"attack-{time.monotonic_ns()}",
            model=self.settings["model"],
            stopping=G.StoppingOptions(max_tokens=8, ignore_eos=True, conditions=conditions),
            **fields,
        )

    def reflection_requests(self):  # one question, then the stream stays open until the attack ends
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        self.release.wait()

    def hold_streams(self, watcher: Client, reflector: Client) -> list:
        """Every stream of two connections: health watches on one, reflection streams on the other (pygrpc-native
        counts reflection streams of all connections together: they would not fill the watcher's connection)."""
        streams = []
        for _ in range(self.settings["max_streams"]):
            # The largest service name a health request may carry: what each held stream keeps.
            service = "s" * self.settings["max_service_name_bytes"]
            streams.append(watcher.health.Watch(health_pb2.HealthCheckRequest(service=service)))
            streams.append(
                reflection_pb2_grpc.ServerReflectionStub(reflector.channel).ServerReflectionInfo(
                    self.reflection_requests()
                )
            )
        for stream in streams:
            next(stream)
        return streams

    def fill_connections(self) -> list[Client]:
        """Connections up to the frontend's maximum (each admitted by a call), and BEYOND_THE_CAP more."""
        opened, beyond = [], []
        for _ in range(self.settings["max_connections"] + BEYOND_THE_CAP):
            opened.append(client := self.client())
            try:
                client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10)
            except grpc.RpcError:
                beyond.append(client)
                if len(beyond) == BEYOND_THE_CAP:
                    break
        return beyond or opened[-BEYOND_THE_CAP:]  # none refused: the test sees their answers

    def amplifiers(self, plain: Client, watcher: Client, reflector: Client, beyond: list[Client]) -> dict:
        settings = self.settings
        ids = G.TokenIds(ids=list(range(1000)))
        generate = plain.inference.Generate
        return {
            "output candidate ids": lambda: list(
                generate(self.request(response=G.ResponseOptions(output_candidates={"token_ids": ids})), timeout=10)
            ),
            "prompt candidate ids": lambda: list(
                generate(self.request(response=G.ResponseOptions(prompt_candidates={"token_ids": ids})), timeout=10)
            ),
            "prompt bytes": lambda: list(
                generate(self.request(prompt="x" * 4 * settings["max_prompt_bytes"]), timeout=10)
            ),
            "stop text": lambda: list(
                generate(self.request(conditions=[G.StopCondition(stop_text="s" * 1000)] * 16), timeout=10)
            ),
            "request bytes": lambda: list(
                generate(self.request(prompt="x" * (settings["max_request_bytes"] + 1)), timeout=10)
            ),
            "metadata bytes": lambda: list(
                generate(self.request(), metadata=(("x-padding", "p" * settings["max_metadata_bytes"]),), timeout=10)
            ),
            "health request bytes": lambda: plain.health.Watch(
                health_pb2.HealthCheckRequest(service="s" * (settings["max_service_name_bytes"] + 1)), timeout=10
            ),
            "streams: Generate": lambda: list(watcher.inference.Generate(self.request(), timeout=10)),
            "streams: health watch": lambda: watcher.health.Watch(health_pb2.HealthCheckRequest(), timeout=10),
            "streams: reflection": lambda: reflection_pb2_grpc.ServerReflectionStub(
                reflector.channel
            ).ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10),
            "connections": lambda: beyond[0].control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10),
        }

    def run(self) -> None:
        plain, watcher, reflector = self.client(), self.client(), self.client()
        for client in (plain, watcher, reflector):  # admitted before the connections are filled
            client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10)
        held = self.hold_streams(watcher, reflector)
        beyond = self.fill_connections()
        amplifiers = self.amplifiers(plain, watcher, reflector, beyond)
        threading.Thread(target=lambda: (sys.stdin.readline(), self.stop.set()), daemon=True).start()
        for name, call in amplifiers.items():
            self.record(name, call)
        print("ready", flush=True)
        while not self.stop.is_set():
            beyond.append(beyond.pop(0))  # each connection beyond the maximum in turn
            for name, call in amplifiers.items():
                self.record(name, call)
            self.stop.wait(PAUSE_S)
        self.release.set()
        for stream in held:
            stream.cancel()
        for client in self.clients:
            client.close()
        print(json.dumps({name: dict(counts) for name, counts in self.answers.items()}), flush=True)


if __name__ == "__main__":
    Attacker(json.loads(sys.argv[1])).run()

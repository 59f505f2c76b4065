"""A DNS server on loopback for tests: one name with several A records (what a headless Service's name gives
a client: one address per ready pod). Clients reach it as `dns://127.0.0.1:PORT/NAME:port`."""

from __future__ import annotations

import socket
import struct
import threading

TYPE_A, CLASS_IN = 1, 1
FLAGS_ANSWER = 0x8180  # response, recursion desired and available, NOERROR
FLAGS_NXDOMAIN = 0x8183


class LoopbackDns:
    def __init__(self, name: str, addresses: list[str]) -> None:
        self.name = name.lower().rstrip(".")
        self.addresses = list(addresses)  # may be changed while serving
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.queries = 0
        self._thread = threading.Thread(target=self._serve, daemon=True, name="loopback-dns")

    def target(self, port: int) -> str:
        return f"dns://127.0.0.1:{self.port}/{self.name}:{port}"

    def __enter__(self) -> LoopbackDns:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self.sock.recvfrom(512)
            except OSError:
                return  # closed
            reply = self.answer(query)
            if reply:
                self.queries += 1
                try:
                    self.sock.sendto(reply, peer)
                except OSError:
                    return  # closed while answering

    def answer(self, query: bytes) -> bytes:
        if len(query) < 12:
            return b""
        (query_id,) = struct.unpack(">H", query[:2])
        labels, pos = [], 12
        while pos < len(query) and query[pos]:
            labels.append(query[pos + 1 : pos + 1 + query[pos]].decode(errors="replace"))
            pos += 1 + query[pos]
        question_end = pos + 5  # the root label, then type and class
        if question_end > len(query):
            return b""
        qtype, _ = struct.unpack(">HH", query[pos + 1 : question_end])
        question = query[12:question_end]
        if ".".join(labels).lower() != self.name:
            return struct.pack(">HHHHHH", query_id, FLAGS_NXDOMAIN, 1, 0, 0, 0) + question
        # the name exists: A records for A, an empty answer for AAAA, TXT, SRV...
        records = [socket.inet_aton(a) for a in self.addresses] if qtype == TYPE_A else []
        answers = b"".join(struct.pack(">HHHIH", 0xC00C, TYPE_A, CLASS_IN, 1, 4) + r for r in records)
        return struct.pack(">HHHHHH", query_id, FLAGS_ANSWER, 1, len(records), 0, 0) + question + answers

"""The frontend's per-output stream: hand-serialized deltas equal protobuf's, stops, finishes, coalescing."""

import asyncio
import codecs
import random
from types import SimpleNamespace

import pytest

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine_internal.v1 import cluster_pb2 as C
from openengine_serve.common.vocab import EOS_TOKEN_ID, load_encoding
from openengine_serve.frontend.stream import (
    OutputStream,
    TokenStrings,
    output_index_field,
    serialize_response,
    token_delta_bytes,
)
from openengine_serve.frontend.validation import GenerationPlan, RequestMetadata

ENC = load_encoding()
STRINGS = TokenStrings(ENC)


def plan(**overrides) -> GenerationPlan:
    values = dict(
        request_id="req-1",
        model="m",
        prompt_token_ids=[1, 2],
        num_sequences=1,
        max_tokens=50,
        min_tokens=0,
        stop_strings=[],
        stop_token_ids=[],
        ignore_eos=False,
        include_stop_in_output=False,
        metadata=RequestMetadata(),
    )
    values.update(overrides)
    return GenerationPlan(**values)


def event(ids, finish=C.ENGINE_FINISH_NONE, finish_token_id=0, index=0):
    return C.OutputEvent(
        request_id="req-1",
        output_index=index,
        finish=finish,
        finish_token_id=finish_token_id,
        tokens=[C.TokenRecord(token_id=i) for i in ids],
    )


@pytest.mark.parametrize("request_id", ["r", "x" * 300, "ünïcödé-id"])
@pytest.mark.parametrize("output_index", [0, 1, 300])
def test_hand_serialized_delta_equals_protobuf(request_id, output_index):
    rng = random.Random(output_index)
    for _ in range(50):
        ids = [rng.randrange(ENC.n_vocab) for _ in range(rng.randrange(0, 5))]
        text = ENC.decode(ids)
        prefix = G.GenerateResponse(request_id=request_id).SerializeToString()
        raw = token_delta_bytes(prefix, output_index_field(output_index), [STRINGS.info_field(i) for i in ids], text)
        expected = G.GenerateResponse(
            request_id=request_id,
            token=G.TokenOutput(
                output_index=output_index, text=text, tokens=[G.TokenInfo(token_id=i, token=STRINGS(i)) for i in ids]
            ),
        )
        parsed = G.GenerateResponse.FromString(raw)
        assert parsed == expected
        assert parsed.token.HasField("output_index"), "output_index 0 is present on the wire"


@pytest.mark.parametrize("output_index", [0, 2])  # output 0's token field is cached whole
def test_token_by_token_deltas_equal_protobuf_also_across_split_characters(output_index):
    """The one-token fast path (cached bytes) and the general path must stream what protobuf would build:
    each delta's text is what the token completes, a character split over tokens arrives whole once."""
    text = "Héllo wörld, 你好世界 🤖🎉 naïve café ∑∫ — done"
    ids = ENC.encode(text)
    ids += [
        i
        for i in range(ENC.n_vocab)
        if len(ENC.decode_single_token_bytes(i)) == 1 and ENC.decode_single_token_bytes(i)[0] >= 0x80
    ][:40]  # lone bytes of multi-byte characters
    assert any(STRINGS.one_token_body(i) is None for i in ids), "the stream must split characters"
    out = OutputStream(output_index, plan(request_id="req-1"), ENC, STRINGS)
    detok = codecs.getincrementaldecoder("utf-8")(errors="replace")
    streamed = ""
    for token_id in ids:
        delta, count, finished, _ = out.on_events([event([token_id], index=output_index)])
        expected_text = detok.decode(ENC.decode_single_token_bytes(token_id))
        assert delta is not None, "every token is reported, also one whose text is still held back"
        parsed = G.GenerateResponse.FromString(delta)
        assert parsed == G.GenerateResponse(
            request_id="req-1",
            token=G.TokenOutput(
                output_index=output_index,
                text=expected_text,
                tokens=[G.TokenInfo(token_id=token_id, token=STRINGS(token_id))],
            ),
        )
        assert count == 1 and finished is None
        streamed += parsed.token.text
    assert streamed + detok.decode(b"", final=True) == ENC.decode(ids)


@pytest.mark.parametrize("output_index", [0, 2])
def test_last_token_at_max_tokens_is_the_same_delta_on_the_cached_path(output_index):
    """A one-token event that ends the output at max_tokens (every 1-token request's only event) takes the
    cached bytes when nothing is held back: the same delta and `finished` the general path builds."""
    whole = ENC.encode(" world")[0]
    assert STRINGS.one_token_body(whole) is not None
    split = next(i for i in range(ENC.n_vocab) if STRINGS.one_token_body(i) is None)
    for token_id in (whole, split):
        fast = OutputStream(output_index, plan(), ENC, STRINGS)
        general = OutputStream(output_index, plan(stop_strings=["never matched"]), ENC, STRINGS)
        assert fast.plain and not general.plain
        fast_out = fast.on_events([event([token_id], C.ENGINE_FINISH_LENGTH, index=output_index)])
        general_out = general.on_events([event([token_id], C.ENGINE_FINISH_LENGTH, index=output_index)])
        delta, count, finished, stop = fast_out
        assert G.GenerateResponse.FromString(delta) == G.GenerateResponse.FromString(general_out[0])
        assert (count, finished, stop) == general_out[1:] and fast.generated == general.generated == 1
        assert finished.finished.reason == G.FINISH_REASON_LENGTH and fast.finished


def test_serializer_passes_bytes_and_serializes_messages():
    msg = G.GenerateResponse(request_id="a")
    assert serialize_response(b"raw") == b"raw"
    assert serialize_response(msg) == msg.SerializeToString()


def test_coalesced_events_make_one_delta_with_the_full_text():
    out = OutputStream(0, plan(), ENC, STRINGS)
    ids = ENC.encode("Hello there, 你好 world")
    delta, count, finished, stop = out.on_events([event(ids[:2]), event(ids[2:])])
    msg = G.GenerateResponse.FromString(delta)
    assert count == len(ids) and [t.token_id for t in msg.token.tokens] == ids
    assert msg.token.text == "Hello there, 你好 world" and finished is None and not stop


def test_eos_finishes_with_stop_match_and_no_eos_text():
    out = OutputStream(0, plan(), ENC, STRINGS)
    delta, count, finished, _ = out.on_events([event([9707, EOS_TOKEN_ID], C.ENGINE_FINISH_EOS, EOS_TOKEN_ID)])
    assert G.GenerateResponse.FromString(delta).token.text == "Hello" and count == 1
    assert finished.finished.reason == G.FINISH_REASON_STOP
    assert finished.finished.stop_match.eos_token_id == EOS_TOKEN_ID
    assert out.generated == 2 and out.finished


def test_stop_string_cuts_text_and_asks_the_node_to_stop():
    out = OutputStream(0, plan(stop_strings=["lo th"]), ENC, STRINGS)
    delta, _, finished, stop = out.on_events([event(ENC.encode("Hello there"))])
    assert G.GenerateResponse.FromString(delta).token.text == "Hel"
    assert finished.finished.stop_match.stop_text == "lo th" and stop


def test_logprobs_take_the_protobuf_path():
    out = OutputStream(0, plan(output_logprobs=True), ENC, STRINGS)
    ev = C.OutputEvent(output_index=0, tokens=[C.TokenRecord(token_id=9707, has_logprob=True, logprob=-0.5, rank=1)])
    delta, _, _, _ = out.on_events([ev])
    assert isinstance(delta, G.GenerateResponse)
    assert delta.token.tokens[0].logprob == -0.5 and delta.token.tokens[0].rank == 1


def test_length_and_cancel_finishes():
    out = OutputStream(2, plan(), ENC, STRINGS)
    _, _, finished, _ = out.on_events([event([], C.ENGINE_FINISH_CANCELLED, index=2)])
    assert finished.finished.reason == G.FINISH_REASON_CANCELLED and finished.finished.output_index == 2
    out = OutputStream(0, plan(), ENC, STRINGS)
    _, _, finished, _ = out.on_events([event([11], C.ENGINE_FINISH_LENGTH)])
    assert finished.finished.reason == G.FINISH_REASON_LENGTH


async def _stream_one_event_at_a_time(ids, send_now):
    """Inference.stream fed one event per step (the stream idle in between, as on the lane); every message in
    the order the client would get it, how many sends were tried, and how many messages went through `write`."""
    from openengine_serve.frontend.inference import Inference
    from openengine_serve.frontend.nodes import RequestSink

    class Accepted:  # what Inference.stream uses of requests.OpenRequest
        def __init__(self) -> None:
            self.sink, self.ended, self.owner = RequestSink(), False, ""
            self.node = C.NodeEntry(node_id="n")
            from openengine_serve.frontend.request_trace import NO_TRACE

            self.trace = NO_TRACE

    inference = Inference.__new__(Inference)
    loaded = SimpleNamespace(tokenizer=ENC, strings=STRINGS, limits=SimpleNamespace(prefix_cache=False))
    inference.model = SimpleNamespace(loaded=loaded, for_name=lambda name: loaded)
    accepted, out, direct, written = Accepted(), [], [], []

    async def write(message):
        out.append(serialize_response(message))
        written.append(message)

    def send(data):
        direct.append(data)
        if send_now(len(direct)):
            out.append(data)
            return True
        return False

    task = asyncio.ensure_future(
        inference.stream(plan(max_tokens=len(ids)), accepted, 0.0, write, send if send_now else None)
    )
    for n, token_id in enumerate(ids):
        for _ in range(3):
            await asyncio.sleep(0)
        last = n == len(ids) - 1
        accepted.sink.put(event([token_id], C.ENGINE_FINISH_LENGTH if last else C.ENGINE_FINISH_NONE))
    await asyncio.wait_for(task, 5)
    return out, len(direct), len(written)


async def test_deltas_sent_by_the_lane_reader_equal_the_stream_s_own_writes():
    """pygrpc-native's non-blocking send (the lane reader sends a plain one-token delta while the stream waits):
    the client gets the same messages in the same order, a send that finds the client's buffer full goes out
    through the stream's own write, once and in order, and the token metrics count every delta once."""
    ids = ENC.encode("Héllo wörld, 你好世界 🤖🎉 naïve café — done and done again")
    expected, _, _ = await _stream_one_event_at_a_time(ids, None)
    assert len(expected) == len(ids) + 1, "one delta per token and the finished message"
    sent, direct, _ = await _stream_one_event_at_a_time(ids, lambda n: True)
    assert sent == expected
    assert direct > len(ids) // 2, "most deltas go out from the lane reader"
    counts = _metric_counts()
    sent, _, _ = await _stream_one_event_at_a_time(ids, lambda n: n % 3 != 0)  # every third finds the buffer full
    assert sent == expected
    await asyncio.sleep(0)  # the metrics' flush
    tokens, gaps = (after - before for after, before in zip(_metric_counts(), counts))
    assert (tokens, gaps) == (len(ids), len(ids) - 1), "every delta counted once, whichever path sent it"


async def test_a_full_buffer_is_tried_once_more_after_a_loop_iteration_before_the_write():
    """pygrpc-native: a message of the stream's own that the client's buffer cannot take (mostly the `finished`
    right behind the last delta) is sent again after one loop iteration, while the server's I/O thread drains
    the buffer, and only then written (pygrpc-native's write waits for room in a thread pool). The client gets
    the same messages in the same order either way."""
    ids = ENC.encode(" world")  # one token: its delta and the finished both come from the stream itself
    expected, _, _ = await _stream_one_event_at_a_time(ids, None)
    assert len(expected) == 2
    sent, tries, written = await _stream_one_event_at_a_time(ids, lambda n: n % 2 == 0)  # full at each first try
    assert (sent, tries, written) == (expected, 4, 0)
    sent, tries, written = await _stream_one_event_at_a_time(ids, lambda n: False)  # stays full: the write
    assert (sent, tries, written) == (expected, 4, 2)


def _metric_counts() -> tuple[float, float]:
    from openengine_serve.frontend import metrics

    samples = {s.name: s.value for m in (metrics.GENERATED_TOKENS, metrics.ITL) for s in m.collect()[0].samples}
    return samples["openengine_frontend_generated_tokens_total"], samples[
        "openengine_frontend_inter_token_latency_seconds_count"
    ]

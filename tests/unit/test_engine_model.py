"""The simulated model: deterministic, and honest about EOS, stops, lengths and logprobs."""

from __future__ import annotations

import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.vocab import BPE_RANKS, EOS_TOKEN_ID, load_encoding
from openengine_serve.engine.simulated import model

FINISH = cluster_pb2


def make_request(**fields) -> cluster_pb2.EngineRequest:
    defaults = dict(
        request_id="req-1",
        frontend_id="fe-1",
        prompt_token_ids=[9707, 11, 1879, 0],
        max_tokens=64,
        temperature=0.8,
        top_p=0.95,
    )
    defaults.update(fields)
    return cluster_pb2.EngineRequest(**defaults)


def run_output(request: cluster_pb2.EngineRequest, output_index: int = 0):
    """[(token_id, finish, record)] of one output, until it finishes."""
    state = model.RequestState(request)
    sequence = state.outputs[output_index]
    produced = []
    while output_index in state.outputs:
        produced.append(state.next_token(sequence))
    return produced


def token_ids(produced) -> list[int]:
    return [token_id for token_id, _, _ in produced]


def test_same_request_gives_same_tokens_whatever_the_request_id():
    first = run_output(make_request(request_id="a", output_logprobs=True))
    again = run_output(make_request(request_id="b", frontend_id="other", output_logprobs=True))
    assert [(t, f) for t, f, _ in first] == [(t, f) for t, f, _ in again]
    assert [r.SerializeToString() for _, _, r in first] == [r.SerializeToString() for _, _, r in again]


@pytest.mark.parametrize(
    "change",
    [
        dict(seed=7, has_seed=True),
        dict(temperature=0.5),
        dict(top_k=40),
        dict(prompt_token_ids=[9707, 11, 1879, 1]),
    ],
)
def test_seed_sampling_and_prompt_change_the_tokens(change):
    request = make_request(ignore_eos=True)
    changed = make_request(ignore_eos=True, **change)
    assert token_ids(run_output(request)) != token_ids(run_output(changed))


def test_seed_without_has_seed_is_seed_zero():
    assert token_ids(run_output(make_request(seed=7))) == token_ids(run_output(make_request(seed=0)))
    assert token_ids(run_output(make_request(seed=0, has_seed=True))) == token_ids(run_output(make_request()))


def test_outputs_differ_unless_greedy():
    sampled = make_request(num_sequences=3, ignore_eos=True)
    streams = {tuple(token_ids(run_output(sampled, index))) for index in range(3)}
    assert len(streams) == 3
    greedy = make_request(num_sequences=3, temperature=0.0, ignore_eos=True)
    streams = {tuple(token_ids(run_output(greedy, index))) for index in range(3)}
    assert len(streams) == 1


def test_tokens_mix_readable_words_and_raw_bpe_pieces():
    produced = token_ids(run_output(make_request(max_tokens=2000, ignore_eos=True)))
    encoding = load_encoding()
    pieces = [encoding.decode_single_token_bytes(token_id) for token_id in produced]
    readable = sum(piece[:1] == b" " and piece[1:].isalpha() and piece[1:].islower() for piece in pieces)
    assert 0.70 < readable / len(pieces) < 0.95
    # Multi-byte UTF-8 pieces occur, split characters included.
    assert any(not _is_utf8(piece) for piece in pieces)
    assert all(token_id < BPE_RANKS for token_id in produced)


def _is_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_eos_ends_outputs_at_about_one_in_48_and_is_the_last_token():
    lengths = []
    for seed in range(300):
        produced = run_output(make_request(seed=seed, has_seed=True, max_tokens=1000))
        token_id, finish, _ = produced[-1]
        assert finish == FINISH.ENGINE_FINISH_EOS and token_id == EOS_TOKEN_ID
        assert EOS_TOKEN_ID not in token_ids(produced[:-1])
        assert all(f == FINISH.ENGINE_FINISH_NONE for _, f, _ in produced[:-1])
        lengths.append(len(produced))
    assert 30 < sum(lengths) / len(lengths) < 70


def test_eos_never_before_min_tokens():
    for seed in range(200):
        produced = run_output(make_request(seed=seed, has_seed=True, min_tokens=30, max_tokens=1000))
        assert len(produced) >= 30
        assert EOS_TOKEN_ID not in token_ids(produced[:29])


def test_ignore_eos_runs_to_max_tokens():
    for seed in range(20):
        produced = run_output(make_request(seed=seed, has_seed=True, ignore_eos=True, max_tokens=300))
        assert len(produced) == 300
        assert EOS_TOKEN_ID not in token_ids(produced)
        assert produced[-1][1] == FINISH.ENGINE_FINISH_LENGTH


def test_max_tokens_finishes_with_length():
    produced = run_output(make_request(max_tokens=5, ignore_eos=True))
    finishes = [finish for _, finish, _ in produced]
    assert finishes == [FINISH.ENGINE_FINISH_NONE] * 4 + [FINISH.ENGINE_FINISH_LENGTH]


def test_stop_token_ends_the_output_including_the_token():
    plain = token_ids(run_output(make_request(ignore_eos=True, max_tokens=50)))
    stop_id = plain[10]
    first_use = plain.index(stop_id)
    produced = run_output(make_request(ignore_eos=True, max_tokens=50, stop_token_ids=[stop_id, 3]))
    assert token_ids(produced) == plain[: first_use + 1]
    assert produced[-1][1] == FINISH.ENGINE_FINISH_STOP_TOKEN


def test_stop_token_before_min_tokens_is_an_ordinary_token():
    plain = token_ids(run_output(make_request(ignore_eos=True, max_tokens=80)))
    stop_id = plain[5]
    later_uses = [index for index, token_id in enumerate(plain) if token_id == stop_id and index >= 20]
    produced = run_output(make_request(ignore_eos=True, max_tokens=80, min_tokens=21, stop_token_ids=[stop_id]))
    assert stop_id in token_ids(produced[:20])
    if later_uses:
        assert len(produced) == later_uses[0] + 1
        assert produced[-1][1] == FINISH.ENGINE_FINISH_STOP_TOKEN
    else:
        assert len(produced) == 80
        assert produced[-1][1] == FINISH.ENGINE_FINISH_LENGTH


def test_a_stop_token_counts_toward_min_tokens():
    plain = token_ids(run_output(make_request(ignore_eos=True, max_tokens=50)))
    produced = run_output(make_request(ignore_eos=True, max_tokens=50, min_tokens=10, stop_token_ids=[plain[9]]))
    # Ignored before position 10 wherever it occurs, it ends the output as the 10th token.
    assert token_ids(produced) == plain[:10]
    assert produced[-1][1] == FINISH.ENGINE_FINISH_STOP_TOKEN


def test_no_logprobs_unless_asked():
    assert all(record is None for _, _, record in run_output(make_request()))


def test_logprobs_and_ranks_are_in_range():
    request = make_request(max_tokens=500, ignore_eos=True, output_logprobs=True)
    for token_id, _, record in run_output(request):
        assert record.token_id == token_id
        assert record.has_logprob
        assert -6.0 <= record.logprob <= -0.01
        assert 1 <= record.rank <= 5
        assert not record.candidates


def test_greedy_tokens_have_rank_one():
    produced = run_output(make_request(temperature=0.0, output_logprobs=True, ignore_eos=True))
    assert {record.rank for _, _, record in produced} == {1}


def test_top_n_candidates_are_ranked_and_hold_the_chosen_token():
    request = make_request(
        max_tokens=300, ignore_eos=True, output_logprobs=True, output_candidates=cluster_pb2.Candidates(top_n=3)
    )
    seen_outside = False
    for token_id, _, record in run_output(request):
        candidates = list(record.candidates)
        assert [c.rank for c in candidates] == [1, 2, 3]
        logprobs = [c.logprob for c in candidates]
        assert logprobs == sorted(logprobs, reverse=True) and len(set(logprobs)) == 3
        assert len({c.token_id for c in candidates}) == 3
        if record.rank <= 3:
            chosen = candidates[record.rank - 1]
            assert (chosen.token_id, chosen.logprob) == (token_id, record.logprob)
        else:
            seen_outside = True
            assert token_id not in {c.token_id for c in candidates}
            assert logprobs[-1] > record.logprob
    assert seen_outside


def test_token_id_candidates_answer_every_asked_id():
    asked = [11, 13, 9707]
    request = make_request(
        max_tokens=100, ignore_eos=True, output_logprobs=True, output_candidates=cluster_pb2.Candidates(token_ids=asked)
    )
    for token_id, _, record in run_output(request):
        assert [c.token_id for c in record.candidates] == asked
        for candidate in record.candidates:
            if candidate.token_id == token_id:
                assert (candidate.logprob, candidate.rank) == (record.logprob, record.rank)
            else:
                assert candidate.rank > 5 and candidate.logprob < -6.0


def test_prompt_logprobs_once_for_output_zero_first_token_without_logprob():
    prompt = [9707, 11, 1879, 0, 42]
    state = model.RequestState(
        make_request(
            prompt_token_ids=prompt,
            num_sequences=2,
            prompt_logprobs=True,
            prompt_candidates=cluster_pb2.Candidates(top_n=2),
        )
    )
    assert state.take_prompt_records(1) is None
    records = state.take_prompt_records(0)
    assert state.take_prompt_records(0) is None
    assert [r.token_id for r in records] == prompt
    assert (records[0].has_logprob, records[0].rank, len(records[0].candidates)) == (False, 0, 0)
    for record in records[1:]:
        assert record.has_logprob and 1 <= record.rank <= 5 and len(record.candidates) == 2


def test_prompt_logprob_start_skips_leading_tokens_with_the_same_values():
    prompt = [9707, 11, 1879, 0, 42]
    full = model.prompt_token_records(make_request(prompt_token_ids=prompt, prompt_logprobs=True))
    tail = model.prompt_token_records(
        make_request(prompt_token_ids=prompt, prompt_logprobs=True, prompt_logprob_start=2)
    )
    assert [r.SerializeToString() for r in tail] == [r.SerializeToString() for r in full[2:]]
    assert tail[0].has_logprob


def test_no_prompt_records_unless_asked():
    assert model.RequestState(make_request()).take_prompt_records(0) is None


def test_rank_bands_never_overlap():
    values = [model.logprob_for_rank(rank, fraction) for rank in range(1, 40) for fraction in (0.0, 0.999)]
    assert values == sorted(values, reverse=True)
    assert model.logprob_for_rank(1, 0.0) == pytest.approx(-0.01)
    assert model.logprob_for_rank(5, 0.999) > -6.0

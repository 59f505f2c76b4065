"""client.Attempts: which refusals generate() retries, how long it waits, and when its deadline ends it."""

import grpc
import pytest

from openengine_serve.client import Attempts, DeadlineExceeded


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "refused"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def attempts(timeout, jitter=1.0, limit=16, clock=None) -> Attempts:
    return Attempts(timeout, limit=limit, backoff_s=(0.05, 0.5), clock=clock or Clock(), jitter=lambda: jitter)


def test_each_attempt_gets_what_is_left_of_the_deadline():
    clock = Clock()
    a = attempts(3.0, clock=clock)
    assert a.next_timeout() == pytest.approx(3.0)
    clock.now += 1.25
    assert a.wait_before_retry(Refusal(), received=False) == pytest.approx(0.05)
    assert a.next_timeout() == pytest.approx(1.75)


def test_the_deadline_ends_the_call_with_deadline_exceeded_naming_the_last_refusal():
    clock = Clock()
    a = attempts(1.0, clock=clock)
    a.next_timeout()
    clock.now += 0.99
    assert a.wait_before_retry(Refusal(), received=False) == pytest.approx(0.01)  # never sleeps past it
    clock.now += 0.01
    with pytest.raises(DeadlineExceeded) as raised:
        a.next_timeout()
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "attempts made: 1" in raised.value.details() and "UNAVAILABLE: refused" in raised.value.details()


def test_backoff_doubles_up_to_its_cap_with_full_jitter():
    top = attempts(None, jitter=1.0)
    caps = []
    for _ in range(6):
        top.next_timeout()
        caps.append(top.wait_before_retry(Refusal(), received=False))
    assert caps == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5])
    half = attempts(None, jitter=0.5)
    half.next_timeout()
    assert half.wait_before_retry(Refusal(), received=False) == pytest.approx(0.025)


def test_without_a_timeout_the_count_bounds_the_attempts():
    a = attempts(None, limit=3)
    for _ in range(2):
        assert a.next_timeout() is None
        a.wait_before_retry(Refusal(), received=False)
    a.next_timeout()
    error = Refusal()
    with pytest.raises(Refusal) as raised:
        a.wait_before_retry(error, received=False)
    assert raised.value is error


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ALREADY_EXISTS,
    ],
)
def test_other_refusals_are_not_retried(code):
    a = attempts(10.0)
    a.next_timeout()
    with pytest.raises(Refusal):
        a.wait_before_retry(Refusal(code), received=False)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_unavailable_and_cancelled_before_the_first_message_are_retried(code):
    a = attempts(10.0)
    a.next_timeout()
    assert a.wait_before_retry(Refusal(code), received=False) == pytest.approx(0.05)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_stream_that_delivered_a_message_is_not_retried(code):
    a = attempts(10.0)
    a.next_timeout()
    with pytest.raises(Refusal):
        a.wait_before_retry(Refusal(code), received=True)

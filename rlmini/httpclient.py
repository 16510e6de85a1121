"""The one HTTP client of every remote call: the vLLM server (rlmini/server.py), the routes of its NCCL weight
transfer (rlmini/transfer.py) and the LLM judges (rlmini/judge.py).

httpx2, httpx's API under its own name. huggingface_hub 2.x depends on it (httpx2>=2.0.0,<3), so it costs
nothing where transformers resolves hub 2.x; transformers 5.19 also accepts hub 1.31+, which brings httpx
instead, so requirements-common.txt names it. It is imported at the first remote call (load): a trainer
that makes none starts on a machine without it.

One rule for timeouts and retries (send, asend): every try is bounded by `timeout` seconds; one that times
out, loses its connection, or is answered 429 or 5xx is tried again after BACKOFF_S * 2**k seconds (k = 0,
1, ...; at most BACKOFF_CAP_S) times a jitter in [0.5, 1.5], up to `retries` times, each retry reported to
the caller's on_retry (which counts it). httpx's own transport retries (HTTPTransport(retries=)) cover failed
connections only, out of the caller's sight: none are used.
"""
import asyncio
import itertools
import random
import threading
import time

BACKOFF_S = 0.5    # the first retry's wait; doubled per retry, times a jitter in [0.5, 1.5], capped at:
BACKOFF_CAP_S = 8.0
JITTER = random.Random()  # its own: the run's RNG streams (checkpointed) stay as they are
SHARED = []  # the process's sync client, made at its first use (shared())
LOCK = threading.Lock()


def load(flag: str):
    """httpx2, imported where a remote call is made; SystemExit in one line naming `flag` (the option that
    makes the call) and the pip package when it is missing."""
    try:
        import httpx2
    except ImportError:
        raise SystemExit(f"{flag}: the HTTP client is not installed: pip install 'httpx2>=2.0,<3' "
                         f"(requirements-common.txt)") from None
    return httpx2


def shared(flag: str):
    """The process's sync client, shared by every thread (httpx's Client locks its pool): one SSL context,
    loaded once (~50 ms). No keep-alive: a connection per request, as urllib and requests opened them, since
    an idle connection the server closes (uvicorn after 5 s) fails the request that reuses it at that moment,
    and the vLLM server's calls are not retried. No bound on connections: the callers' threads bound them."""
    with LOCK:
        if not SHARED:
            httpx2 = load(flag)
            limits = httpx2.Limits(max_connections=None, max_keepalive_connections=0)
            SHARED.append(httpx2.Client(limits=limits))
    return SHARED[0]


def retryable(status: int) -> bool:
    """An HTTP status worth another try: rate-limited (429) or a server error (5xx)."""
    return status == 429 or status >= 500


def why(error: BaseException) -> str:
    """An exception in one line: its type, and its text if it has one."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}{': ' + text if text else ''}"


class NoAnswer(Exception):
    """No HTTP answer after the last try: `error` is that try's exception; the text says why in a few words
    ("no answer within 60 s", "ConnectError: [Errno 111] Connection refused") and the tries, if several."""

    def __init__(self, error: BaseException, tries: int, timeout: float):
        import httpx2
        timed_out = isinstance(error, (TimeoutError, httpx2.TimeoutException))
        text = f"no answer within {timeout:g} s" if timed_out else why(error)
        super().__init__(text + (f" ({tries} tries)" if tries > 1 else ""))
        self.error = error


def _failures() -> tuple:
    """What a try raises when it gets no answer: the client's request errors, an invalid URL, a deadline."""
    import httpx2
    return httpx2.RequestError, httpx2.InvalidURL, TimeoutError


def _wait(answer, attempt: int, retries: int, on_retry) -> float | None:
    """Seconds to wait before the next try after try `attempt` (0-based) got `answer` (a response or the
    exception it raised); None when that answer is final: not retryable, or the last try."""
    import httpx2
    if isinstance(answer, BaseException):
        again = isinstance(answer, (httpx2.TransportError, TimeoutError))
    else:
        again = retryable(answer.status_code)
    if not again or attempt >= retries:
        return None
    if on_retry is not None:
        on_retry()
    return min(BACKOFF_CAP_S, BACKOFF_S * 2 ** attempt) * JITTER.uniform(0.5, 1.5)


def _final(answer, tries: int, timeout: float):
    if isinstance(answer, BaseException):
        raise NoAnswer(answer, tries, timeout) from None
    return answer


def send(client, method: str, url: str, *, timeout: float, retries: int = 0, on_retry=None, **kw):
    """client.request(method, url, **kw) (a sync client: shared()) by the rule above, each of a try's
    operations (connect, write, read) within `timeout` seconds, as urllib and requests bound them. Returns the
    final response (any status: a 429 or 5xx after the last try included); NoAnswer after a last try that got
    none."""
    for attempt in itertools.count():
        try:
            answer = client.request(method, url, timeout=timeout, **kw)
        except _failures() as e:
            answer = e
        wait = _wait(answer, attempt, retries, on_retry)
        if wait is None:
            return _final(answer, attempt + 1, timeout)
        time.sleep(wait)


async def asend(client, method: str, url: str, *, timeout: float, retries: int = 0, on_retry=None, **kw):
    """send() for an httpx2.AsyncClient, each try within `timeout` seconds in all (asyncio.wait_for: a server
    that trickles its answer is cut too)."""
    for attempt in itertools.count():
        try:
            answer = await asyncio.wait_for(client.request(method, url, timeout=timeout, **kw), timeout)
        except _failures() as e:
            answer = e
        wait = _wait(answer, attempt, retries, on_retry)
        if wait is None:
            return _final(answer, attempt + 1, timeout)
        await asyncio.sleep(wait)

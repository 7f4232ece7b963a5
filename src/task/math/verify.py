"""The math verifier (SPEC 12): the last boxed answer, checked against the reference with math-verify,
every call bounded in size, time and memory.

The response is untrusted model output. Extraction here is a linear scan for the last `\\boxed{` (or
`\\fbox{`) and its balanced closing brace. An answer over `max_answer_chars` is refused unparsed. The
rest runs in a `worker.py` process: math-verify parses both sides with sympy, which can stall on
hostile input (huge powers, deep nesting), and its own timeouts use SIGALRM, which works only in
the main thread. So each call goes to a worker process with a hard wall-clock bound (`timeout_s`),
checked from whichever thread calls; a worker past it is killed and replaced, and a worker caps its
own address space (`memory_mb`), so an answer that allocates without bound ends in its MemoryError,
not in the trainer's. A call that exceeds a bound scores 0.0 and its reason is logged. Messages to
and from the worker are JSON lines: nothing is evaluated or unpickled.

Two exact fast paths never reach a worker: equal answers after removing whitespace, and two plain
integers (compared as digit strings).
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import re
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BOXED_OPENERS = ("\\boxed{", "\\fbox{")
WORKER = Path(__file__).with_name("worker.py")
STARTUP_TIMEOUT_S = 120.0  # importing sympy and math-verify on a loaded 2-core machine

REWARD_CORRECT = 1.0
REWARD_NONE = 0.0

# Why the verifier gave its reward: one reason per response.
REASON_CORRECT = "correct"
REASON_NO_BOXED = "no_boxed"              # no complete \boxed{...} (or \fbox{...}) in the response
REASON_EMPTY = "empty_answer"             # the last box holds only whitespace
REASON_TOO_LONG = "too_long"              # longer than max_answer_chars: refused unparsed
REASON_UNPARSEABLE = "unparseable"        # math-verify found no mathematical object in it
REASON_WRONG = "wrong"                    # parsed, not equivalent to the reference
REASON_TIMEOUT = "timeout"                # the worker ran past timeout_s and was replaced
REASON_ERROR = "verifier_error"           # the worker ran out of memory, failed or died
REASON_BAD_REFERENCE = "reference_unparseable"  # the data's reference answer does not parse (a data problem)
REASONS = (REASON_CORRECT, REASON_NO_BOXED, REASON_EMPTY, REASON_TOO_LONG, REASON_UNPARSEABLE, REASON_WRONG,
           REASON_TIMEOUT, REASON_ERROR, REASON_BAD_REFERENCE)

_INTEGER = re.compile(r"[+-]?\d{1,100}")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class MathVerdict:
    """The verifier's outcome: reward, the reason for it, and the extracted answer (None without a box)."""

    reward: float
    reason: str
    answer: str | None = None


def last_boxed(response: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}` with balanced braces, or None.

    Linear: `rfind` for the last opener, one scan to its closing brace. Escaped braces (`\\{`, `\\}`, as
    in a set `\\{1, 2\\}`) do not count. An unclosed last box (a truncated response) gives None.
    """
    start = max(response.rfind(opener) for opener in BOXED_OPENERS)
    if start < 0:
        return None
    begin = response.index("{", start) + 1
    depth, index, n = 1, begin, len(response)
    while index < n:
        char = response[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return response[begin:index].strip()
        index += 1
    return None


def fast_verdict(gold: str, answer: str) -> bool | None:
    """True/False where an exact check decides (equal text, or two integers), None where math-verify must."""
    gold_text, answer_text = _SPACE.sub("", gold), _SPACE.sub("", answer)
    if gold_text == answer_text:
        return True
    if _INTEGER.fullmatch(gold_text) and _INTEGER.fullmatch(answer_text):
        return _integer_key(gold_text) == _integer_key(answer_text)
    return None


def _integer_key(text: str) -> tuple[bool, str]:
    # Digit strings, never int(): a 100-digit answer costs nothing this way.
    negative = text.startswith("-")
    digits = text.lstrip("+-").lstrip("0") or "0"
    return (negative and digits != "0", digits)


class _Worker:
    """One worker process and its pipes; killed on a timeout, replaced by the pool."""

    def __init__(self, memory_mb: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(WORKER), str(int(memory_mb))], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1, close_fds=True)
        self.ready = False

    def _read_line(self, timeout: float) -> str | None:
        """One line from the worker within `timeout` seconds; None if none came (or the worker died)."""
        readable, _, _ = select.select([self.process.stdout], [], [], max(timeout, 0.0))
        if not readable:
            return None
        line = self.process.stdout.readline()
        return line or None

    def wait_ready(self) -> None:
        """Wait for the worker's imports (once), so that the time bound of a call never includes them."""
        if not self.ready:
            if self._read_line(STARTUP_TIMEOUT_S) != "ready\n":
                raise RuntimeError(f"the math verifier worker ({WORKER}) did not start; is math-verify installed?")
            self.ready = True

    def ask(self, gold: str, answer: str, timeout: float) -> dict | None:
        """The worker's reply, or None past `timeout` (the caller then kills this worker)."""
        try:
            self.process.stdin.write(json.dumps({"gold": gold, "answer": answer}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return {"error": "worker died"}
        line = self._read_line(timeout)
        if line is None:
            return None if self.process.poll() is None else {"error": "worker died"}
        return json.loads(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class BoundedVerifier:
    """A small pool of math-verify worker processes, each call bounded in time and memory; thread-safe."""

    def __init__(self, workers: int = 2, timeout_s: float = 1.0, memory_mb: int = 1024) -> None:
        self.size, self.timeout_s, self.memory_mb = int(workers), float(timeout_s), int(memory_mb)
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._started = False
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.timeouts = 0
        self.worst_seconds = 0.0

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                for _ in range(self.size):
                    self._idle.put(_Worker(self.memory_mb))
                self._executor = ThreadPoolExecutor(self.size, thread_name_prefix="math-verify")
                atexit.register(self.close)
                self._started = True

    def equivalent(self, gold: str, answer: str) -> tuple[bool, str]:
        """(correct, reason) for one pair through a worker: correct, wrong, unparseable, timeout, error."""
        self._start()
        worker = self._idle.get()
        try:
            worker.wait_ready()
            started = time.perf_counter()
            reply = worker.ask(gold, answer, self.timeout_s)
        except Exception:
            worker.kill()
            self._idle.put(_Worker(self.memory_mb))
            raise
        seconds = time.perf_counter() - started
        self.worst_seconds = max(self.worst_seconds, seconds)
        if reply is None or reply.get("error") == "worker died":
            worker.kill()
            self._idle.put(_Worker(self.memory_mb))
            self.timeouts += reply is None
            reason = REASON_TIMEOUT if reply is None else REASON_ERROR
            log.warning("math verifier: answer %r scored 0 (%s after %.2fs; worker replaced)", answer[:80], reason,
                        seconds)
            return False, reason
        self._idle.put(worker)
        if reply.get("error"):
            log.warning("math verifier: answer %r scored 0 (%s)", answer[:80], reply["error"])
            return False, REASON_ERROR
        if reply["correct"]:
            return True, REASON_CORRECT
        if not reply["gold_parsed"]:
            log.warning("math verifier: the reference answer %r does not parse; every response to it scores 0",
                        gold[:80])
            return False, REASON_BAD_REFERENCE
        return False, REASON_WRONG if reply["parsed"] else REASON_UNPARSEABLE

    def map(self, pairs: list[tuple[str, str]]) -> list[tuple[bool, str]]:
        """`equivalent` over many pairs, spread over the workers."""
        if not pairs:
            return []
        self._start()
        return list(self._executor.map(lambda pair: self.equivalent(*pair), pairs))

    def close(self) -> None:
        """Stop the workers (also at interpreter exit)."""
        with self._lock:
            if not self._started:
                return
            self._executor.shutdown(wait=True)
            while not self._idle.empty():
                self._idle.get().kill()
            self._started = False


class MathVerifier:
    """Reward of a response against a reference answer: 1.0 equivalent, else 0.0 (or `format_reward`
    for a boxed, parseable but wrong answer, off by default as in seed 003)."""

    def __init__(self, timeout_s: float = 1.0, max_answer_chars: int = 1000, memory_mb: int = 1024,
                 workers: int = 2, format_reward: float = 0.0) -> None:
        self.max_answer_chars, self.format_reward = int(max_answer_chars), float(format_reward)
        self.pool = BoundedVerifier(workers, timeout_s, memory_mb)

    def precheck(self, response: str, gold: str) -> MathVerdict | tuple[str, str]:
        """A verdict decided without math-verify, or the (gold, answer) pair it must decide."""
        answer = last_boxed(response)
        if answer is None:
            return MathVerdict(REWARD_NONE, REASON_NO_BOXED)
        if not answer:
            return MathVerdict(REWARD_NONE, REASON_EMPTY, answer)
        if len(answer) > self.max_answer_chars:
            log.warning("math verifier: answer of %d characters scored 0 (max_answer_chars=%d)", len(answer),
                        self.max_answer_chars)
            return MathVerdict(REWARD_NONE, REASON_TOO_LONG, answer)
        exact = fast_verdict(gold, answer)
        if exact is not None:
            return MathVerdict(REWARD_CORRECT if exact else self.format_reward,
                               REASON_CORRECT if exact else REASON_WRONG, answer)
        return gold, answer

    def verify_all(self, responses: list[str], gold: str) -> list[MathVerdict]:
        """Verdicts for responses to one problem; the undecided ones go to the workers together."""
        verdicts = [self.precheck(response, gold) for response in responses]
        pending = [index for index, verdict in enumerate(verdicts) if isinstance(verdict, tuple)]
        for index, (correct, reason) in zip(pending, self.pool.map([verdicts[i] for i in pending])):
            answer = verdicts[index][1]
            reward = REWARD_CORRECT if correct else self.format_reward if reason == REASON_WRONG else REWARD_NONE
            verdicts[index] = MathVerdict(reward, reason, answer)
        return verdicts

    def verify(self, response: str, gold: str) -> MathVerdict:
        return self.verify_all([response], gold)[0]

    def close(self) -> None:
        self.pool.close()

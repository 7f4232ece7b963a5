"""The math verifier's worker process: math-verify on one (gold, answer) pair per line, nothing else.

Started by `src.task.math.verify.BoundedVerifier` as `python -I worker.py MEMORY_MB` (by path, isolated:
it imports only the standard library and math-verify, never the project). It caps its own address
space at MEMORY_MB (RLIMIT_AS), prints "ready", then answers each request line, a JSON object
{"gold": ..., "answer": ...}, with one JSON line {"correct", "parsed", "gold_parsed", "error"}. The
parent kills and replaces it when an answer runs past the time bound, so math-verify's own signal
timeouts are off here. JSON both ways: nothing the model wrote is ever unpickled or evaluated.

Only LaTeX extraction is enabled: math-verify's plain-expression extraction hands the matched text to
sympy's `parse_expr`, which evaluates Python code; its LaTeX path builds sympy objects from an ANTLR
parse tree and evaluates nothing.
"""

import json
import logging
import resource
import sys
from functools import lru_cache


WARM_UP = (("\\frac{1}{2}", "0.5"), ("2\\sqrt{2}", "\\sqrt{8}"), ("[1,2)", "(1,2]"), ("\\{1,2\\}", "\\{2,1\\}"),
           ("x=3", "3"), ("(x+1)^2", "x^2+2x+1"), ("5\\text{ cm}", "5^\\circ"), ("\\binom{5}{2}", "3!"))


def _limit_memory(megabytes: int) -> None:
    if megabytes > 0:
        limit = megabytes * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _without_percent(text: str) -> str:
    # math-verify reads "25\%" as 25 only on its plain-expression path (disabled, see above): the same here.
    return text.replace("\\%", "").replace("%", "")


def main() -> None:
    from math_verify import LatexExtractionConfig, parse, verify

    logging.disable(logging.CRITICAL)  # math-verify warns that its timeouts are off: the parent bounds time
    extraction = [LatexExtractionConfig(boxed_match_priority=0)]

    def parsed(text: str) -> list:
        return parse("$" + _without_percent(text) + "$", extraction_config=extraction, parsing_timeout=None)

    parsed_gold = lru_cache(maxsize=256)(lambda text: tuple(parsed(text)))
    # First calls pay for sympy's lazy imports, the extraction regexes and the ANTLR parser (about 0.4 s
    # idle, seconds on a loaded machine): paid here, before "ready", never inside a call's time bound.
    for gold, answer in WARM_UP:
        verify(parsed(gold), parsed(answer), timeout_seconds=None)
    _limit_memory(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print("ready", flush=True)
    for line in sys.stdin:
        reply = {"correct": False, "parsed": False, "gold_parsed": False, "error": ""}
        try:
            request = json.loads(line)
            gold = list(parsed_gold(str(request["gold"])))
            answer = parsed(str(request["answer"]))
            reply["gold_parsed"] = any(not isinstance(item, str) for item in gold)
            reply["parsed"] = any(not isinstance(item, str) for item in answer)
            reply["correct"] = bool(gold and answer and verify(gold, answer, timeout_seconds=None))
        except MemoryError:
            reply["error"] = "memory"
        except Exception as error:  # noqa: BLE001  (any failure on hostile input scores 0 with its name)
            reply["error"] = type(error).__name__
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()

"""ZIP-RC-Lite's live adaptive decoder (seed 004 section 3.2, Table 4, appendix B.5).

K samples of one prompt decode in parallel over one KV cache: the prompt is encoded once and its
cache repeated K times (the shared prefix). Every step reads the reserved slice live (V-hat and
E[remaining length] per sample, from the same forward as the next-token logits), masks the slice to
-inf before sampling, and lets a meta-policy abandon samples:

- none: best-of-N, every sample to completion;
- prune: from `warmup` on, every `interval` steps, abandon active samples whose smoothed V-hat < `threshold`
  (0.5, the paper's "predicted losers"), lowest first, keeping at least `k_min` samples not abandoned;
  `threshold=None` abandons down to `k_min` whatever V-hat says (the always-prune control);
- early_stop: once the best active sample's smoothed V-hat reaches `tau`, commit to it and abandon the
  other active ones. The answer is the committed sample (`answer="committed"`, seed 004 l.116: "commit to
  it ... finishing as soon as that trajectory completes") or, reading l.123's selection rule for every
  policy, the finished sample with the best `value_end`, those finished before the commit included
  (`answer="best_finished"`);
- utility: on prune's schedule, abandon active sample j while U(S) - U(S \\ {j}) < 0, where
  U(S) = 1 - prod_i (1 - v_i) - beta * sum_i E[l_i] / l_max - gamma * max_i E[l_i] / l_max over the
  samples S not abandoned (finished ones with E[l] = 0). With gamma = 0 this is the paper's rule: keep j
  iff v_j prod_{i != j} (1 - v_i) > beta * E[l_j] / l_max.

Smoothed V-hat: the mean of a sample's last `window` values. Selection: among finished samples not
abandoned, the highest `value_end` (mean V-hat over its last 16 positions). Cost: active forward
passes (a sample stops counting once finished or abandoned; the shared prompt encoding counts once);
latency: decode steps until no sample is active.

The random-V-hat control (`values="random"`) hands every decision and the selection the head's own
numbers, reassigned at random among the samples they are read for: the same level and spread, so
thresholds fire as often, but no information about which sample is which.

The bookkeeping (`run_decode`) takes a `step` function, so the same code runs with the model
(`model_step`) and with a hand-made value trace in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import random

import torch

from src.rollout.interface import STOP_STRING, closing_tokens
from src.ziprc.metrics import value_end

PRUNE_THRESHOLD = 0.5  # prune abandons predicted losers only (paper: V-hat < 0.5)
META_POLICIES = ("none", "prune", "early_stop", "utility")
VALUE_SOURCES = ("head", "random")  # random: the random-V-hat control
EARLY_STOP_ANSWERS = ("committed", "best_finished")


@dataclass(frozen=True)
class MetaPolicy:
    kind: str = "none"
    warmup: int = 128
    interval: int = 32
    k_min: int = 2
    window: int = 4
    tau: float = 0.8
    beta: float = 0.02
    gamma: float = 0.0
    max_length: int = 1024  # l_max: normalises the expected remaining lengths in U(S)
    threshold: float | None = PRUNE_THRESHOLD  # prune: abandon below it; None: always prune down to k_min
    values: str = "head"  # "random": the head's numbers reassigned at random among the samples (control)
    answer: str = "committed"  # early_stop's answer: the committed sample (l.116) or the best finished (l.123)

    def __post_init__(self):
        for key, value, choices in (("meta-policy", self.kind, META_POLICIES), ("values", self.values, VALUE_SOURCES),
                                    ("answer", self.answer, EARLY_STOP_ANSWERS)):
            if value not in choices:
                raise ValueError(f"ziprc {key} '{value}': choose one of {', '.join(choices)}")


ACTIVE, FINISHED, ABANDONED = "active", "finished", "abandoned"


@dataclass
class DecodeState:
    """Per-sample status and value traces of one prompt's K samples, plus the cost and latency so far."""

    k: int
    status: list[str] = field(default_factory=list)
    values: list[list[float]] = field(default_factory=list)
    remaining: list[float] = field(default_factory=list)  # latest E[remaining length] per sample
    committed: int | None = None
    cost: int = 0      # active forward passes
    latency: int = 0   # decode steps

    def __post_init__(self):
        self.status = [ACTIVE] * self.k
        self.values = [[] for _ in range(self.k)]
        self.remaining = [0.0] * self.k

    def rows(self, status: str) -> list[int]:
        return [j for j in range(self.k) if self.status[j] == status]

    def smoothed(self, j: int, window: int) -> float:
        return sum(self.values[j][-window:]) / len(self.values[j][-window:])


def utility(values: list[float], remaining: list[float], beta: float, gamma: float, max_length: int) -> float:
    """U(S) = E[max reward] - beta * sum E[l] / l_max - gamma * max E[l] / l_max, E[max] = 1 - prod(1 - v)."""
    if not values:
        return 0.0
    miss = 1.0
    for v in values:
        miss *= 1.0 - v
    return 1.0 - miss - beta * sum(remaining) / max_length - gamma * max(remaining) / max_length


def signal(policy: MetaPolicy, rows: list[int], read, rng: random.Random | None) -> dict[int, float]:
    """`read(j)` for each row; under the random-V-hat control the same numbers, shuffled among the rows."""
    values = {j: read(j) for j in rows}
    if policy.values == "random" and len(rows) > 1:
        shuffled = list(values.values())
        (rng or random.Random(0)).shuffle(shuffled)
        values = dict(zip(rows, shuffled))
    return values


def decide(policy: MetaPolicy, state: DecodeState, step: int, rng: random.Random | None = None) -> list[int]:
    """The active samples the meta-policy abandons after decode step `step` (1-based), in order."""
    active = state.rows(ACTIVE)
    if policy.kind == "none" or not active or state.committed is not None:
        return []
    smooth = signal(policy, active, lambda j: state.smoothed(j, policy.window), rng)
    if policy.kind == "early_stop":
        best = max(active, key=smooth.get)
        if smooth[best] >= policy.tau:
            state.committed = best
            return [j for j in active if j != best]
        return []
    if step < policy.warmup or (step - policy.warmup) % policy.interval:
        return []
    alive = len(active) + len(state.rows(FINISHED))
    if policy.kind == "prune":
        abandoned: list[int] = []
        for j in sorted(active, key=smooth.get):
            above = policy.threshold is not None and smooth[j] >= policy.threshold
            if above or alive - len(abandoned) <= policy.k_min:
                break
            abandoned.append(j)
        return abandoned
    finished = signal(policy, state.rows(FINISHED), lambda j: value_end(state.values[j]), rng)
    return _utility_drops(policy, state, smooth, finished, alive)


def _utility_drops(policy: MetaPolicy, state: DecodeState, smooth: dict[int, float], finished: dict[int, float],
                   alive: int) -> list[int]:
    """Greedily drop the active sample whose removal raises U(S) most, while any removal does."""
    kept = {j: (value, state.remaining[j]) for j, value in smooth.items()}
    kept.update({j: (value, 0.0) for j, value in finished.items()})  # a finished sample costs nothing more
    abandoned: list[int] = []
    while alive - len(abandoned) > policy.k_min:
        def u(rows):
            return utility([kept[r][0] for r in rows], [kept[r][1] for r in rows], policy.beta, policy.gamma,
                           policy.max_length)
        full = u(kept)
        gains = {j: u([r for r in kept if r != j]) - full for j in kept if j in smooth}
        if not gains:
            break
        drop, gain = max(gains.items(), key=lambda item: item[1])
        if gain <= 0:
            break
        abandoned.append(drop)
        del kept[drop]
    return abandoned


def select(policy: MetaPolicy, state: DecodeState, ends: tuple[float, ...], rng: random.Random | None) -> int | None:
    """The answer: early_stop's committed sample (answer="committed"), else the finished, not abandoned sample
    with the highest value_end."""
    if policy.kind == "early_stop" and policy.answer == "committed" and state.committed is not None:
        return state.committed
    candidates = signal(policy, state.rows(FINISHED), lambda j: ends[j], rng)
    return max(candidates, key=candidates.get) if candidates else None


# step(states) -> per prompt (values, expected remaining, finished now), each a list of K; read for active samples.
StepFn = Callable[[list[DecodeState]], list[tuple[list[float], list[float], list[bool]]]]


@dataclass(frozen=True)
class DecodeResult:
    selected: int | None      # the answer (see `select`): None when no sample finished
    status: tuple[str, ...]
    value_ends: tuple[float, ...]
    cost: int
    latency: int
    abandoned_at: tuple[int | None, ...]  # decode step each sample was abandoned at


def run_decode(k: int, first: list[tuple[list[float], list[float]]], step: StepFn, policy: MetaPolicy,
               max_steps: int, rng: random.Random | None = None) -> list[DecodeResult]:
    """Decode several prompts' K samples in lockstep until none is active (or `max_steps`).

    `first[p]` is prompt p's (values, expected remaining) at the prompt itself. The meta-policy acts on
    each prompt after every step; a prompt's latency counts the steps while it still had an active sample.
    `rng` shuffles V-hat under the random-V-hat control.
    """
    rng = rng or random.Random(0)
    states = [DecodeState(k) for _ in first]
    abandoned_at: list[list[int | None]] = [[None] * k for _ in first]
    for state, (values, remaining) in zip(states, first):
        for j in range(k):  # the value at the prompt itself (shared prefix)
            state.values[j].append(values[j])
            state.remaining[j] = remaining[j]
        state.cost = 1  # the prompt, encoded once for all K samples
    for number in range(1, max_steps + 1):
        running = [state for state in states if state.rows(ACTIVE)]
        if not running:
            break
        actives = [state.rows(ACTIVE) for state in states]
        for state, active in zip(states, actives):
            if active:
                state.latency += 1
                state.cost += len(active)
        outputs = step(states)
        for p, (state, active, (values, remaining, finished)) in enumerate(zip(states, actives, outputs)):
            for j in active:
                state.values[j].append(values[j])
                state.remaining[j] = remaining[j]
                if finished[j] or number == max_steps:
                    state.status[j] = FINISHED
            for j in decide(policy, state, number, rng):
                state.status[j] = ABANDONED
                abandoned_at[p][j] = number
    results = []
    for state, abandoned in zip(states, abandoned_at):
        ends = tuple(value_end(v) for v in state.values)
        selected = select(policy, state, ends, rng)
        results.append(DecodeResult(selected, tuple(state.status), ends, state.cost, state.latency, tuple(abandoned)))
    return results


# --------------------------------------------------------------------------- the model-backed step


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int | None,
                generator: torch.Generator) -> torch.Tensor:
    """One token per row from logits (rows x vocab) with temperature, top-k and top-p filtering."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        probabilities = torch.softmax(ordered, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first token always stays).
        drop = probabilities.cumsum(-1) - probabilities > top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


@dataclass
class LiveDecode:
    """Everything one prompt's live decode produced (token ids per sample, the verdict is the caller's)."""

    result: DecodeResult
    response_ids: list[list[int]]
    texts: list[str]
    prompt_value: float  # V-hat(x) at the prompt: the adaptive-K difficulty signal


def stop_token_ids(tokenizer) -> set[int]:
    """EOS plus the chat turn end: Qwen2.5's chat model ends a turn with <|im_end|>, not <|endoftext|> (B.5)."""
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|endoftext|>"):
        found = tokenizer.convert_tokens_to_ids(token)
        if isinstance(found, int) and found != tokenizer.unk_token_id:
            ids.add(found)
    return ids - {None}


@torch.no_grad()
def decode_prompts(head, tokenizer, prompts: list[list[int]], k: int, policy: MetaPolicy, *, temperature: float,
                   top_p: float, top_k: int | None, max_new_tokens: int, seed: int) -> list[LiveDecode]:
    """Live K-parallel decode of prompts of one length (no padding), batched together; see the module docstring.

    Each prompt is encoded once and its KV cache repeated K times; all prompts' samples then step
    together, so a step is one forward pass of (prompts x K) rows.
    """
    from src.ziprc.head import value_and_length

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("decode_prompts takes prompts of one token length (group them: see decode_all)")
    device = next(head.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    closing = closing_tokens(tokenizer)
    stop_ids = stop_token_ids(tokenizer)
    reserved = list(head.spec.ids)
    logits, slice_logits, cache = head(torch.tensor(prompts, device=device), use_cache=True)
    cache.batch_repeat_interleave(k)  # one encoding per prompt, shared by its K samples (rows p*K .. p*K+K-1)
    last = logits[:, -1].repeat_interleave(k, dim=0)
    value, length = value_and_length(slice_logits[:, -1], head.spec)
    responses: list[list[int]] = [[] for _ in range(len(prompts) * k)]
    position = len(prompts[0])
    pad = tokenizer.pad_token_id

    def step(states: list[DecodeState]):
        nonlocal last, position, cache
        masked = last.clone()
        masked[:, reserved] = float("-inf")  # the live decoder never emits a reserved id
        tokens = sample_next(masked, temperature, top_p, top_k, generator).cpu()
        feed = torch.full((len(tokens),), pad, dtype=torch.long)
        finished = [[False] * k for _ in states]
        for p, state in enumerate(states):
            for j in state.rows(ACTIVE):
                row, token = p * k + j, int(tokens[p * k + j])
                responses[row].append(token)
                feed[row] = token
                finished[p][j] = token in stop_ids or (bool(closing[token])
                                                       and STOP_STRING in tokenizer.decode(responses[row]))
        # Abandoned and finished samples still ride in the batch (fed padding, not counted), as in the paper.
        positions = torch.full((len(tokens), 1), position, device=device)
        logits, slice_logits, cache = head(feed[:, None].to(device), past_key_values=cache, use_cache=True,
                                           position_ids=positions)
        position += 1
        last = logits[:, -1]
        values, remaining = value_and_length(slice_logits[:, -1], head.spec)
        values, remaining = values.view(len(states), k).tolist(), remaining.view(len(states), k).tolist()
        return [(values[p], remaining[p], finished[p]) for p in range(len(states))]

    first = [([float(value[p])] * k, [float(length[p])] * k) for p in range(len(prompts))]
    results = run_decode(k, first, step, policy, max_new_tokens, rng=random.Random(seed))
    return [LiveDecode(result, responses[p * k : (p + 1) * k],
                       [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses[p * k : (p + 1) * k]],
                       float(value[p])) for p, result in enumerate(results)]


def decode_all(head, tokenizer, prompts: list[list[int]], k: int, policy: MetaPolicy, *, seed: int,
               **sampling) -> list[LiveDecode]:
    """`decode_prompts` over prompts of any lengths: one batch per length, results in the prompts' order."""
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    out: list[LiveDecode | None] = [None] * len(prompts)
    for length, indices in sorted(by_length.items()):
        decoded = decode_prompts(head, tokenizer, [prompts[i] for i in indices], k, policy,
                                 seed=seed * 1_000_003 + length, **sampling)
        for index, item in zip(indices, decoded):
            out[index] = item
    return out

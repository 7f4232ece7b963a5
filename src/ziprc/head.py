"""ZIP-RC-Lite's reserved-logit head (seed 004 section 3.2, appendix B.5): the joint of final reward and remaining length.

A frozen policy gets R x L extra logits at reserved token ids; their softmax is the predicted joint
p(reward state b, remaining-length bin l | prefix), flattened as idx = l + b * L (length fastest).
The slice is computed from the same last hidden state as the next-token logits, so reading it costs
no extra forward pass.

Reserving ids without touching the policy:
- Qwen2.5 (vocabulary 151,936, tokenizer names ids up to 151,664): the slice sits at ids 151,665 on,
  inside the existing vocabulary (`reserved_start=151665`; the upstream default 151,669 is a Qwen3 id).
- The tiny policy's 201 ids are all real tokens: the slice is appended after them
  (`reserved_start=null` means "at the vocabulary's end"), so no existing token changes its id.

The real next-token logits come from the policy's own, untouched output layer; the slice has its own
weight matrix, cloned from the output rows at the reserved ids where they exist (zeros where the ids are
new). That is the paper's "untie and clone": with tied embeddings, training the output rows would move
the input embeddings too. Only the slice is trainable, so the policy's next-token distribution over its
real vocabulary is exactly the policy's own (tested bitwise in fp32).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

# Paper Table 7: startup bin plus powers of two; Countdown responses live well below 1024 tokens.
PAPER_LENGTH_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024)
BINARY_REWARDS = (0.0, 1.0)
STRUCTURED_REWARDS = (0.0, 0.1, 1.0)  # incoherent / coherent-but-wrong / correct (the verifier's 0.0 / 0.1 / 1.0)
QWEN25_RESERVED_START = 151_665


@dataclass(frozen=True)
class SliceSpec:
    """Where the slice sits and what its R x L cells mean."""

    start: int                          # first reserved id
    reward_values: tuple[float, ...]    # r_b per reward state, ascending (R of them)
    length_edges: tuple[int, ...]       # L + 1 edges of the remaining-length bins; the last bin is open-ended

    @property
    def R(self) -> int:
        return len(self.reward_values)

    @property
    def L(self) -> int:
        return len(self.length_edges) - 1

    @property
    def size(self) -> int:
        return self.R * self.L

    @property
    def ids(self) -> range:
        return range(self.start, self.start + self.size)

    def bin_midpoints(self) -> torch.Tensor:
        edges = torch.tensor(self.length_edges, dtype=torch.float32)
        return (edges[:-1] + edges[1:]) / 2


def length_bin(remaining: int, edges: tuple[int, ...]) -> int:
    """Index of the bin [edges[i], edges[i+1]) holding `remaining` tokens; beyond the last edge: the last bin."""
    if remaining < edges[0]:
        raise ValueError(f"remaining length {remaining} is below the first bin edge {edges[0]}")
    for index in range(len(edges) - 1):
        if remaining < edges[index + 1]:
            return index
    return len(edges) - 2


def reward_state(reward: float, reward_values: tuple[float, ...]) -> int:
    """The reward state of a verifier reward: binary heads map every failure (0.0 or 0.1) to state 0."""
    if len(reward_values) == 2:
        return int(reward >= reward_values[1])
    for index, value in enumerate(reward_values):
        if abs(reward - value) < 1e-9:
            return index
    raise ValueError(f"reward {reward} is none of the structured states {reward_values}")


def joint_index(state: int, bin_index: int, L: int) -> int:
    """Flattened cell of (reward state, length bin): idx = length bin + reward state x L (appendix B.5)."""
    return bin_index + state * L


def value_and_length(slice_logits: torch.Tensor, spec: SliceSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(V = E[reward], E[remaining length]) from slice logits (..., R*L): marginals of the softmax joint."""
    joint = torch.softmax(slice_logits.float(), dim=-1).unflatten(-1, (spec.R, spec.L))
    rewards = torch.tensor(spec.reward_values, dtype=joint.dtype, device=joint.device)
    value = (joint.sum(-1) * rewards).sum(-1)
    length = (joint.sum(-2) * spec.bin_midpoints().to(joint.device)).sum(-1)
    return value, length


class ReservedSliceHead(nn.Module):
    """A frozen policy plus a trainable R x L slice read from its last hidden state.

    `forward` returns (logits over real vocabulary + slice, slice logits, cache). The real logits are
    the policy's own output layer applied to the backbone's hidden state, i.e. exactly what
    `policy(...).logits` computes.
    """

    def __init__(self, policy: nn.Module, spec: SliceSpec):
        super().__init__()
        self.policy, self.spec = policy, spec
        for parameter in policy.parameters():
            parameter.requires_grad_(False)
        output = policy.get_output_embeddings()
        hidden = output.weight.shape[1]
        self.vocab = output.weight.shape[0]
        if spec.start > self.vocab:
            raise ValueError(f"reserved_start={spec.start} leaves a gap after the vocabulary of {self.vocab}: "
                             f"use an id <= {self.vocab} (null appends the slice at the end)")
        self.slice = nn.Linear(hidden, spec.size, bias=False)
        with torch.no_grad():
            self.slice.weight.zero_()
            inside = max(0, min(spec.start + spec.size, self.vocab) - spec.start)
            # Clone (never share) the output rows at reserved ids that already exist (Qwen); new ids start at zero.
            self.slice.weight[:inside] = output.weight[spec.start : spec.start + inside].detach().clone()
        self.slice.to(output.weight.device)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False, position_ids=None):
        body = self.policy.get_decoder()
        out = body(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                   use_cache=use_cache, position_ids=position_ids)
        hidden = out.last_hidden_state
        real = self.policy.get_output_embeddings()(hidden)
        slice_logits = self.slice(hidden)
        start, end = self.spec.start, self.spec.start + self.spec.size
        logits = torch.cat([real[..., :start], slice_logits.to(real.dtype), real[..., end:]], dim=-1)
        return logits, slice_logits, out.past_key_values

    def hidden_states(self, input_ids, attention_mask=None) -> torch.Tensor:
        """The backbone's last hidden state (what the slice reads), without the vocabulary projection."""
        return self.policy.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    # Weights go to safetensors and the spec to JSON: nothing read back is ever unpickled.
    def save(self, folder: Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"slice.weight": self.slice.weight.detach().cpu().contiguous()}, str(folder / "head.safetensors"))
        (folder / "head.json").write_text(json.dumps(asdict(self.spec), indent=2))

    @classmethod
    def load(cls, policy: nn.Module, folder: Path) -> "ReservedSliceHead":
        folder = Path(folder)
        raw = json.loads((folder / "head.json").read_text())
        spec = SliceSpec(int(raw["start"]), tuple(float(v) for v in raw["reward_values"]),
                         tuple(int(e) for e in raw["length_edges"]))
        head = cls(policy, spec)
        weight = load_file(str(folder / "head.safetensors"))["slice.weight"]
        if tuple(weight.shape) != tuple(head.slice.weight.shape):
            raise ValueError(f"{folder}: slice weight {tuple(weight.shape)} does not fit the policy "
                             f"(expected {tuple(head.slice.weight.shape)}); train the head for this policy")
        with torch.no_grad():
            head.slice.weight.copy_(weight)
        return head


def make_spec(vocab_size: int, reserved_start: int | None, verifier: str, length_edges) -> SliceSpec:
    """The slice for a policy: `verifier` 'binary' (R=2) or 'structured' (R=3); start None = end of vocabulary."""
    rewards = {"binary": BINARY_REWARDS, "structured": STRUCTURED_REWARDS}.get(verifier)
    if rewards is None:
        raise ValueError(f"ziprc.verifier='{verifier}': choose binary (R=2) or structured (R=3)")
    edges = tuple(int(e) for e in length_edges)
    if len(edges) < 2 or list(edges) != sorted(set(edges)) or edges[0] != 0:
        raise ValueError(f"ziprc.length_edges={list(edges)}: strictly increasing bin edges starting at 0, "
                         f"e.g. {list(PAPER_LENGTH_EDGES)}")
    return SliceSpec(vocab_size if reserved_start is None else int(reserved_start), rewards, edges)

"""In-memory routing steps: what each forward pass sent to which logical expert.

Dimension letters: S steps, T token rows (over all steps), L MoE layers, K top-k, E logical experts.

A step is stored one of two ways:
* small steps (decode, verify) keep their token rows: ``topk_ids[T, L, K]`` logical ids, -1 = none.
  The row order matters: SGLang's ``dynamic`` dispatch picks a replica by token row.
* large steps (prefill) or steps known only as counts keep ``counts[S_c, L, E]`` tokens per expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from moeplace.errors import MoeplaceError
from moeplace.model.spec import ModelSpec


# RoutingSteps' arrays, in field order (what a trace chunk stores)
STEP_ARRAYS = ("modes", "num_tokens", "ranks", "token_offsets", "topk_ids", "count_steps", "counts")
COUNT_BLOCK = 1 << 18   # (row, layer, k) ids that expert_token_counts counts at once: a block stays in cache


@dataclass
class RoutingSteps:
    """A batch of steps of one trace, with logical expert ids.

    modes: [S] uint8 forward mode codes (``moeplace.trace.modes``)
    num_tokens: [S] int32 tokens in the forward pass
    ranks: [S] int16 rank that recorded the step
    token_offsets: [S+1] int64, rows ``token_offsets[s]:token_offsets[s+1]`` of ``topk_ids`` are step s
    topk_ids: [T, L, K] int16 logical expert ids, -1 = none
    count_steps: [S_c] int64 indices of steps stored as counts (they own no token rows)
    counts: [S_c, L, E] float64 tokens routed to each expert in those steps
    """

    model: ModelSpec
    modes: np.ndarray
    num_tokens: np.ndarray
    ranks: np.ndarray
    token_offsets: np.ndarray
    topk_ids: np.ndarray
    count_steps: np.ndarray
    counts: np.ndarray
    # expert_token_counts, kept for the arrays it was counted from (every placement of a fit asks for it)
    _expert_tokens: tuple = field(default=(), init=False, repr=False, compare=False)

    @property
    def num_steps(self) -> int:
        return int(self.modes.shape[0])

    @classmethod
    def empty(cls, model: ModelSpec) -> "RoutingSteps":
        L, K, E = model.num_moe_layers, model.top_k, model.num_experts
        return cls(model, np.zeros(0, np.uint8), np.zeros(0, np.int32), np.zeros(0, np.int16),
                   np.zeros(1, np.int64), np.zeros((0, L, K), np.int16), np.zeros(0, np.int64),
                   np.zeros((0, L, E), np.float64))

    @classmethod
    def from_topk(cls, model: ModelSpec, topk_ids: np.ndarray, tokens_per_step: np.ndarray,
                  modes: np.ndarray | int, ranks: np.ndarray | int = 0) -> "RoutingSteps":
        """Steps whose token rows are known. topk_ids: [T, L, K]; tokens_per_step: [S] summing to T."""
        tokens_per_step = np.asarray(tokens_per_step, np.int64)
        S = tokens_per_step.shape[0]
        offsets = np.zeros(S + 1, np.int64)
        np.cumsum(tokens_per_step, out=offsets[1:])
        steps = cls(model, np.broadcast_to(np.asarray(modes, np.uint8), (S,)).copy(),
                    tokens_per_step.astype(np.int32), np.broadcast_to(np.asarray(ranks, np.int16), (S,)).copy(),
                    offsets, np.asarray(topk_ids, np.int16), np.zeros(0, np.int64),
                    np.zeros((0, model.num_moe_layers, model.num_experts), np.float64))
        steps.validate()
        return steps

    @classmethod
    def from_counts(cls, model: ModelSpec, counts: np.ndarray, modes: np.ndarray | int,
                    num_tokens: np.ndarray | None = None, ranks: np.ndarray | int = 0) -> "RoutingSteps":
        """Steps known only as per-expert token counts. counts: [S, L, E]."""
        counts = np.asarray(counts, np.float64)
        S = counts.shape[0]
        if num_tokens is None:
            num_tokens = np.rint(counts.sum(axis=2).max(axis=1, initial=0) / model.top_k)
        steps = cls(model, np.broadcast_to(np.asarray(modes, np.uint8), (S,)).copy(),
                    np.asarray(num_tokens, np.int32), np.broadcast_to(np.asarray(ranks, np.int16), (S,)).copy(),
                    np.zeros(S + 1, np.int64), np.zeros((0, model.num_moe_layers, model.top_k), np.int16),
                    np.arange(S, dtype=np.int64), counts)
        steps.validate()
        return steps

    def validate(self) -> None:
        """Raise MoeplaceError if shapes or ids are inconsistent (readers call this at the boundary)."""
        m, S = self.model, self.num_steps
        L, K, E = m.num_moe_layers, m.top_k, m.num_experts
        if not (self.num_tokens.shape == self.ranks.shape == (S,) and self.token_offsets.shape == (S + 1,)):
            raise MoeplaceError("step arrays disagree in length")
        if self.topk_ids.ndim != 3 or self.topk_ids.shape[1:] != (L, K):
            raise MoeplaceError(f"top-k ids have shape {self.topk_ids.shape}, expected [T, {L}, {K}]")
        if self.token_offsets[0] != 0 or self.token_offsets[-1] != self.topk_ids.shape[0] \
                or np.any(np.diff(self.token_offsets) < 0):
            raise MoeplaceError("token offsets do not cover the top-k rows")
        if self.topk_ids.size and (self.topk_ids.min() < -1 or self.topk_ids.max() >= E):
            raise MoeplaceError(f"expert id out of range [0, {E}) in top-k ids")
        if self.counts.ndim != 3 or self.counts.shape[1:] != (L, E) or self.counts.shape[0] != self.count_steps.shape[0]:
            raise MoeplaceError(f"counts have shape {self.counts.shape}, expected [S_c, {L}, {E}]")
        if self.counts.size and not np.all(np.isfinite(self.counts)):
            raise MoeplaceError("counts contain NaN or infinity")
        if self.counts.size and self.counts.min() < 0:
            raise MoeplaceError("counts contain negative values")
        if self.count_steps.size and (self.count_steps.min() < 0 or self.count_steps.max() >= S):
            raise MoeplaceError("count step index out of range")

    def select(self, mask: np.ndarray) -> "RoutingSteps":
        """The steps where ``mask`` [S] is true, in order."""
        idx = np.flatnonzero(mask)
        return self.take(idx)

    def take(self, idx: np.ndarray) -> "RoutingSteps":
        """The steps ``idx`` (increasing indices) in that order."""
        idx = np.asarray(idx, np.int64)
        starts, ends = self.token_offsets[idx], self.token_offsets[idx + 1]
        lengths = ends - starts
        offsets = np.zeros(idx.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        rows = _ranges(starts, lengths)
        position = np.full(self.num_steps, -1, np.int64)
        position[idx] = np.arange(idx.size)
        keep = position[self.count_steps] >= 0
        return RoutingSteps(self.model, self.modes[idx], self.num_tokens[idx], self.ranks[idx], offsets,
                            self.topk_ids[rows], position[self.count_steps[keep]], self.counts[keep])

    def slice(self, start: int, stop: int) -> "RoutingSteps":
        """Steps ``start:stop`` as views of these arrays, not copies (a split of a large trace in two
        would otherwise hold it twice)."""
        rows = slice(int(self.token_offsets[start]), int(self.token_offsets[stop]))
        counted = (self.count_steps >= start) & (self.count_steps < stop)
        return RoutingSteps(self.model, self.modes[start:stop], self.num_tokens[start:stop], self.ranks[start:stop],
                            self.token_offsets[start:stop + 1] - self.token_offsets[start], self.topk_ids[rows],
                            self.count_steps[counted] - start, self.counts[counted])

    def one_layer(self, layer: int) -> "RoutingSteps":
        """These steps with MoE layer ``layer`` alone (views, not copies; the model keeps that layer only): a
        search of one layer can take steps from it without copying every layer's routing."""
        model = replace(self.model, moe_layers=(self.model.moe_layers[layer],))
        return RoutingSteps(model, self.modes, self.num_tokens, self.ranks, self.token_offsets,
                            self.topk_ids[:, layer:layer + 1], self.count_steps, self.counts[:, layer:layer + 1])

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One MoE layer as (step of each token row [T], token row within its step [T], ids [T, K])."""
        T = self.topk_ids.shape[0]
        step_of_row = np.repeat(np.arange(self.num_steps), np.diff(self.token_offsets))
        row_in_step = np.arange(T) - self.token_offsets[step_of_row]
        return step_of_row, row_in_step, self.topk_ids[:, layer, :]

    def layer_pairs(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One MoE layer's valid (token row, top-k) entries in row order, as (step [N], token row within
        its step [N], expert [N] int64). Verify and decode steps have no -1 padding: then no mask is
        built, the larger part of the work on them."""
        step_of_row, row_in_step, ids = self.layer(layer)
        if ids.size == 0 or ids.min() >= 0:
            K = ids.shape[1]
            return np.repeat(step_of_row, K), np.repeat(row_in_step, K), ids.ravel().astype(np.int64)
        row = np.nonzero(ids >= 0)[0]
        return step_of_row[row], row_in_step[row], ids[ids >= 0].astype(np.int64)

    def expert_token_counts(self) -> np.ndarray:
        """[L, E] tokens routed to each logical expert over all steps (a new array each call; counted once)."""
        if self._expert_tokens and self._expert_tokens[0] is self.topk_ids and self._expert_tokens[1] is self.counts:
            return self._expert_tokens[2].copy()
        L, E = self.model.num_moe_layers, self.model.num_experts
        out = self.counts.sum(axis=0) if len(self.counts) else np.zeros((L, E))
        # one count over every layer, a block of token rows at a time: layer l's expert e is bin l * (E + 1)
        # + e + 1, and bin l * (E + 1) collects its -1 (no expert)
        T, _, K = self.topk_ids.shape
        bins = (np.arange(L, dtype=np.intp) * (E + 1) + 1)[None, :, None]
        tally = np.zeros(L * (E + 1), np.int64)
        rows = max(1, COUNT_BLOCK // max(L * K, 1))
        for lo in range(0, T, rows):
            tally += np.bincount((self.topk_ids[lo:lo + rows] + bins).ravel(), minlength=L * (E + 1))
        out += tally.reshape(L, E + 1)[:, 1:]
        self._expert_tokens = (self.topk_ids, self.counts, out.copy())
        return out


def concat_steps(parts: list[RoutingSteps]) -> RoutingSteps:
    """Join batches of the same model into one, in order."""
    if not parts:
        raise MoeplaceError("no steps to join")
    model = parts[0].model
    S_before = np.cumsum([0] + [p.num_steps for p in parts[:-1]])
    T_before = np.cumsum([0] + [p.topk_ids.shape[0] for p in parts[:-1]])
    offsets = np.concatenate([np.zeros(1, np.int64)] + [p.token_offsets[1:] + t for p, t in zip(parts, T_before)])
    return RoutingSteps(
        model,
        np.concatenate([p.modes for p in parts]), np.concatenate([p.num_tokens for p in parts]),
        np.concatenate([p.ranks for p in parts]), offsets,
        np.concatenate([p.topk_ids for p in parts]),
        np.concatenate([p.count_steps + s for p, s in zip(parts, S_before)]),
        np.concatenate([p.counts for p in parts]))


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(start, start + length)`` for each pair, vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(total) + offsets

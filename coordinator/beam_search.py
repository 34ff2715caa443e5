"""Beam search with the semantics of Hugging Face transformers' `generate(num_beams=B)`:
top max(2, 1 + #eos) * B continuations per step, hypotheses finished by EOS or a stop token
id (if among the top B; neither before min_tokens) or by reaching the length limit, scores =
sum of logprobs / generated_len ** length_penalty, and transformers' early-stopping heuristic
(early_stopping=False). Its repetition penalty applies to the step's log-probabilities, as
transformers' processor does in beam search; sampling fields do not apply (do_sample=False)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tapserve.api.wire import SequenceOutput
from tapserve.coordinator.row_selection import PendingRows
from tapserve.coordinator.sequence import Request, Sequence


@dataclass
class Hypothesis:
    score: float  # length-penalised
    token_ids: list[int]  # generated tokens
    finish_reason: str
    parent: int = -1  # position of its parent among the step's beams
    custom_output: dict | None = None  # LAST_GENERATED value, once scored
    rows: PendingRows | None = None  # a multi-row selection's rows of its history, once scored


@dataclass
class BeamState:
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True  # transformers' "early stop heuristic unsatisfied"


def length_normalized(score: float, length: int, penalty: float) -> float:
    """score / length ** penalty, as transformers scores a hypothesis; where the power
    overflows or underflows, its limit (the score 0 or -inf) instead of an exception."""
    try:
        denominator = float(length) ** penalty
    except OverflowError:
        denominator = math.inf
    if denominator == 0.0:
        return 0.0 if score == 0.0 else math.copysign(math.inf, score)
    return score / denominator


def _penalize_repeats(logprobs: torch.Tensor, beams: list[Sequence], penalty: float) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor on each beam's row, in place: every
    token of the beam (prompt and output) has its (log-probability) score multiplied by the
    penalty where negative, divided where positive."""
    for row, beam in enumerate(beams):
        ids = torch.tensor(sorted(set(beam.token_ids)), device=logprobs.device)
        seen = logprobs[row, ids]
        logprobs[row, ids] = torch.where(seen < 0, seen * penalty, seen / penalty)


class BeamSearch:
    def step(
        self,
        request: Request,
        beams: list[Sequence],
        logits: torch.Tensor,
        eos_token_ids: list[int],
        max_model_len: int,
    ) -> tuple[list[tuple[int, int, float]], bool]:
        """One step for all live beams of a request. Returns the running continuations
        (parent position, token, accumulated logprob), best first, and whether search is done."""
        p = request.params
        state = request.beam_state = request.beam_state or BeamState()
        num_beams, vocab = p.num_beams, logits.shape[-1]
        # a stop token id ends a hypothesis as an EOS does (an extra EOS id to transformers)
        eos = [] if p.ignore_eos else [t for t in eos_token_ids if t < vocab]
        eos += [t for t in p.stop_token_ids if t < vocab and t not in eos]
        acc = torch.log_softmax(logits.float(), dim=-1)
        if p.repetition_penalty != 1.0:
            _penalize_repeats(acc, beams, p.repetition_penalty)
        if eos and beams[0].num_output_tokens < p.min_tokens:  # transformers' min_new_tokens
            acc[:, eos] = float("-inf")
        acc += torch.tensor([b.cumulative_logprob for b in beams], device=acc.device)[:, None]
        k = min(max(2, 1 + len(eos)) * num_beams, acc.numel())
        top_scores, top_idx = acc.flatten().topk(k)
        gen_len = beams[0].num_output_tokens + 1
        at_limit = gen_len >= p.max_new_tokens or beams[0].num_tokens + 1 >= max_model_len
        running: list[tuple[int, int, float]] = []
        for rank, (score, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
            parent, token = divmod(idx, vocab)
            hits_eos = token in eos
            if hits_eos or at_limit:
                if rank < num_beams and state.improvable:
                    tokens = beams[parent].output_token_ids + [token]
                    reason = "stop" if hits_eos else "length"
                    state.finished.append(
                        Hypothesis(
                            length_normalized(score, gen_len, p.length_penalty),
                            tokens,
                            reason,
                            parent,
                        )
                    )
            elif len(running) < num_beams:
                running.append((parent, token, score))
        state.finished = sorted(state.finished, key=lambda h: -h.score)[:num_beams]
        if running and len(state.finished) == num_beams:
            best_possible = length_normalized(running[0][2], gen_len, p.length_penalty)
            state.improvable = state.improvable and best_possible > state.finished[-1].score
        done = at_limit or not running or not state.improvable
        return running, done

    @staticmethod
    def final_outputs(request: Request) -> list[SequenceOutput]:
        best = request.beam_state.finished[: request.params.n] if request.beam_state else []
        outputs = []
        for i, h in enumerate(best):
            rows, positions = h.rows.copy().take() if h.rows is not None else (None, None)
            outputs.append(
                SequenceOutput(
                    i,
                    h.token_ids,
                    None,
                    None,
                    h.finish_reason,
                    h.score,
                    h.custom_output,
                    rows,
                    positions,
                )
            )
        return outputs

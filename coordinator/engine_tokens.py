"""Turning a step's logits into tokens on rank 0 (TokenSteps, built and called by the Engine):
sampling, forks (n > 1), beams, appends, stop checks and finishing a sequence."""

from __future__ import annotations

import torch

from tapserve.api.detokenizer import Decoder
from tapserve.api.sampling_params import BatchDraw
from tapserve.coordinator.beam_search import BeamSearch
from tapserve.coordinator.blocks import BlockManager
from tapserve.coordinator.config import EngineOptions
from tapserve.coordinator.sampler import Sampler, SampleRow
from tapserve.coordinator.scheduler import Scheduler
from tapserve.coordinator.sequence import Request, SeqStatus, Sequence, SequenceFactory
from tapserve.coordinator.stop_strings import kept_output_tokens


class TokenSteps:
    """Sampling, appends, stop checks and finishes of the engine's sequences."""

    def __init__(
        self,
        sampler: Sampler,
        scheduler: Scheduler,
        blocks: BlockManager,
        seqs: SequenceFactory,
        beams: BeamSearch,
        options: EngineOptions,
        text_decoder: Decoder | None = None,
    ):
        """options: the engine's, read at each use; text_decoder: as Engine's."""
        self.sampler, self.scheduler, self.blocks = sampler, scheduler, blocks
        self.seqs, self.beams, self.options = seqs, beams, options
        self.text_decoder = text_decoder
        self.stop_cuts: list[tuple[Sequence, int]] = []  # (sequence, output tokens to keep)
        self.num_finished = 0  # sequences finished so far (AheadStep.num_finished_at_launch)

    # ---- sampling, forks, beams ---------------------------------------------------------
    def sample(self, logits: torch.Tensor, live: list[tuple[int, Sequence]]) -> list[int] | None:
        """Sample every live row; returns the tokens when one draw served the whole batch
        and no row needed a stop check (each sequence just gained its token)."""
        draws = {s.request.batch_draw for _, s in live}
        if BatchDraw.GENERAL not in draws:  # the usual decode step: one draw for the batch
            return self._draw_batch(logits, live, draws)
        if all([s.request.params.num_beams == 1 for _, s in live]):
            self._sample_rows(logits, live)  # no beams
            return None
        beam_groups: dict[Request, list[tuple[int, Sequence]]] = {}
        plain = []
        for i, seq in live:
            (
                beam_groups.setdefault(seq.request, [])
                if seq.request.params.num_beams > 1
                else plain
            ).append((i, seq))
        if plain:
            self._sample_rows(logits, plain)
        for request, group in beam_groups.items():
            idx = torch.tensor([i for i, _ in group], device=logits.device)
            self._apply_beam_step(request, [s for _, s in group], logits[idx])
        return None

    def _draw_batch(
        self, logits: torch.Tensor, items: list[tuple[int, Sequence]], draws: set[BatchDraw]
    ) -> list[int] | None:
        """One draw for rows that all have a fast batch_draw; the tokens if no row needed a
        stop check."""
        if len(items) != logits.shape[0]:
            logits = logits[torch.tensor([i for i, _ in items], device=logits.device)]
        if draws == {BatchDraw.GREEDY}:
            tokens = self.sampler.greedy(logits)
        elif draws == {BatchDraw.TEMPERATURE}:
            tokens = self.sampler.sample_temperature(
                logits, [s.request.params.temperature for _, s in items]
            )
        else:
            tokens = self.sampler.sample_plain(logits, [s.request.params for _, s in items])
        return tokens if self.append_plain(items, tokens) else None

    def _sample_rows(self, logits: torch.Tensor, items: list[tuple[int, Sequence]]) -> None:
        """A SampleRow per row; forks an unforked request into its n samples."""
        rows = [
            SampleRow(
                s.request.params,
                s.token_ids,
                s.num_prompt_tokens,
                self.options.eos_token_ids,
                seed_key=s.index,
                num_samples=1 if s.request.forked else s.request.params.n,
            )
            for _, s in items
        ]
        idx = torch.tensor([i for i, _ in items], device=logits.device)
        result = self.sampler(logits[idx], rows)
        for k, (_, seq) in enumerate(items):
            targets = [seq]
            if not seq.request.forked:
                targets += self._fork(seq, seq.request.params.n - 1)
                seq.request.forked = True
                seq.request.batch_draw = seq.request.fast_draw
            for j, target in enumerate(targets):
                top = result.top_logprobs[k][j] if result.top_logprobs else None
                self._append(target, result.token_ids[k][j], result.logprobs[k][j], top)

    def append_plain(self, items: list[tuple[int, Sequence]], tokens: list[int]) -> bool:
        """_append for plain-sampling sequences; True when no row needed the stop check."""
        plain = True
        for (_, seq), token in zip(items, tokens):
            token_ids = seq.token_ids
            token_ids.append(token)
            request = seq.request
            if token in request.stop_token_set or len(token_ids) >= request.max_total_tokens:
                self._check_stop(seq, token)
                plain = False
        return plain

    def _fork(
        self, parent: Sequence, count_: int, first_index: int | None = None
    ) -> list[Sequence]:
        children = []
        request = parent.request
        for j in range(count_):
            index = (first_index if first_index is not None else 1) + j
            child = self.seqs.fork(parent, index)
            self.blocks.fork(parent, child)
            request.sequences.append(child)
            if child.status is SeqStatus.RUNNING:
                self.scheduler.running.append(child)
            children.append(child)
        return children

    def _apply_beam_step(
        self, request: Request, beams: list[Sequence], logits: torch.Tensor
    ) -> None:
        request.forked = True
        before = {id(h) for h in request.beam_state.finished} if request.beam_state else set()
        running, done = self.beams.step(
            request, beams, logits, self.options.eos_token_ids, self.options.max_model_len
        )
        if request.scores_generated:
            self._score_hypotheses(request, beams, before)
        if done:
            for seq in beams:
                self.finish_seq(seq, "length")
            return
        used: set[int] = set()
        assignments = []
        for parent_pos, token, score in running:
            parent = beams[parent_pos]
            target = parent if parent_pos not in used else self._fork(parent, 1, first_index=0)[0]
            used.add(parent_pos)
            assignments.append((target, token, score))
        for pos, parent in enumerate(beams):
            if pos not in used:
                self.finish_seq(parent, "pruned", emit=False)
        for i, (target, token, score) in enumerate(assignments):
            target.index = i
            self._append(target, token, None, None, score=score)

    def _score_hypotheses(self, request: Request, beams: list[Sequence], before: set[int]) -> None:
        """LAST_GENERATED with beams: each newly finished hypothesis gets a fork of its parent
        beam (sharing its KV) holding the hypothesis' last token, scored in the next step."""
        for h in request.beam_state.finished:
            if id(h) in before:
                continue
            fork = self._fork(beams[h.parent], 1, first_index=len(request.sequences))[0]
            fork.token_ids.append(h.token_ids[-1])
            fork.scoring_reason, fork.hypothesis = h.finish_reason, h

    def _append(self, seq: Sequence, token: int, logprob: float | None, top, score=None) -> None:
        seq.token_ids.append(token)
        if score is not None:
            seq.cumulative_logprob = score
        elif logprob is not None:
            seq.cumulative_logprob += logprob
        params = seq.request.params
        if params.logprobs and logprob is not None:
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top or [])
        if params.num_beams == 1:
            self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        watch = seq.request.watch_stop_strings
        reason = self._stop_reason(seq, token)
        # as the API, a stop id or EOS ending the sequence is left out of the text
        left_out = int(reason == "stop" and not seq.request.params.include_stop_str_in_output)
        if watch and self._cut_by_stop_string(seq, left_out=left_out):
            return
        if reason and watch and not left_out and self._cut_by_stop_string(seq, final=True):
            return  # a stop string in the characters held until the end
        if reason:
            self.finish_seq(seq, reason)

    def _cut_by_stop_string(self, seq: Sequence, final: bool = False, left_out: int = 0) -> bool:
        """A stop string matched: finish "stop", the last kept token scored in the next step;
        later tokens are dropped once this step's output carried them."""
        kept = kept_output_tokens(seq, self.text_decoder, final, left_out)
        if kept is None:
            return False
        if seq.request.all_generated:  # rows go up to the token that completed the string
            kept = seq.stop_detokenizer.num_tokens
        if kept:
            self.stop_cuts.append((seq, kept))
        self.finish_seq(seq, "stop", score=kept > 0)
        return True

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.request.params
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if p.ends_on(token, self.options.eos_token_ids):
                return "stop"
        if num_output >= p.max_new_tokens or num_tokens >= self.options.max_model_len:
            return "length"
        return None

    # ---- finishing -----------------------------------------------------------------------
    def finish_seq(self, seq: Sequence, reason: str, emit: bool = True, score: bool = True) -> None:
        """Finish seq for reason and free its blocks (a LAST_GENERATED one first scores its
        last token, in the next step); emit False drops it from its request's outputs."""
        if seq.is_finished:
            return
        if reason in ("stop", "length") and score and self._scores_last_token(seq):
            seq.scoring_reason = reason  # held back: the next step computes its last token
            return
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.num_finished += 1
        self.scheduler.remove(seq)
        if not emit:
            seq.request.sequences.remove(seq)

    def finish_scoring_only(self, request: Request) -> None:
        """A max_new_tokens 0 request ends "length" once its prompt is computed."""
        seq = request.sequences[0]
        if (
            request.params.max_new_tokens == 0
            and not seq.is_finished
            and seq.num_computed_tokens == seq.num_tokens
        ):
            self.finish_seq(seq, "length")

    @staticmethod
    def _scores_last_token(seq: Sequence) -> bool:
        """LAST_GENERATED: a finishing sequence (not a beam: beams score their hypotheses)
        stays running one more step, its last token computed for the handler, no logits."""
        request = seq.request
        return (
            request.scores_generated
            and request.params.num_beams == 1
            and seq.scoring_reason is None
            and seq.num_output_tokens > 0
            and request.error_code is None
        )

"""Copy constraints with the real tiny model, the real search-qa env and the real loop (rollout/copying.py)."""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import HFPolicy, TorchLearner
from agentgrad.batch import collate
from agentgrad.envs.tasks.search_qa import SearchQASuite
from agentgrad.rollout.constrained import token_strings
from agentgrad.rollout.copying import CopySpec, LiteralState, is_span, literal_step, word_starts
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings, run_episodes
from agentgrad.rollout.parser import OPEN

CALL = OPEN + '\n{"name": "search", "arguments": {"query": "'


def _force_call_then_stop(tokenizer, eos_id, call: str = CALL):
    """A caller's processor: write CALL token by token, leave the value to the policy (and the copy mask, which
    runs after this), then end the turn once the value's closing quote is out. An untrained model writes no JSON
    of its own, so the call's frame is scripted; only the value is sampled."""
    prefix = tokenizer(call, add_special_tokens=False)["input_ids"]

    def force(row, generated, logits):
        if len(generated) < len(prefix):
            keep = prefix[len(generated)]
        elif '"' in tokenizer.decode(generated[len(prefix):]):
            keep = eos_id
        else:
            return logits
        return torch.full_like(logits, float("-inf")).index_fill(0, torch.tensor([keep]), 0.0)
    return force, len(prefix)


def _rollout(loaded_tiny, codec, copy: list[str], caller, n: int = 8, max_new: int = 30, literals: list[str] = (),
             prompt_suffix: str = ""):
    suite = SearchQASuite()
    tasks = [dataclasses.replace(t, prompt=t.prompt + prompt_suffix)
             for t in suite.sample_tasks(n, split="train", seed=0)]
    policy = HFPolicy(loaded_tiny.model, eos_token_ids=loaded_tiny.eos_token_ids, pad_token_id=loaded_tiny.pad_token_id)
    return run_episodes(policy, codec, [suite.make_env() for _ in tasks], tasks,
                        sampling=SamplingParams(temperature=1.0, seed=0), logits_processor=caller,
                        sampler=SamplerSettings(copy_args=CopySpec.parse(copy, literals)),
                        limits=EpisodeLimits(max_turns=1, max_new_tokens_per_turn=max_new, max_total_tokens=300))


def _spans(source: str) -> tuple[set[str], set[str]]:
    """Every whole span of `source` (from a word boundary to a word boundary) and every start of one."""
    cuts = [i for i in range(len(source) + 1)
            if i in (0, len(source)) or not (source[i - 1].isalnum() and source[i].isalnum())]
    spans = {source[i:j] for i in cuts for j in cuts if j > i}
    return spans, {source[i:k] for i in cuts for k in range(i + 1, len(source) + 1)}


def _legal_value_tokens(tokenizer, generated: list[int], source: str) -> set[int]:
    """Brute force over the vocabulary: the value (the text after CALL) stays the start of a span of `source`,
    or closes with a quote after a whole span."""
    spans, starts = _spans(source)
    legal = set()
    for v in range(len(tokenizer)):
        value = tokenizer.decode(generated + [v], skip_special_tokens=False)[len(CALL):]
        q = value.find('"')
        if (value in starts) if q < 0 else (value[:q] in spans):
            legal.add(v)
    return legal


def _check_recorded_sets_and_learner(loaded_tiny, trajs, frame: int, legal) -> None:
    """On the first trajectories, each recorded set (after the scripted frame) is `legal(traj, mask)` and the
    sampled logprob the log-softmax over it; the learner reproduces every constrained logprob of the batch."""
    batch = collate(trajs, pad_token_id=loaded_tiny.pad_token_id)
    vocab = len(loaded_tiny.tokenizer)
    with torch.no_grad():
        logits = loaded_tiny.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        rescored = TorchLearner(loaded_tiny.model, lr=0.0).logprobs(batch, temperature=1.0)
    for b, traj in enumerate(trajs[:4]):
        assert all(m.position >= traj.prompt_length + frame for m in traj.token_masks)
        for m in traj.token_masks:
            want = legal(traj, m)
            assert (set(m.token_ids) if m.allow else set(range(vocab)) - set(m.token_ids)) == want
            ids = sorted(want)
            expected = torch.log_softmax(logits[b, m.position - 1, ids], -1)[ids.index(traj.token_ids[m.position])]
            assert math.isclose(traj.logprobs[m.position], expected.item(), abs_tol=1e-5)
    masked = torch.zeros_like(batch.loss_mask)
    for b, traj in enumerate(trajs):
        for m in traj.token_masks:
            masked[b, m.position] = 1
    assert masked.sum() > len(trajs)
    assert ((rescored - batch.old_logprobs) * masked).abs().max().item() < 1e-4


def test_copied_query_is_a_span_of_the_question_and_the_learner_scores_the_masked_softmax(loaded_tiny, codec):
    """Every sampled query is a whole span of the prompt (word boundary to word boundary); at every copy position
    the recorded legal set is the brute-force one and the sampled logprob is the log-softmax over it; the learner
    reproduces them all."""
    tok = loaded_tiny.tokenizer
    force, frame = _force_call_then_stop(tok, loaded_tiny.eos_token_ids[0])
    trajs = _rollout(loaded_tiny, codec, ["search.query"], force)
    queries = []
    for t in trajs:
        text = t.turns[0].text
        assert text.startswith(CALL), text
        value = text[len(CALL):].split('"')[0]
        queries.append(value)
        assert value in _spans(t.task.prompt)[0], (value, t.task.prompt)
    assert len(set(queries)) > 4  # an untrained model copies many different spans

    assert all(t.token_masks for t in trajs[:3])

    def legal(traj, m):
        return _legal_value_tokens(tok, list(traj.token_ids[traj.prompt_length:m.position]), traj.task.prompt)

    _check_recorded_sets_and_learner(loaded_tiny, trajs, frame, legal)


def test_copied_answers_are_spans_of_what_the_episode_read(loaded_tiny, codec):
    """With `answer` copied and calls ruled out by the caller, every turn is the start of a span of the prompt, a
    whole one where it ended (eos, not the token budget); without the rule the same model writes text found
    nowhere."""
    # <tool_call> is one token, but also "<", "tool", ... (a call may be spelt out): rule out every start of it
    starts = torch.tensor([i for i, s in enumerate(token_strings(loaded_tiny.tokenizer))
                           if s and (OPEN.startswith(s) or s.startswith(OPEN))])

    def no_call(row, generated, logits):
        return logits.index_fill(0, starts, float("-inf")) if not generated else logits

    copied = _rollout(loaded_tiny, codec, ["answer"], no_call, max_new=12)
    for t in copied:
        text = t.turns[0].text
        assert text in _spans(t.task.prompt)[1], (text, t.task.prompt)
        assert t.stop_reason.value != "answered" or text in _spans(t.task.prompt)[0]  # it ended on a whole span
    free = _rollout(loaded_tiny, codec, [], no_call, max_new=12)
    assert sum(t.turns[0].text not in t.task.prompt for t in free) >= 6


EXPRESSION = OPEN + '\n{"name": "calculator", "arguments": {"expression": "'
NUMBERS = " Read: 2015, 1948 and 300; x12."
_NUMBER = re.compile(r"(?<![A-Za-z0-9_\\])[0-9]+")  # a digit run not glued to a name or an escape


def _numbers_written(trajs) -> list[str]:
    """The numbers of each expression; one the token budget cut short must still start a number read."""
    numbers = []
    for t in trajs:
        text = t.turns[0].text
        assert text.startswith(EXPRESSION), text
        value, closed, _ = text[len(EXPRESSION):].partition('"')
        found = _NUMBER.findall(value)
        if found and not closed and value.endswith(found[-1]):
            numbers.append(("start", found.pop(), t.task.prompt))
        numbers += [("whole", n, t.task.prompt) for n in found]
    return numbers


def test_copied_literals_are_numbers_read_and_the_learner_scores_the_masked_softmax(loaded_tiny, codec):
    """With `calculator.expression` under rollout.copy_literals, at every constrained position the recorded set
    is the definition's (`literal_step` over the whole vocabulary) and the learner reproduces the sampled
    logprobs; with digits made likely (the caller adds to their logits), every number written is one the prompt
    holds whole, where without the rule most are not."""
    tok = loaded_tiny.tokenizer
    strings = token_strings(tok)
    force, frame = _force_call_then_stop(tok, loaded_tiny.eos_token_ids[0], EXPRESSION)
    literals = ["calculator.expression"]
    trajs = _rollout(loaded_tiny, codec, [], force, n=8, max_new=40, literals=literals, prompt_suffix=NUMBERS)

    assert sum(bool(t.token_masks) for t in trajs) >= 6  # an expression may end (eos) before a digit is in reach

    def legal(traj, m):
        value = tok.decode(list(traj.token_ids[traj.prompt_length:m.position]))[len(EXPRESSION):]
        state = literal_step(LiteralState(), value, None)
        return {v for v, s in enumerate(strings) if literal_step(state, s, traj.task.prompt) is not None}

    _check_recorded_sets_and_learner(loaded_tiny, trajs, frame, legal)

    digits = torch.tensor([i for i, s in enumerate(strings) if any(c.isdigit() for c in s)])

    def digits_likely(row, generated, logits):
        logits = force(row, generated, logits)
        return logits.index_add(0, digits, torch.full((len(digits),), 6.0)) if len(generated) >= frame else logits

    copied = _numbers_written(_rollout(loaded_tiny, codec, [], digits_likely, n=12, max_new=40, literals=literals,
                                       prompt_suffix=NUMBERS))
    assert len(copied) >= 8, copied
    assert all(is_span(p, n) if kind == "whole" else word_starts(p, n) for kind, n, p in copied), copied
    free = _numbers_written(_rollout(loaded_tiny, codec, [], digits_likely, n=12, max_new=40, prompt_suffix=NUMBERS))
    assert sum(not is_span(p, n) for _, n, p in free) >= 8, free

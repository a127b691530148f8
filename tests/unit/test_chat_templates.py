"""Chat templates against the model makers' own files (tests/data/chat_templates, README there): Qwen2.5 and
Llama 3.1 are incremental and our renderings of them match theirs; Qwen3's is not, the checker says exactly
where, and the incremental variant we ship agrees with it wherever it can. Then every family round-trips an
episode token-in/token-out: render, encode, parse, mask."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from agentgrad.models.chat_templates import TEMPLATE_FAMILIES
from agentgrad.models.tiny import train_tokenizer
from agentgrad.rollout.chat import PROBE_EPISODE, PROBE_TOOLS, ChatCodec, ChatTemplateError, check_incremental
from agentgrad.rollout.loop import EpisodeLimits, expert_trajectory
from agentgrad.types import Message, ToolCall

DATA = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
OFFICIAL = {"qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja", "qwen3": "Qwen-Qwen3-0.6B.jinja",
            "llama3": "meta-llama-Llama-3.1-8B-Instruct.jinja"}
CORPUS = ["<|im_start|>user\nWhat is 12 * 30 + 7?<|im_end|>\n" * 4, '{"name": "calculator", "parameters": {}}' * 4]


@pytest.fixture(scope="module")
def tokenizers():
    """A small tokenizer per family (the tiny model's builder): the vocabularies the templates need."""
    return {f: train_tokenizer(CORPUS, vocab_size=300, family=f) for f in TEMPLATE_FAMILIES}


def codec_for(tokenizers, family: str, template: str | None = None, **kwargs) -> ChatCodec:
    tok = copy.deepcopy(tokenizers[family])  # the fixture's tokenizer keeps its own template
    if template is not None:
        tok.chat_template = template
    return ChatCodec(tok, [tok.eos_token_id], template_kwargs=kwargs)


def official(family: str) -> str:
    return (DATA / OFFICIAL[family]).read_text()


def episodes():
    """Chats of the shapes agentgrad renders: with and without a system message and tools, one and two calls."""
    call = Message("assistant", "", tool_calls=(ToolCall("calculator", {"expression": "2 + 2"}),))
    yield list(PROBE_EPISODE), PROBE_TOOLS
    yield list(PROBE_EPISODE[1:]), PROBE_TOOLS
    yield [Message("user", "  2 + 2?  "), call, Message("tool", "4"), Message("assistant", " 4 ")], None


@pytest.mark.parametrize("family", ["qwen2.5", "llama3"])
def test_makers_templates_are_incremental_and_ours_render_the_same(tokenizers, family):
    theirs = codec_for(tokenizers, family, official(family))
    ours = codec_for(tokenizers, family)
    assert check_incremental(theirs.render) == []
    for msgs, tools in episodes():
        first_user = next(i for i, m in enumerate(msgs) if m.role == "user")
        for k in range(first_user + 1, len(msgs) + 1):
            for gen in (False, True):
                assert ours.render(msgs[:k], tools, add_generation_prompt=gen) == theirs.render(
                    msgs[:k], tools, add_generation_prompt=gen)


@pytest.mark.parametrize("thinking", [None, False])
def test_qwen3_template_is_not_incremental_and_the_checker_says_where(tokenizers, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    theirs = codec_for(tokenizers, "qwen3", official("qwen3"), **kwargs)
    [first, *_] = check_incremental(theirs.render)
    # The first call turn, rendered last, holds an empty think block; once a tool result follows, it has none.
    before = theirs.render(list(PROBE_EPISODE[:3]), PROBE_TOOLS)
    turn = before.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    assert first.step == "appending [tool] and the generation prompt after [system, user, assistant]"
    assert before[turn:].startswith("<think>\n\n</think>\n\n<tool_call>")
    assert first.position == turn + len("<t")  # the first character that differs: "<think>" vs "<tool_call>"
    # 40 characters each side of the break, in the earlier and the later render
    assert first.before == ' + 7?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "c'
    assert first.after == ' + 7?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "argume'
    assert first.line == before[:turn].count("\n") + 1 and first.column == 3
    expected = r"(?s)at character 51 \(line 4, column 1\).*model\.chat_template=qwen3"
    with pytest.raises(ChatTemplateError, match=expected):
        theirs.observation_ids([Message("tool", "360")])


@pytest.mark.parametrize("thinking", [None, False])
def test_qwen3_variant_is_incremental_and_agrees_with_the_makers_where_it_can(tokenizers, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    theirs = codec_for(tokenizers, "qwen3", official("qwen3"), **kwargs)
    ours = codec_for(tokenizers, "qwen3", **kwargs)
    assert check_incremental(ours.render) == []
    msgs, tools = list(PROBE_EPISODE), PROBE_TOOLS
    # The first prompt the model sees is the makers' text, in both modes.
    assert ours.render(msgs[:2], tools, add_generation_prompt=True) == theirs.render(
        msgs[:2], tools, add_generation_prompt=True)
    # Each turn, as the model writes it after its generation prompt, is the makers' text.
    for k in (3, 5, 7):
        assert turn_text(ours, msgs[:k], tools) == turn_text(theirs, msgs[:k], tools)
    # An episode whose turns all reasoned renders the same whole (the makers keep reasoning after the query).
    thought = [m if m.role != "assistant" else Message("assistant", f"<think>\nstep {i}\n</think>\n\n{m.content}",
                                                        m.tool_calls) for i, m in enumerate(msgs)]
    assert ours.render(thought, tools) == theirs.render(thought, tools)


def turn_text(codec: ChatCodec, msgs: list[Message], tools) -> str:
    """The last assistant turn as the template writes it after the generation prompt before it."""
    prompt = codec.render(msgs[:-1], tools, add_generation_prompt=True)
    full = codec.render(msgs, tools)
    assert full.startswith(prompt)
    return full[len(prompt):]


def test_thinking_off_closes_an_empty_think_block_in_every_generation_prompt(tokenizers):
    off = codec_for(tokenizers, "qwen3", enable_thinking=False)
    on = codec_for(tokenizers, "qwen3")
    obs = [Message("tool", "360")]
    assert off.tokenizer.decode(off.observation_ids(obs)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.tokenizer.decode(on.observation_ids(obs)).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    call = Message("assistant", "", tool_calls=(ToolCall("calculator", {"expression": "1"}),))
    assert off.decode(off.assistant_ids(call)).startswith("<tool_call>")  # the prompt holds the empty block
    assert on.decode(on.assistant_ids(call)).startswith("<think>\n\n</think>\n\n<tool_call>")  # the model writes it


@pytest.mark.parametrize("family,thinking", [("tiny", None), ("qwen2.5", None), ("qwen3", None), ("qwen3", False),
                                             ("llama3", None)])
def test_each_family_round_trips_an_episode(tokenizers, arithmetic_suite, family, thinking):
    codec = codec_for(tokenizers, family, **({} if thinking is None else {"enable_thinking": thinking}))
    assert codec.tool_format.name == TEMPLATE_FAMILIES.get(family).tool_format
    for task in arithmetic_suite.sample_tasks(5, split="train", seed=11):
        env = arithmetic_suite.make_env()
        tools = env.reset(options={"task": task})[1]["tools"]
        actions = arithmetic_suite.expert_actions(task)
        traj = expert_trajectory(env, task, actions, codec, EpisodeLimits(max_total_tokens=4096))
        # render -> encode: the incremental ids are the one-shot encoding of the whole chat
        assert codec.encode(codec.render(list(traj.messages), tools).removesuffix("\n")) == list(traj.token_ids)
        # sample -> parse: each turn's text parses back to the action it encodes
        assert [codec.parse(codec.decode(traj.token_ids[t.start:t.end])) for t in traj.turns] == [[a] for a in actions]
        # mask: exactly the policy's turns, each ending in eos
        assert [i for i, m in enumerate(traj.loss_mask) if m] == [i for t in traj.turns for i in range(t.start, t.end)]
        assert all(traj.token_ids[t.end - 1] in codec.eos_token_ids for t in traj.turns)


def test_auto_swaps_qwen3s_own_template_for_the_variant_and_other_broken_templates_fail(tokenizers):
    from agentgrad.config import ModelConfig
    from agentgrad.models.hf import LoadedModel
    from agentgrad.pipelines.components import chat_codec

    def loaded(template: str) -> LoadedModel:
        tok = copy.deepcopy(tokenizers["qwen3"])
        tok.chat_template = template
        return LoadedModel(model=None, tokenizer=tok, eos_token_ids=(tok.eos_token_id,), pad_token_id=0)

    model = loaded(official("qwen3"))
    with pytest.warns(UserWarning, match="not incremental.*model.chat_template=qwen3"):
        codec = chat_codec(model, ModelConfig(enable_thinking=False))
    assert model.tokenizer.chat_template == TEMPLATE_FAMILIES.get("qwen3").template  # checkpoints carry it
    assert codec.template_kwargs == {"enable_thinking": False} and codec.tool_format.name == "qwen3"
    path = str(DATA / OFFICIAL["qwen3"])  # named explicitly, the maker's template is not swapped: it fails
    with pytest.raises(ChatTemplateError, match=r"(?s)character 745 \(line 20, column 3\).*before:.*after:"):
        chat_codec(loaded(TEMPLATE_FAMILIES.get("tiny").template), ModelConfig(path="x", chat_template=path))


NAMES = ["How many projects does the Lavul department have?", "SELECT COUNT(*) FROM d WHERE d.name = 'Lavul'",
         "Log in as miaplaith (pin 8604).", '{"user": "miaplaith", "pin": "8604"}']


def words(tok, text: str) -> list[str]:
    """`text` as the pieces BPE then splits on its own (a piece is the same tokens wherever it occurs), readable."""
    return [piece.replace("\u0120", " ") for piece, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("word_spaces", ["attached", "split-before-capitals", "split"])
def test_word_spaces_decide_whether_a_copied_name_is_the_same_tokens(tmp_path, word_spaces):
    """A name is copied from a question into a tool call: split before capitals (or everywhere), it is the same
    piece after a space as after a quote; GPT-2's attached space makes it another piece (" Lavul" vs "Lavul").
    Lowercase names stay attached except with `split`. Every variant decodes to the exact text, saved and reloaded."""
    from transformers import AutoTokenizer

    train_tokenizer(NAMES * 10, vocab_size=300, word_spaces=word_spaces).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    question, query, login, call = (words(tok, text) for text in NAMES)
    assert ("Lavul" in question) == (word_spaces != "attached"), question
    assert (" Lavul" in question) == (word_spaces == "attached"), question
    assert "Lavul" in query, query
    assert ("miaplaith" in login) == (word_spaces == "split"), login
    assert "miaplaith" in call, call
    for text in NAMES:
        assert tok.decode(tok(text)["input_ids"]) == text


def test_the_run_builds_its_tokenizer_with_the_configured_word_spaces(tmp_path):
    """`model.tiny.word_spaces` reaches the tokenizer saved beside the tiny model, and loading the model gives
    that tokenizer back (transformers alone would swap in Qwen2's pre-tokenizer for a qwen2 model)."""
    from agentgrad.config import build_config
    from agentgrad.models.hf import load_model
    from agentgrad.pipelines.components import build_tiny_model_dir, make_suite

    for word_spaces in ("attached", "split-before-capitals"):
        config = build_config(overrides=["env=sql-qa", f"model.tiny.word_spaces={word_spaces}",
                                         "model.tiny.tokenizer_corpus_episodes=20", "model.tiny.hidden_size=16",
                                         "model.tiny.intermediate_size=32", "model.tiny.num_layers=1"])
        directory = build_tiny_model_dir(config, make_suite(config), tmp_path / word_spaces)
        question = words(load_model(directory).tokenizer, NAMES[0])
        assert ("Lavul" in question) == (word_spaces != "attached"), question

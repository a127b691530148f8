"""The embedded default model: a tiny Qwen2-architecture causal LM and a tokenizer trained locally.

Both are saved with `save_pretrained`, so the run loads them through exactly the code path that loads a real
checkpoint (a local directory or a hub id such as Qwen2.5-0.5B-Instruct).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from agentgrad.models.chat_templates import TEMPLATE_FAMILIES

TINY_BUILD_PHASES = ("tokenizer trained", "model built", "model and tokenizer saved")
"""What `save_tiny_model` reports through its `progress(done, total)`, in order."""


AS_TRAINED = "agentgrad_tokenizer_as_trained"
"""Marks (in tokenizer_config.json) a tokenizer that loads exactly as saved: transformers would otherwise load a
qwen2 model's tokenizer as Qwen2Tokenizer, which keeps the vocabulary and merges but puts Qwen's own
pre-tokenizer in place of the one BPE was trained with (`models.hf.load_model` reads the mark)."""

WORD_SPACES = {"attached": None, "split-before-capitals": r" (?=[A-Z])", "split": r" +"}
"""Where a space before a word goes (`model.tiny.word_spaces`): GPT-2's BPE attaches it to the word, so a name is
other tokens after a space (" Lavul": " L", "a", ...) than after a quote ("'Lavul": "L", "a", ...) and a tiny
model must learn both to copy it from a question into a query. The others make the space its own token: before
a capital letter (names; ~4% more tokens on the built-in suites) or everywhere (~25% more)."""


def train_tokenizer(corpus: Iterable[str], *, vocab_size: int = 512, family: str = "tiny",
                    word_spaces: str = "attached"):
    """Byte-level BPE whose digits are always single tokens (tiny models only learn to copy numbers then);
    `word_spaces` is one of `WORD_SPACES`.

    Returns a `transformers.PreTrainedTokenizerFast` with the chat template and the special and tool tokens of
    `family` (models/chat_templates.py: tiny, qwen2.5, qwen3, llama3) installed.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fam = TEMPLATE_FAMILIES.get(family)
    tok = Tokenizer(models.BPE())
    space = WORD_SPACES[word_spaces]
    split = [] if space is None else [pre_tokenizers.Split(Regex(space), behavior="isolated")]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), *split, pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fam.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=fam.bos_token,
        eos_token=fam.eos_token,
        pad_token=fam.pad_token,
        additional_special_tokens=list(fam.additional_special),
    )
    fast.add_tokens(list(fam.added_tokens), special_tokens=False)
    fast.chat_template = fam.template
    fast.padding_side = "left"
    fast.init_kwargs[AS_TRAINED] = True
    return fast


def build_tiny_model(tokenizer, *, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int = 384, max_positions: int = 1024, seed: int = 0,
                     init_std: float = 0.06):
    """A randomly initialised Qwen2ForCausalLM sized for CPU training (~1M parameters at the defaults)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    return model


def save_tiny_model(directory: str | Path, corpus: Iterable[str], *, vocab_size: int = 512, seed: int = 0,
                    family: str = "tiny", word_spaces: str = "attached",
                    progress: Callable[[int, int | None], None] | None = None, **model_kwargs) -> Path:
    """Train the tokenizer on `corpus`, build the model, and save both in HF format to `directory`;
    `progress(done, total)` after each of `TINY_BUILD_PHASES`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    done = progress or (lambda done, total: None)
    tokenizer = train_tokenizer(corpus, vocab_size=vocab_size, family=family, word_spaces=word_spaces)
    done(1, len(TINY_BUILD_PHASES))
    model = build_tiny_model(tokenizer, seed=seed, **model_kwargs)
    done(2, None)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    done(3, None)
    return directory

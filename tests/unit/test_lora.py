"""LoRA through PEFT (models/lora.py, docs/scale-out.md): only the adapters train, the reference is the same
model with its adapters disabled, the rollout engine and the learner's lean forward see the adapted weights, and
checkpoints round-trip. Skips without the lora extra (peft)."""

import copy

import pytest
import torch

pytest.importorskip("peft", reason="the lora extra is not installed (pip install 'agentgrad[lora]')")

from test_shared_prefix import VOCAB, _grouped_batch, _model

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import HFPolicy, TorchLearner
from agentgrad.backends.scoring import Scoring, token_logprobs
from agentgrad.models.lora import ADAPTER_DIR, attach_lora, merge_saved_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_model(dropout: float = 0.0, targets=ALL):
    model = _model("qwen2")
    base = copy.deepcopy(model)
    adapters = attach_lora(model, r=4, alpha=8.0, dropout=dropout, target_modules=targets)
    return model, base, adapters


def _randomise_b(model: torch.nn.Module) -> None:
    """Fresh adapters have B = 0 (the model unchanged); give them some, so adapted != base."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_fresh_adapters_leave_the_model_unchanged_and_freeze_the_base():
    model, base, adapters = _lora_model()
    batch = _grouped_batch()
    assert torch.equal(token_logprobs(model, batch.input_ids, batch.attention_mask),
                       token_logprobs(base, batch.input_ids, batch.attention_mask))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 7 projections x (A, B)
    assert len(trainable) == 2 * 7 * 2


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["lean-shared-prefix", "plain-forward"])
def test_only_adapter_parameters_change_in_an_update(dropout):
    model, _, adapters = _lora_model(dropout)
    learner = TorchLearner(model, lr=1e-2)
    assert (learner.lean is not None) == (dropout == 0.0)  # dropout cannot be merged: the plain forward then
    optimised = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert optimised == {id(p) for p in adapters.trainable_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = _grouped_batch()
    for _ in range(2):  # B = 0 at first, so A's gradient is 0 on the first step; both move by the second
        lp = learner.logprobs(batch)  # (B, T)
        learner.step(-(lp * batch.loss_mask).sum() / batch.loss_mask.sum())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    lora = {n for n in before if ".lora_" in n}
    assert changed == lora


def test_lean_forward_and_engine_see_the_adapters():
    """The learner's shared-prefix forward and the rollout engine read weights directly (backends/lean.py);
    with adapters they must apply W + alpha/r * B @ A, as PEFT's own forward does."""
    model, base, adapters = _lora_model()
    _randomise_b(model)
    batch = _grouped_batch()
    hf = token_logprobs(model, batch.input_ids, batch.attention_mask)  # (B, T) PEFT's forward
    learner = TorchLearner(model, lr=1e-3)
    assert learner.lean is not None
    with torch.no_grad():
        lean = learner.logprobs(batch)  # (B, T) the shared-prefix path
    plain_base = token_logprobs(base, batch.input_ids, batch.attention_mask)
    mask = batch.attention_mask.bool()
    assert (hf - plain_base)[mask].abs().max() > 0.1  # the adapters matter...
    assert torch.allclose(lean[mask], hf[mask], atol=1e-4)  # ...and the lean path applies them

    # Generation: greedy continuations under the adapted model equal those of a plain model holding the merged
    # weights, and differ from the base model's.
    merged = copy.deepcopy(base)
    merged.load_state_dict(adapters.merged_state_dict())
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    prompts = [[5, 9, 11, 3], [7, 7, 2]]

    def run(m):
        return HFPolicy(m, eos_token_ids=[VOCAB - 1], pad_token_id=0).generate(prompts, sampling)

    adapted, plain, unadapted = run(model), run(merged), run(base)
    assert [g.token_ids for g in adapted] == [g.token_ids for g in plain]
    for a, p in zip(adapted, plain):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(p.logprobs), atol=1e-4)
    assert [g.token_ids for g in adapted] != [g.token_ids for g in unadapted]


def test_reference_is_the_base_model_exactly_with_no_copy():
    model, base, adapters = _lora_model()
    learner = TorchLearner(model, lr=1e-2)
    batch = _grouped_batch()
    for _ in range(3):
        lp = learner.logprobs(batch)
        learner.step(-(lp * batch.loss_mask).sum() / batch.loss_mask.sum())
    reference = adapters.base_view()
    assert list(reference.parameters()) == [] and reference.state_dict() == {}  # nothing copied or saved twice
    scoring = Scoring(temperature=0.7)
    model.train()
    ref = scoring.frozen(reference, batch)  # (B, T)
    assert torch.equal(ref, scoring.frozen(base, batch))  # bit for bit the base model
    assert not torch.equal(ref, scoring.frozen(model, batch))  # while the policy itself has moved
    assert model.training and not any(m.disable_adapters for _, m in _lora_layers(model))  # restored after


def _lora_layers(model):
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "get_delta_weight")]


def test_checkpoint_holds_the_base_in_hf_format_and_the_adapters(tmp_path):
    import transformers

    model, base, adapters = _lora_model(targets=["q_proj", "v_proj"])
    _randomise_b(model)
    adapters.save_pretrained(tmp_path)
    assert (tmp_path / ADAPTER_DIR / "adapter_config.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # a plain HF model: the base
    for k, v in base.state_dict().items():
        assert torch.equal(reloaded.state_dict()[k], v), k
    resumed = attach_lora(reloaded, r=1, alpha=1.0, dropout=0.0, target_modules=ALL,  # the saved config wins
                          adapter_dir=tmp_path / ADAPTER_DIR)
    mine, theirs = model.state_dict(), reloaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert {n for n, p in reloaded.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if p.requires_grad}
    del resumed

    merged = merge_saved_adapter(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), tmp_path)
    assert not _lora_layers(merged)
    batch = _grouped_batch()
    mask = batch.attention_mask.bool()
    want = token_logprobs(model, batch.input_ids, batch.attention_mask)
    got = token_logprobs(merged, batch.input_ids, batch.attention_mask)
    assert torch.allclose(got[mask], want[mask], atol=1e-4)

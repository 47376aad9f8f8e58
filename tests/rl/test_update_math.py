"""RL-step plumbing without an engine: sequence packing and micro-batched gradients equal the unsplit batch."""

import peft
import pytest
import torch

from orbit_lightning import add_adapter, load_model
from orbit_lightning.adapters import trainable_parameters
from orbit_lightning.algorithms.config import AlgoConfig
from orbit_lightning.models.logprobs import token_logprobs
from orbit_lightning.rl.experience import Experience, pack_sequences
from orbit_lightning.rl.loss import loss_denominator, micro_batch_loss, micro_batches, score_no_grad


def test_pack_sequences_layout():
    ids, attn, cmask, lps, p = pack_sequences([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], [[-0.1, -0.2], [-1, -2, -3]],
                                              pad_id=0)
    assert p == 3
    assert ids.tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert cmask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert torch.allclose(lps, torch.tensor([[-0.1, -0.2, 0.0], [-1.0, -2.0, -3.0]]))


def _experience(model, n=6, g=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(n // g) for _ in range(g)]
    comps = [torch.randint(3, 200, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
             for _ in range(n)]
    ids, attn, cmask, _, p = pack_sequences(prompts, comps, [[0.0] * len(c) for c in comps], pad_id=0)
    exp = Experience(input_ids=ids, attention_mask=attn, completion_mask=cmask, rollout_logprobs=cmask * 0,
                     rewards=torch.rand(n, generator=gen), reward_valid=torch.ones(n, dtype=torch.bool),
                     adapter_versions=torch.zeros(n, dtype=torch.long), prompt_len=p, group_size=g)
    exp.loss_mask = cmask
    exp.old_logprobs = score_no_grad(model, exp, 10_000)
    exp.advantages = torch.randn(n, generator=gen)
    return exp


def test_scores_align_with_completion_tokens():
    model = load_model("tiny-qwen3", dtype=torch.float32)
    exp = _experience(model)
    full, _ = token_logprobs(model, exp.input_ids, exp.attention_mask)  # [N, T-1]
    c = exp.completion_mask.shape[1]
    assert torch.allclose(exp.old_logprobs, full[:, exp.prompt_len - 1: exp.prompt_len - 1 + c], atol=1e-6)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batched_gradients_equal_the_full_minibatch(mode):
    model = load_model("tiny-qwen3-moe", dtype=torch.float32, quant="int4")
    add_adapter(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "experts"]))
    with torch.no_grad():
        for p in trainable_parameters(model):
            p.add_(0.01 * torch.randn_like(p))
    exp = _experience(model, n=8, g=4)
    cfg = AlgoConfig(loss_agg=mode, kl_coef=0.0)
    denom = loss_denominator(exp.loss_mask, mode)
    rows = torch.arange(exp.num_samples)

    def grads(splits):
        for p in trainable_parameters(model):
            p.grad = None
        for r in splits:
            loss, _ = micro_batch_loss(model, exp.select(r), cfg, denom, max_tokens=8)
            loss.backward()
        return [p.grad.clone() for p in trainable_parameters(model)]

    whole = grads([rows])
    split = grads(micro_batches(rows, exp, token_budget=2 * exp.input_ids.shape[1]))
    assert len(micro_batches(rows, exp, token_budget=2 * exp.input_ids.shape[1])) == 4
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), mode

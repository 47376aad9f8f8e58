"""Pretrain the embedded default model: a tiny MoE taught arithmetic by SFT from scratch, to *partial* accuracy.

`orbit-rl mode=pretrain` runs this. It writes a HF checkpoint (config.json + bf16 model.safetensors, loadable
by transformers too), the char tokenizer, and `pretrain.json` with the seed, config and accuracy curve, so the
shipped checkpoint can be reproduced exactly. It stops at `target_accuracy` so that RL has room to improve.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from .data.tasks import ArithmeticTaskConfig, make_arithmetic_split
from .data.tokenizer import CharTokenizer
from .models import CausalLM, ModelConfig
from .models.cache import ContiguousKVCache

log = logging.getLogger(__name__)

TINY_MOE = dict(model_type="qwen3_moe", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=128, norm_topk_prob=True, max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)


@dataclass
class PretrainConfig:
    output_dir: str = "outputs/pretrain"
    task: ArithmeticTaskConfig = field(default_factory=lambda: ArithmeticTaskConfig(
        num_digits_min=1, num_digits_max=3, ops=("+", "-"), train_size=20_000, eval_size=300, seed=0))
    seed: int = 0
    batch_size: int = 128
    lr: float = 3e-3
    max_steps: int = 4000
    eval_every: int = 100
    target_accuracy: float = 0.35  # stop once greedy eval accuracy reaches this: partial, so RL can improve it
    threads: int = 2


def encode_example(tok: CharTokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """-> (ids of <bos>prompt answer<eos>, number of prompt tokens)."""
    p = tok.encode(prompt, add_bos=True)
    return p + tok.encode(answer, add_eos=True), len(p)


def sft_batch(tok: CharTokenizer, items: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and a loss mask [B, T-1] over answer tokens (the prompt is not a target)."""
    encoded = [encode_example(tok, it["prompt"], it["answer"]) for it in items]
    t = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(items), t), tok.pad_token_id)
    mask = torch.zeros(len(items), t - 1)
    for i, (seq, n_prompt) in enumerate(encoded):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, n_prompt - 1 : len(seq) - 1] = 1
    return ids, mask


@torch.no_grad()
def greedy_answers(model: CausalLM, tok: CharTokenizer, prompts: list[str], max_new_tokens: int = 6) -> list[str]:
    """Batched greedy decoding with a contiguous KV cache (left-padded prompts)."""
    enc = [tok.encode(p, add_bos=True) for p in prompts]
    t = max(map(len, enc))
    ids = torch.full((len(enc), t), tok.pad_token_id)
    mask = torch.zeros(len(enc), t, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, t - len(e):], mask[i, t - len(e):] = torch.tensor(e), 1
    cache = ContiguousKVCache(model.config.num_hidden_layers, t + max_new_tokens)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [[] for _ in enc]
    done = torch.zeros(len(enc), dtype=torch.bool)
    for _ in range(max_new_tokens):
        cache.advance(mask)
        nxt = model(ids, mask, pos, cache)[:, -1].argmax(-1)
        for i in range(len(enc)):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= nxt == tok.eos_token_id
        if done.all():
            break
        ids, mask, pos = nxt[:, None], torch.ones(len(enc), 1, dtype=torch.long), pos[:, -1:] + 1
    return [tok.decode(o) for o in out]


def accuracy(model: CausalLM, tok: CharTokenizer, items: list[dict]) -> float:
    answers = greedy_answers(model, tok, [it["prompt"] for it in items])
    return sum(a.strip() == it["answer"] for a, it in zip(answers, items)) / max(len(items), 1)


def pretrain(cfg: PretrainConfig) -> Path:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = CharTokenizer()
    train, evals = make_arithmetic_split(cfg.task)
    mcfg = ModelConfig.from_hf({**TINY_MOE, "vocab_size": tok.vocab_size, "bos_token_id": tok.bos_token_id,
                                "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
    model = CausalLM(mcfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else 0.02 * torch.randn_like(p))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    gen = torch.Generator().manual_seed(cfg.seed)
    curve, t0 = [], time.time()
    for step in range(1, cfg.max_steps + 1):
        model.train()
        idx = torch.randint(0, len(train), (cfg.batch_size,), generator=gen).tolist()
        ids, mask = sft_batch(tok, [train[i] for i in idx])
        logits = model(ids)[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll * mask.reshape(-1)).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % cfg.eval_every == 0:
            model.eval()
            acc = accuracy(model, tok, evals)
            curve.append({"step": step, "loss": round(loss.item(), 4), "eval_accuracy": acc,
                          "seconds": round(time.time() - t0, 1)})
            log.info("pretrain step %d loss %.4f eval accuracy %.3f", step, loss.item(), acc)
            if acc >= cfg.target_accuracy:
                break
    return save_pretrained(model, tok, cfg, curve)


def save_pretrained(model: CausalLM, tok: CharTokenizer, cfg: PretrainConfig, curve: list[dict]) -> Path:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**model.config.to_hf(), "dtype": "bfloat16"}, indent=2))
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in _hf_state_dict(model).items()}
    save_file(tensors, out / "model.safetensors")
    tok.save_pretrained(out)
    cfg_dict = asdict(cfg)
    (out / "pretrain.json").write_text(json.dumps({"config": cfg_dict, "curve": curve}, indent=2, default=list))
    return out


def _hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    from .adapters.export import export_hf_state_dict

    return export_hf_state_dict(model)

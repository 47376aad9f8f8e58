"""Turn an `ExperimentConfig` into live objects: model + adapter, tokenizer, data, rewards, module, trainer."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from .experiment import AdapterSpec, DataSpec, ExperimentConfig, ModelSpec, RewardSpec

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
SHIPPED_MODELS = {"orbit-tiny-moe": ASSETS / "orbit-tiny-moe"}


def resolve_model_path(path: str) -> str:
    return str(SHIPPED_MODELS[path]) if path in SHIPPED_MODELS else path


def resolve_device(device: str, key: str = "model.device") -> torch.device:
    """The torch device of a config value (`key` names it in errors): auto is CUDA when torch sees a GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{key}={device!r} is not a device: use auto, cpu, cuda or cuda:N ({e})") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key}={device!r} but torch sees no CUDA GPU (torch {torch.__version__}, CUDA build: "
                         f"{torch.version.cuda}); use {key}=cpu or auto")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"{key}={device!r} but torch sees {torch.cuda.device_count()} GPU(s)")
    # Lightning's single-device strategies need an explicit CUDA index.
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def peft_config(spec: AdapterSpec):
    import peft

    targets = spec.target_modules
    target = "all-linear" if targets == ["all-linear"] else list(targets)
    if spec.type == "lora":
        return peft.LoraConfig(r=spec.r, lora_alpha=spec.alpha, use_rslora=spec.rslora, lora_dropout=spec.dropout,
                               target_modules=target)
    return peft.OFTConfig(oft_block_size=spec.oft_block_size, r=0, target_modules=target)


def build_model(spec: ModelSpec, adapter: AdapterSpec | None):
    from . import add_adapter, load_model

    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model.dtype={spec.dtype!r} is not a torch dtype (use float32 or bfloat16)")
    model = load_model(resolve_model_path(spec.path), dtype=dtype, device=resolve_device(spec.device),
                       quant=spec.quant, int4_layout=spec.int4_layout, **spec.overrides)
    set_expert_chunks(model, spec.expert_chunk, spec.expert_chunk_mib)
    if adapter is not None:
        add_adapter(model, peft_config(adapter))
    return model


def set_expert_chunks(model: torch.nn.Module, chunk: int, chunk_mib: int) -> None:
    """Experts per dequantized chunk in every routed-experts module (packed ones too): `chunk` if > 0, else as
    many as `chunk_mib` MiB hold (models.moe)."""
    from .models.moe import Experts

    for m in model.modules():
        if isinstance(m, Experts):  # QuantExperts subclasses it
            m.chunk, m.chunk_mib = chunk, chunk_mib


def build_tokenizer(spec: ModelSpec):
    from .data.tokenizer import TOKENIZER_FILE, CharTokenizer

    path = Path(resolve_model_path(spec.path))
    if (path / TOKENIZER_FILE).is_file():
        return CharTokenizer.from_pretrained(path)
    if path.is_dir():
        import transformers

        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    log.warning("model %s has no tokenizer files; using the built-in character tokenizer", spec.path)
    return CharTokenizer()


def build_data(spec: DataSpec, tokenizer: Any, seed: int, context: int | None = None):
    """-> (PromptDataModule, eval items as dataset rows). context: the model's max_position_embeddings, which bounds
    the prompts kept: the engine refuses a prompt that leaves no room to generate."""
    from .data import PromptDataModule, PromptDataset, load_rows, make_arithmetic_split, train_eval_split
    from .data.tasks import ArithmeticTaskConfig

    if spec.source == "arithmetic":
        task = ArithmeticTaskConfig(num_digits_min=spec.num_digits_min, num_digits_max=spec.num_digits_max,
                                    ops=tuple(spec.ops), num_operands=spec.num_operands, seed=spec.task_seed,
                                    train_size=spec.train_size, eval_size=spec.eval_size)
        train_rows, eval_rows = make_arithmetic_split(task)
    else:
        try:
            rows = load_rows(spec.source)
        except FileNotFoundError as e:  # (relative paths are taken from the directory orbit-rl runs in)
            raise FileNotFoundError(f"data.source: {e} (from {os.getcwd()}); set data.source to a .jsonl or "
                                    ".json file or a saved datasets directory") from None
        if not rows:
            raise ValueError(f"data.source={spec.source!r} holds no rows")
        train_rows, eval_rows = train_eval_split(rows, eval_size=min(spec.eval_size, len(rows) // 2), seed=seed)
    limit = spec.max_prompt_tokens if context is None else min(spec.max_prompt_tokens, context - 1)
    kw = dict(tokenizer=tokenizer, max_prompt_tokens=limit, prompt_key=spec.prompt_key,
              answer_key=spec.answer_key)
    capped = (f"the model's context of {context} tokens holds prompts of up to {limit}, fewer than "
              f"data.max_prompt_tokens={spec.max_prompt_tokens}") if limit < spec.max_prompt_tokens else ""
    try:
        train, evals = PromptDataset(train_rows, **kw), PromptDataset(eval_rows, **kw)
    except ValueError as e:
        raise ValueError(f"{e} ({capped})" if capped else str(e)) from None
    if capped and train.dropped + evals.dropped:
        log.warning("(%s)", capped)
    dm = PromptDataModule(train, evals, prompts_per_step=spec.prompts_per_step, seed=seed)
    return dm, [evals[i] for i in range(len(evals))]


def build_rewards(spec: RewardSpec):
    from .rewards import RewardRunner

    return RewardRunner([(f.name, f.weight) for f in spec.functions], timeout_s=spec.timeout_s,
                        max_workers=spec.max_workers)


def build_logger(cfg: ExperimentConfig, run_dir: Path, resumed_rl_step: int | None = None):
    """resumed_rl_step: the RL step of the checkpoint a run resumes from (None: a new run), up to which the CSV
    logger keeps the rows already in metrics.csv."""
    from lightning.pytorch import loggers

    kind = cfg.logger.kind
    if kind == "csv":
        from .csv_log import ResumedCSVLogger

        return ResumedCSVLogger(run_dir, resumed_rl_step)
    if kind == "tensorboard":
        return loggers.TensorBoardLogger(run_dir, name="", version="")
    import os

    if cfg.logger.wandb_offline:
        os.environ.setdefault("WANDB_MODE", "offline")
    return loggers.WandbLogger(project=cfg.logger.wandb_project, save_dir=str(run_dir), name=cfg.name)

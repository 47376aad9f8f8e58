"""The experiment schema: one dataclass per config group, validated by Hydra/OmegaConf (unknown keys and wrong
types fail at start-up). `configs/` holds the YAML choices for each group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from .algorithms.config import AlgoConfig
from .rl.config import OptimConfig, RolloutConfig


@dataclass
class ModelSpec:
    path: str = "orbit-tiny-moe"  # a HF checkpoint dir, a preset name, or the shipped "orbit-tiny-moe"
    # int4 | int4-g64 | int4-g128 | fp8 | mxfp4 | nvfp4 | nf4 | null (no packing); int4*-tiled: the decode kernels'
    # block layout of the same int4 values (quant/formats/tiled.py), whatever int4_layout says
    quant: str | None = "int4"
    # How int4 is stored: auto (the tiled layout on CUDA, where decode is faster; row-major on the CPU) | row-major |
    # tiled. Checkpoints and exports stay row-major either way.
    int4_layout: str = "auto"
    dtype: str = "float32"  # compute dtype of activations, dequantized tiles and the adapter
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    expert_chunk: int = 0  # active experts dequantized per grouped call (large batches); 0: what expert_chunk_mib holds
    expert_chunk_mib: int = 1024  # the transient dequantized expert weights of one chunk
    overrides: dict[str, Any] = field(default_factory=dict)  # config.json keys (e.g. num_hidden_layers for presets)


@dataclass
class AdapterSpec:
    type: str = "lora"  # lora | oft
    r: int = 16
    alpha: float = 32.0
    rslora: bool = False
    dropout: float = 0.0  # 0 keeps old, reference and new log-probs consistent
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    oft_block_size: int = 32


@dataclass
class RewardFnSpec:
    name: str = "arithmetic_exact"  # a registered reward, or an import path: my_pkg.my_module:my_reward
    weight: float = 1.0


@dataclass
class RewardSpec:
    functions: list[RewardFnSpec] = field(default_factory=lambda: [RewardFnSpec()])
    timeout_s: float = 10.0
    max_workers: int = 8


@dataclass
class DataSpec:
    # "arithmetic" (built-in task) or a .jsonl/.json file or a datasets directory. No default: the data group sets it
    # (OmegaConf keeps a default over a group's `???`, so data=jsonl without data.source trained on arithmetic).
    source: str = MISSING
    prompts_per_step: int = 16
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_tokens: int = 512
    eval_size: int = 200  # held-out prompts (taken from the source when it is a file)
    # Built-in arithmetic task difficulty
    num_digits_min: int = 1
    num_digits_max: int = 3
    ops: list[str] = field(default_factory=lambda: ["+", "-"])
    num_operands: int = 2
    train_size: int = 20_000
    task_seed: int = 0


@dataclass
class StrategySpec:
    name: str = "colocated"  # colocated: engine + reference share the training GPU's base; dedicated: own GPU
    rollout_device: str | None = None  # dedicated mode: e.g. cuda:1


@dataclass
class TrainerSpec:
    max_steps: int = 60  # RL steps
    eval_every: int = 10  # RL steps between evaluations (and one at the end); 0 = no evaluation
    eval_max_items: int = 200
    checkpoint_every: int = 10
    accelerator: str = "auto"
    seed: int = 0
    output_dir: str = "runs/${name}"
    resume: str | None = None  # a checkpoint path, or "auto": output_dir/checkpoints/last.ckpt if present
    threads: int | None = None  # torch CPU threads (default: torch's choice)
    report: bool = True

    def validate(self) -> None:
        for name in ("max_steps", "eval_max_items", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"trainer.eval_every must be >= 0 (0 = no evaluation), got {self.eval_every}")


@dataclass
class LoggerSpec:
    kind: str = "csv"  # csv | tensorboard | wandb (offline by default)
    wandb_project: str = "orbit-lightning"
    wandb_offline: bool = True


@dataclass
class PretrainSpec:
    output_dir: str = "outputs/orbit-tiny-moe"
    batch_size: int = 128
    lr: float = 3e-3
    max_steps: int = 4000
    eval_every: int = 100
    target_accuracy: float = 0.35


@dataclass
class ExperimentConfig:
    name: str = "default"
    mode: str = "train"  # train | pretrain | eval | print_config | plan_memory
    adapter_path: str | None = None  # eval mode: a PEFT adapter directory to evaluate
    model: ModelSpec = field(default_factory=ModelSpec)
    adapter: AdapterSpec = field(default_factory=AdapterSpec)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardSpec = field(default_factory=RewardSpec)
    data: DataSpec = field(default_factory=DataSpec)
    strategy: StrategySpec = field(default_factory=StrategySpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    logger: LoggerSpec = field(default_factory=LoggerSpec)
    pretrain: PretrainSpec = field(default_factory=PretrainSpec)

    def validate(self) -> None:
        modes = ("train", "pretrain", "eval", "print_config", "plan_memory")
        if self.mode not in modes:
            raise ValueError(f"mode={self.mode!r} is not one of {modes}")
        if self.adapter.type not in ("lora", "oft"):
            raise ValueError(f"adapter.type={self.adapter.type!r} must be 'lora' or 'oft'")
        if self.logger.kind not in ("csv", "tensorboard", "wandb"):
            raise ValueError(f"logger.kind={self.logger.kind!r} must be csv, tensorboard or wandb")
        if self.strategy.name not in ("colocated", "dedicated"):
            raise ValueError(f"strategy.name={self.strategy.name!r} must be 'colocated' or 'dedicated'")
        if self.strategy.name == "dedicated" and not self.strategy.rollout_device:
            raise ValueError("strategy=dedicated needs strategy.rollout_device (e.g. cuda:1)")
        if self.model.expert_chunk < 0 or self.model.expert_chunk_mib < 1:
            raise ValueError(f"model.expert_chunk must be >= 0 (0: as many as fit) and model.expert_chunk_mib >= 1, "
                             f"got {self.model.expert_chunk} and {self.model.expert_chunk_mib}")
        import torch

        from .quant.formats import int4_storage_name

        int4_storage_name(self.model.quant, self.model.int4_layout, torch.device("cpu"))  # (names a bad pair here)
        if self.data.source in ("", MISSING):
            raise ValueError("data.source is required: arithmetic (data=arithmetic), or a .jsonl/.json file or a "
                             "datasets directory (data=jsonl data.source=PATH)")
        for c in (self.algo, self.optim, self.rollout, self.trainer):
            c.validate()

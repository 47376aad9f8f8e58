"""Data: the character tokenizer, the built-in arithmetic task, prompt datasets and the datamodule."""

from orbit_lightning.data.datamodule import PromptDataModule
from orbit_lightning.data.prompts import PromptDataset, encode_prompt, load_rows, train_eval_split
from orbit_lightning.data.sampler import ResumableBatchSampler
from orbit_lightning.data.tasks import ArithmeticTaskConfig, make_arithmetic_split
from orbit_lightning.data.tokenizer import CharTokenizer

__all__ = [
    "ArithmeticTaskConfig",
    "CharTokenizer",
    "PromptDataModule",
    "PromptDataset",
    "ResumableBatchSampler",
    "encode_prompt",
    "load_rows",
    "make_arithmetic_split",
    "train_eval_split",
]

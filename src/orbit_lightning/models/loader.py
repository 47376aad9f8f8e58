"""`load_model`: HF checkpoint directory (or a named preset) -> our CausalLM, optionally on a packed base.

The model is built on the meta device, its storage is allocated once (`to_empty`), and tensors are streamed in
one at a time (quantized on the fly when asked), so peak host memory stays near one tensor beyond the model.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from .attention import make_rotary
from .config import ModelConfig
from .decoder import CausalLM
from .moe import Experts
from .presets import PRESETS, preset_hf_config

log = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def load_model(
    path_or_preset: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    quant: str | None = None,
    int4_layout: str = "auto",
    seed: int = 0,
    **config_overrides,
) -> CausalLM:
    """Load a HF checkpoint dir or build a preset. `quant` in {"int4", "int4-g64", "int4-g128", "fp8", "mxfp4",
    "nvfp4", "nf4"} (or an int4 name ending in -tiled: the decode kernels' block layout, quant/formats/tiled.py) keeps
    linear layers and routed experts packed; a pre-quantized checkpoint loads as is (or, asked for the tiled layout
    of its int4, reordered as it loads). `int4_layout` (auto | row-major | tiled): how int4 is stored; auto is the
    tiled layout on CUDA (quant/formats/int4.py, int4_storage_name), row-major elsewhere."""
    from ..quant.apply import DEFAULT_SKIP, checkpoint_format, checkpoint_skip, quantize_model
    from ..quant.formats import get_format, int4_storage_name

    device = torch.device(device or "cpu")
    name = str(path_or_preset)
    is_preset = name in PRESETS and not Path(name).is_dir()
    if is_preset:
        hf, files = preset_hf_config(name, **config_overrides), []
    else:
        hf, files = _read_checkpoint_dir(Path(name))
        hf.update(config_overrides)
    cfg = ModelConfig.from_hf(hf)
    dtype = dtype or _config_dtype(hf)
    ckpt_fmt = checkpoint_format(hf)  # a QuantFormat when the checkpoint itself is packed
    if ckpt_fmt is not None and quant is not None and not get_format(quant).same_values(ckpt_fmt):
        raise ValueError(f"checkpoint {name} is already quantized as {ckpt_fmt.name!r}; load it with "
                         f"quant=None or quant={ckpt_fmt.name!r} (re-quantizing to {quant!r} is lossy)")
    fmt_name = int4_storage_name(quant or (ckpt_fmt.name if ckpt_fmt else None), int4_layout, device)

    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to(dtype)
    if fmt_name is not None:  # on the meta device: `to_empty` then allocates packed storage only
        # A pre-quantized checkpoint's own ignore list wins: those layers ship unpacked and stay that way.
        quantize_model(model, fmt_name, skip=DEFAULT_SKIP + (checkpoint_skip(hf) if ckpt_fmt else ()))
    model.to_empty(device=device)
    model.model.rotary = make_rotary(cfg).to(device)  # non-persistent buffers are not in checkpoints
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(fmt_name is None)

    if device.type == "meta":
        return model  # shapes only (memory planning)
    if is_preset:
        _random_init(model, seed)
    else:
        _stream_tensors(model, files, cfg)
    return model.eval()


def _config_dtype(hf: dict) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else torch.float32


def _read_checkpoint_dir(path: Path) -> tuple[dict, list[Path]]:
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (and {path.name!r} is not a preset; "
                                f"presets: {', '.join(sorted(PRESETS))})")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; expected a HF checkpoint directory")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"shard {f} listed in the index is missing")
    return hf, files


def _resolve(model: nn.Module, key: str) -> tuple[str, nn.Module, str, int | None]:
    """HF key -> (module path, module, local tensor name, expert index or None)."""
    m = _EXPERT_KEY.match(key)
    if m:
        path, expert, proj, suffix = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        local = f"{proj}.{suffix}"
    else:
        path, _, local = key.rpartition(".")
        expert = None
    try:
        return path, model.get_submodule(path), local, expert
    except AttributeError:
        raise KeyError(key) from None


def _stream_tensors(model: CausalLM, files: list[Path], cfg: ModelConfig) -> None:
    filled: dict[str, set] = defaultdict(set)
    unexpected = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if _IGNORED.search(key) or _beyond_layers(key, cfg.num_hidden_layers):
                        continue
                    try:
                        path, module, local, expert = _resolve(model, key)
                    except KeyError:
                        unexpected.append(key)
                        continue
                    load_tensor(module, local, f.get_tensor(key), expert, key)
                    canon = getattr(module, "canonical_checkpoint_name", None)
                    filled[path].add((canon(local) if canon else local, expert))
        except SafetensorError as e:
            raise ValueError(f"cannot read {file}: {e} (corrupt or truncated safetensors file?)") from e
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensors this model does not have, e.g. "
                         f"{unexpected[:5]}; is config.json from the same model?")
    missing = []
    for path, module in model.named_modules():
        want = expected_tensors(module)
        if not want:
            continue
        if path == "lm_head" and cfg.tie_word_embeddings:
            continue
        missing += [f"{path}.{n}" + ("" if e is None else f"[expert {e}]") for n, e in want - filled[path]]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def _beyond_layers(key: str, n_layers: int) -> bool:
    # DeepSeek-V3 ships its multi-token-prediction block as an extra layer; we do not use it.
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= n_layers


def expected_tensors(module: nn.Module) -> set[tuple[str, int | None]]:
    """The (local name, expert) pairs a checkpoint must provide for this module alone (not its children)."""
    if hasattr(module, "expected_checkpoint_tensors"):
        return module.expected_checkpoint_tensors()
    own = [n for n, _ in module.named_parameters(recurse=False)]
    own += [n for n, _ in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
    if isinstance(module, Experts):
        return {(f"{n}.weight", e) for n in own for e in range(module.num_experts)}
    return {(n, None) for n in own}


@torch.no_grad()
def load_tensor(module: nn.Module, local: str, tensor: Tensor, expert: int | None, key: str) -> None:
    """Copy one checkpoint tensor into `module`; quantized modules quantize or copy packed data themselves."""
    if hasattr(module, "load_checkpoint_tensor"):
        module.load_checkpoint_tensor(local, tensor, expert, key)
        return
    if expert is not None:
        proj, suffix = local.split(".")
        if suffix != "weight":
            raise ValueError(f"{key}: unexpected expert tensor {suffix!r} for an unquantized model")
        target = getattr(module, proj)[expert]
    else:
        target = getattr(module, local, None)
        if not isinstance(target, Tensor):
            raise ValueError(f"{key}: {type(module).__name__} has no tensor {local!r}")
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}; "
                         "is config.json from the same model?")
    target.copy_(tensor)


@torch.no_grad()
def _random_init(model: CausalLM, seed: int) -> None:
    g = torch.Generator(device=next(iter(model.state_dict().values())).device).manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "random_init"):
            module.random_init(g)
            continue
        for name, p in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if name in module._non_persistent_buffers_set:
                continue
            if name == "weight" and p.dim() == 1 or name.endswith("bias") and p.dim() == 1:
                p.fill_(1.0 if name == "weight" else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=g)

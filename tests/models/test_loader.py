"""load_model: streaming memory, bad input, sharded checkpoints, presets."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from orbit_lightning import load_model
from tests.hf_models import make_hf_model, padded_batch, save_hf_model


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("qwen3_moe-top2"), tmp_path_factory.mktemp("ckpt") / "m")


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_model("deepseek_v3-qlora")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_model(tmp_path)
    ids, mask, _ = padded_batch(hf.config.vocab_size, [5, 5])
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max() <= 1e-4


def test_missing_directory_names_presets(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*presets"):
        load_model(tmp_path / "nope")


def test_unsupported_model_type(qwen_dir, tmp_path):
    cfg = json.loads((qwen_dir / "config.json").read_text())
    cfg["model_type"] = "llama4"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((qwen_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="unsupported model_type 'llama4'"):
        load_model(tmp_path)


def _rewrite(qwen_dir, tmp_path, edit):
    tensors = load_file(qwen_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((qwen_dir / "config.json").read_text())
    return tmp_path


def test_missing_tensor(qwen_dir, tmp_path):
    d = _rewrite(qwen_dir, tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*experts.up_proj.weight\[expert 3\]"):
        load_model(d)


def test_unexpected_tensor(qwen_dir, tmp_path):
    d = _rewrite(qwen_dir, tmp_path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="does not have.*model.layers.0.extra.weight"):
        load_model(d)


def test_shape_mismatch(qwen_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)

    with pytest.raises(ValueError, match=r"q_proj.weight: checkpoint shape \(3, 3\) != model shape"):
        load_model(_rewrite(qwen_dir, tmp_path, edit))


def test_corrupt_safetensors(qwen_dir, tmp_path):
    (tmp_path / "config.json").write_text((qwen_dir / "config.json").read_text())
    data = (qwen_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_model(tmp_path)


def test_missing_weights_file(qwen_dir, tmp_path):
    (tmp_path / "config.json").write_text((qwen_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        load_model(tmp_path)


def test_unknown_preset_lists_choices():
    with pytest.raises(FileNotFoundError, match="tiny-qwen3"):
        load_model("tiny-llama")


def test_loader_streams_tensors(tmp_path):
    """Peak anonymous memory while loading stays near one model, not two (measured in a fresh process).

    safetensors maps the file; mapped pages are file-backed (RssFile), so RssAnon counts only what the loader
    allocates. A loader that built a state dict and then the model (or init'd then copied) would need ~2x.
    """
    hf = make_hf_model("qwen3", hidden_size=512, intermediate_size=2048, num_hidden_layers=6, vocab_size=16384)
    model_bytes = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    save_hf_model(hf, tmp_path)
    del hf
    script = textwrap.dedent(f"""
        import threading, time, torch
        from orbit_lightning import load_model
        def anon():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        load_model("tiny-qwen3")  # warm up imports and allocator
        base, peak, done = anon(), [0], [False]
        def sample():
            while not done[0]:
                peak[0] = max(peak[0], anon()); time.sleep(0.0005)
        t = threading.Thread(target=sample); t.start()
        m = load_model({str(tmp_path)!r})
        done[0] = True; t.join()
        print(max(peak[0], anon()) - base)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    delta = int(out.stdout.strip().splitlines()[-1])
    assert delta < 1.5 * model_bytes, (delta, model_bytes)

import importlib.util
import json
import logging

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from orbit_lightning.data import CharTokenizer, PromptDataset, load_rows, train_eval_split

ROWS = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+20=", "answer": 30, "level": 2}]


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level HF tokenizer with a jinja chat template, built offline."""
    words = ["<unk>", "<s>", "<|user|>", "<|assistant|>", "<|end|>", "what", "is", "2", "+", "3", "="]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tok


def test_items_from_list_with_char_tokenizer():
    tok = CharTokenizer()
    ds = PromptDataset(ROWS, tok)
    assert len(ds) == 2
    item = ds[1]
    assert item["prompt_ids"] == [tok.bos_token_id] + tok.encode("10+20=")
    assert item["prompt"] == "10+20=" and item["answer"] == "30" and item["index"] == 1
    assert item["metadata"] == {"answer": "30", "level": 2}


def test_jsonl_and_json_files_with_custom_keys(tmp_path):
    rows = [{"question": "1+1=", "solution": "2"}, {"question": "2+2=", "solution": "4"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "p.json").write_text(json.dumps(rows))
    for name in ("p.jsonl", "p.json"):
        ds = PromptDataset(tmp_path / name, CharTokenizer(), prompt_key="question", answer_key="solution")
        assert [x["answer"] for x in ds] == ["2", "4"]
        assert ds[0]["metadata"] == {"solution": "2", "answer": "2"}  # answer mirrored for built-in rewards
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1="}\n{oops\n')
    with pytest.raises(ValueError, match="line 2"):
        load_rows(tmp_path / "bad.jsonl")


def test_chat_template_path():
    tok = chat_tokenizer()
    ds = PromptDataset([{"prompt": "what is 2 + 3 =", "answer": "5"}], tok)
    item = ds[0]
    assert item["prompt"] == "<s><|user|> what is 2 + 3 = <|end|> <|assistant|>"
    # hand-mapped through the word list: <s> <|user|> what is 2 + 3 = <|end|> <|assistant|>
    assert item["prompt_ids"] == [1, 2, 5, 6, 7, 8, 9, 10, 4, 3]
    messages = [{"role": "system", "content": "2"}, {"role": "user", "content": "3"}]
    assert PromptDataset([{"prompt": messages}], tok)[0]["prompt_ids"] == [1, 0, 7, 4, 2, 9, 4, 3]


def test_long_prompts_dropped_with_warning(caplog):
    rows = [{"prompt": "1" * n} for n in (3, 8, 4, 9)]
    with caplog.at_level(logging.WARNING, logger="orbit_lightning.data.prompts"):
        ds = PromptDataset(rows, CharTokenizer(), max_prompt_tokens=5)  # bos + 4 chars fits
    assert [x["index"] for x in ds] == [0, 2] and ds[1]["answer"] is None
    assert "dropped 2 of 4 prompts" in caplog.text
    with pytest.raises(ValueError, match="all 4 prompts"):
        PromptDataset(rows, CharTokenizer(), max_prompt_tokens=2)


def test_clear_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl.*is empty"):
        PromptDataset(tmp_path / "empty.jsonl", CharTokenizer())
    with pytest.raises(KeyError, match="'text'.*prompt_key"):
        PromptDataset([{"text": "1="}], CharTokenizer())
    for missing in ("missing.csv", "missing.jsonl", "missing.json"):  # the path is named, whatever its kind
        with pytest.raises(FileNotFoundError, match=f"prompt source .*{missing}' does not exist"):
            load_rows(tmp_path / missing)
    with pytest.raises(ValueError, match="jsonl"):
        (tmp_path / "rows.csv").write_text("prompt\n")
        load_rows(tmp_path / "rows.csv")
    with pytest.raises(ValueError, match="'#'"):
        PromptDataset([{"prompt": "#"}], CharTokenizer())


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_directory_without_datasets_says_what_to_install(tmp_path):
    with pytest.raises(ImportError, match="pip install datasets"):
        load_rows(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs the datasets package")
def test_hf_directory(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(tmp_path)
    assert load_rows(tmp_path, split="train") == ROWS[:1]
    with pytest.raises(ValueError, match="split"):
        load_rows(tmp_path)


def test_train_eval_split():
    items = list(range(20))
    train, evals = train_eval_split(items, eval_fraction=0.25, seed=3)
    assert len(evals) == 5 and sorted(train + evals) == items
    assert (train, evals) == train_eval_split(items, eval_size=5, seed=3)
    assert train_eval_split(items, eval_size=5, seed=4) != (train, evals)
    with pytest.raises(ValueError, match="exactly one"):
        train_eval_split(items)
    with pytest.raises(ValueError, match="non-empty"):
        train_eval_split(items, eval_size=20)

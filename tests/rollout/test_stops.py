"""Stop checks of a decode step's tokens (rollout/sequence.py `append_tokens`) against a token-by-token reference
that decodes the whole generation after every token, with a character tokenizer and a byte-level BPE."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from orbit_lightning.data.tokenizer import CharTokenizer
from orbit_lightning.rollout import SamplingParams
from orbit_lightning.rollout.sequence import Request, Sequence, append_tokens


def _reference(prompt, tokens, params, eos_ids, max_model_len, tokenizer):
    """(kept tokens, finish_reason, stop_reason): vLLM's checks after each appended token, on the full text."""
    out = []
    for tok in tokens:
        out.append(tok)
        if not params.ignore_eos and tok in eos_ids:
            return out, "stop", None
        if params.stop_token_ids and tok in params.stop_token_ids:
            return out, "stop", tok
        if params.stop_strings and tokenizer is not None:
            text, before = tokenizer.decode(out), tokenizer.decode(out[:-1])
            longest = max(map(len, params.stop_strings))
            for s in params.stop_strings:
                if s in text[max(0, len(before) - longest + 1):]:
                    return out, "stop", s
        if (params.max_new_tokens is not None and len(out) >= params.max_new_tokens) or \
                len(prompt) + len(out) >= max_model_len:  # fmt: skip
            return out, "length", None
    return out, None, None


def _run_in_blocks(prompt, tokens, params, eos_ids, max_model_len, tokenizer, block):
    seq = Sequence(Request("r", prompt, params, 0), 0, None, list(prompt))
    for i in range(0, len(tokens), block):
        if seq.finish_reason is not None:
            break
        chunk = tokens[i : i + block]
        append_tokens(seq, chunk, [float(-t) for t in chunk], 7, eos_ids, max_model_len, tokenizer)
    gen = seq.tokens[len(prompt) :]
    assert seq.logprobs == [float(-t) for t in gen] and seq.versions == [7] * len(gen)
    return gen, seq.finish_reason, seq.stop_reason


def _byte_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the answer is 42 </answer> héllo wörld ✓ 数学 = 3+4 \n"] * 50
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("kind", ["char", "byte-bpe"])
def test_block_stop_checks_match_the_token_by_token_reference(kind):
    tokenizer = CharTokenizer() if kind == "char" else _byte_bpe()
    vocab = tokenizer.vocab_size if kind == "char" else len(tokenizer)
    words = ["42", "</answer>", "ö", "✓", "数", "3+4"] if kind == "byte-bpe" else ["42", "3+4", "==", "a"]
    rng = random.Random(0)
    checked = 0
    for trial in range(300):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 6))]
        n_tokens = rng.randrange(1, 80)
        tokens = [rng.randrange(0, vocab) for _ in range(n_tokens)]
        if kind == "byte-bpe" and trial % 2:  # splice in encoded stop-string material so the strings do occur
            tokens = tokens[: n_tokens // 2] + tokenizer.encode(rng.choice(words)) + tokens[n_tokens // 2 :]
        params = SamplingParams(
            max_new_tokens=rng.choice([None, rng.randrange(1, 90)]), ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(vocab), 2) if rng.random() < 0.3 else None,
            stop=rng.sample(words, 2) if rng.random() < 0.7 else None)  # fmt: skip
        eos_ids = {2} if kind == "char" else {rng.randrange(vocab)}
        max_len = len(prompt) + rng.randrange(1, 100)
        want = _reference(prompt, tokens, params, eos_ids, max_len, tokenizer)
        for block in (1, 3, 8):
            assert _run_in_blocks(prompt, tokens, params, eos_ids, max_len, tokenizer, block) == want, (trial, block)
        checked += want[1] == "stop" and isinstance(want[2], str)
    assert checked > 20  # stop strings did end a good share of the trials


def test_long_generations_check_stop_strings_in_a_window():
    """Past the window the check decodes a bounded suffix, once per token: the full decode's answer, far cheaper."""
    tokenizer = CharTokenizer()
    prompt = tokenizer.encode("1+1=")
    body = tokenizer.encode("2" * 3000 + "stop")
    params = SamplingParams(max_new_tokens=None, stop=["stop"])
    calls = []
    decode = tokenizer.decode
    tokenizer.decode = lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw)
    gen, reason, why = _run_in_blocks(prompt, body, params, set(), 10_000, tokenizer, 8)
    assert (gen, reason, why) == (body, "stop", "stop")
    assert len(calls) <= len(body) + len(body) // 8 + 1  # one decode per token, one more per decode step
    assert max(calls) <= 4 * len("stop") + 8 + 8  # the window (4 x longest + 8) and a decode step's 8 new tokens

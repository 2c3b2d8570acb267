"""Build a chat tokenizer for a dummy-weight Llama-3-shaped model, so that a GPU run can serve the
OpenAI chat endpoint (tokenizer, chat template, constrained decoding) without downloading anything.

Why this exists: dummy weights come without a tokenizer, and without one sglang can only serve
``/generate`` with token ids (``--skip-tokenizer-init``). toolkv's zero-change mode reacts to a chat
answer whose ``finish_reason`` is ``"tool_calls"``, which needs the chat endpoint, a chat template and
sglang's constrained decoding (``tool_choice="required"`` compiles a JSON schema with xgrammar).

What it builds (byte-level BPE, the scheme Llama 3 uses):
  * ids 0..255: the 256 byte symbols, so every text encodes and every id decodes;
  * merges learnt from a small built-in corpus of JSON and chat text (a few thousand tokens);
  * filler tokens up to id 127,999 (decodable, never produced by encoding), so that every id the
    model can emit (its vocabulary is 128,256) decodes without error;
  * special tokens at the ids the model config names (bos 128000, eos 128001, eot 128009) and
    reserved ones up to 128,255.

    python scripts/stage/make_tokenizer.py OUTDIR [--vocab 128256]
writes OUTDIR/tokenizer.json, tokenizer_config.json, special_tokens_map.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
START, END = "<|start_header_id|>", "<|end_header_id|>"
FIRST_SPECIAL = 128_000

# A chat template over those specials. Tool calls of an assistant turn are rendered as JSON and a
# tool result as a "tool" turn, so a multi-turn agent conversation renders to one token prefix that
# grows turn by turn (what toolkv offloads and restores).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m.get('content') %}{{ m['content'] if m['content'] is string else m['content'] | tojson }}{% endif %}"
    "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}"
    "<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def corpus() -> list[str]:
    """Text whose merges make JSON tool calls and chat turns a few tokens each."""
    words = [
        "the",
        "a",
        "an",
        "and",
        "or",
        "of",
        "to",
        "in",
        "is",
        "it",
        "for",
        "on",
        "with",
        "as",
        "by",
        "at",
        "from",
        "this",
        "that",
        "be",
        "are",
        "was",
        "name",
        "parameters",
        "arguments",
        "function",
        "tool",
        "call",
        "result",
        "search",
        "query",
        "run",
        "code",
        "python",
        "file",
        "read",
        "write",
        "user",
        "assistant",
        "system",
        "weather",
        "city",
        "true",
        "false",
        "null",
        "value",
        "id",
        "type",
        "object",
        "array",
    ]
    lines = []
    for i, w in enumerate(words):
        lines.append(f'[{{"name": "{w}", "parameters": {{"n": {i}}}}}]')
        lines.append(f'{{"{w}": "{words[(i * 7) % len(words)]}", "k": [{i}, {i + 1}]}}')
        lines.append(" ".join(words[i:] + words[:i]))
    return lines * 20


def build(vocab_size: int) -> Tokenizer:
    assert vocab_size > FIRST_SPECIAL + 16, "the specials need ids from 128000 on"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    i = 0
    while len(vocab) < FIRST_SPECIAL:  # decodable fillers: every id below the specials is a token
        filler = f"Ġ~{i:x}"
        if filler not in vocab:
            vocab[filler] = len(vocab)
        i += 1
    assert sorted(vocab.values()) == list(range(FIRST_SPECIAL))
    tok = Tokenizer.from_str(json.dumps(state))
    specials = [BOS, EOS] + [f"<|reserved_special_token_{k}|>" for k in range(vocab_size - FIRST_SPECIAL - 2)]
    specials[9] = EOT  # 128009
    specials[6], specials[7] = START, END  # 128006, 128007
    assert tok.add_special_tokens(specials) == len(specials)
    for name, want in ((BOS, 128_000), (EOS, 128_001), (EOT, 128_009)):
        assert tok.token_to_id(name) == want, (name, tok.token_to_id(name))
    assert tok.get_vocab_size() == vocab_size
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=128_256)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tok = build(a.vocab)
    tok.save(str(a.out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,  # the model config's eos_token_id (128001): sglang's authoritative stop token
        "pad_token": EOT,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (a.out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (a.out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": EOT}, indent=1)
    )
    sample = '[{"name": "run_code", "parameters": {}}]'
    print(f"tokenizer: {tok.get_vocab_size()} ids; {sample!r} -> {len(tok.encode(sample).ids)} tokens")


if __name__ == "__main__":
    main()

"""A tiny random Llama with a byte-level BPE tokenizer trained at fixture time, and a chat
template: what real models look like to the gateway (a character spans several tokens,
text re-encodes to other ids than were generated, chat prompts are templated).

The tokenizer is trained with `tokenizers` over text rich in multi-byte UTF-8 (CJK, emoji,
accented Latin, Cyrillic, Hangul); nothing is downloaded.
"""

from __future__ import annotations

import random
from pathlib import Path

PHRASES = [
    "東京は日本の首都です", "中文分词很有趣", "😀🎉🚀✨🌍", "café naïve résumé déjà vu",
    "Ærøskøbing ligger på Ærø", "hello world, again", "ñandú pingüino", "한국어 텍스트 처리",
    "Привет, мир", "Grüße aus Köln", "ελληνικά γράμματα", "the quick brown fox",
]
SPECIAL = ["<s>", "</s>", "<pad>"]
# Renders like many instruction models: role headers, then the assistant's header when a
# generation is asked for.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(PHRASES) for _ in range(6)) for _ in range(lines)]


def build_bpe_llama(directory: Path, seed: int = 0, vocab_size: int = 512,
                    max_positions: int = 1024) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)

    torch.manual_seed(seed)
    vocab = tokenizer.get_vocab_size()
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=max_positions, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32",
        # Wide weights: greedy output wanders over the vocabulary (at the usual 0.02 a random
        # model repeats one token, which re-encodes the same however it is resumed).
        initializer_range=0.5,
    )
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory

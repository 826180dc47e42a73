"""A Qwen3-4B-shaped model with random weights, made on the GPU host instead of carried (8 GB).

Writes a Hugging Face model directory that SGLang serves: `config.json` (Qwen3ForCausalLM with
Qwen3-4B's geometry, max positions raised so 128K+ contexts are allowed), a word-level tokenizer
with one token per id (`t123`; random ids decode to words, so the OpenAI endpoints work), and:
- `--weights`: random weights (transformers' own init, std 0.02) as safetensors, for servers that
  load them (correctness: outputs mean something to compare); with `--layers 4` about 1.6 GB;
- without: no weights; serve with `--load-format dummy` (SGLang fills random weights itself),
  which is what the latency benchmark uses at 36 layers (the same for dense and sas).
Beside it, `<out>-gate/`: a seeded-init SAS gate checkpoint fitting the model (untrained: speed
and plumbing only, selection quality means nothing).

    python gpu_kit/make_model.py --out /tmp/sas-gpu/qwen3-4b-shape                # config + tokenizer (dummy load)
    python gpu_kit/make_model.py --out /tmp/sas-gpu/qwen3-4l --layers 4 --weights # small, with weights
    python gpu_kit/make_model.py --out /tmp/m --tiny --weights --check            # CPU rehearsal
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

# Qwen3-4B (Qwen/Qwen3-4B config.json), max_position_embeddings raised for long-context benchmarks.
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "max_position_embeddings": 270336, "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64}
SPECIAL = {151643: "<|endoftext|>", 151645: "<|im_end|>"}


def model_config(layers: int | None = None, tiny: bool = False) -> dict:
    """The config dict: Qwen3-4B's geometry (TINY's with tiny), `layers` overriding the depth."""
    cfg = dict(QWEN3_4B, **(TINY if tiny else {}))
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def write_tokenizer(out: pathlib.Path, vocab_size: int) -> None:
    """A word-level fast tokenizer: token `t<i>` is id i (the special ids keep Qwen's names)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {SPECIAL.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token=SPECIAL[151643],
                                   eos_token=SPECIAL[151645], pad_token=SPECIAL[151643])
    fast.save_pretrained(str(out))


def write_weights(out: pathlib.Path, cfg: dict) -> int:
    """Random weights (transformers' init) as bf16 safetensors; returns the parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def check(out: pathlib.Path, with_weights: bool) -> dict:
    """Load what was written (tokenizer round trip; with weights, one forward pass)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    ids = [5, 17, 151000, 42]
    text = tok.decode(ids)
    result = {"decoded": text, "round_trip": tok(text, add_special_tokens=False)["input_ids"] == ids}
    if with_weights:
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        logits = model(torch.tensor([ids])).logits
        result["logits_shape"] = list(logits.shape)
        result["finite"] = bool(torch.isfinite(logits).all())
    return result


def make(out: pathlib.Path, layers: int | None, tiny: bool, weights: bool, gate: bool = True) -> dict:
    """Write the model (and its gate at `<out>-gate`); returns a record of what was written."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(layers, tiny)
    record = {"model": out.name, "layers": cfg["num_hidden_layers"], "weights": weights}
    if weights:
        record["params"] = write_weights(out, cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")  # after save_pretrained: ours wins
    write_tokenizer(out, cfg["vocab_size"])
    if gate:
        from sas_backend.gate.checkpoint import init_gate_checkpoint

        gate_dir = out.parent / f"{out.name}-gate"
        init_gate_checkpoint(gate_dir, model_dir=out, seed=0)
        record["gate"] = gate_dir.name
    return record


def main(argv=None) -> int:
    """CLI (see the module doc); prints the record as JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="depth (default Qwen3-4B's 36)")
    ap.add_argument("--weights", action="store_true", help="write random weights (else serve with --load-format dummy)")
    ap.add_argument("--tiny", action="store_true", help="a tiny geometry (CPU rehearsal)")
    ap.add_argument("--check", action="store_true", help="load it back with transformers")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    record = make(out, args.layers, args.tiny, args.weights)
    if args.check:
        record["check"] = check(out, args.weights)
    print(json.dumps(record))
    ok = not args.check or (record["check"]["round_trip"] and record["check"].get("finite", True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

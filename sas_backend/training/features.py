"""Cached dense features of a frozen model, for fast gate distillation.

Distillation never runs gated attention: the backbone's forward stays dense, and the loss of layer
i depends only on that layer's pre-RoPE q and k and on the dense attention it distills. So the
backbone's work (almost all of a distill step's time on a CPU) can be done once per training row.
`build_feature_cache` runs the frozen model densely over each row and writes, per layer i:

    q.{i}       [N, Hq, D]     fp16  pre-RoPE queries of the row's last N positions (the tail)
    pooled.{i}  [NB_c * n, Hkv, 3D] fp16  max|min|mean of every complete block's pre-RoPE keys; with
                                     --sub-blocks n, of each run of b / n tokens (run j of block m
                                     in row m * n + j), from which any coarser runs can be pooled
    target.{i}  [Hkv, N, NB]   fp16  the distill target (`model.pooled_attention_target`): dense
                                     attention pooled per block ("mass": summed, the oracle's
                                     quantity; "max": SeerAttention-R), max over the kv group's
                                     heads, renormalized over the previous blocks

(NB_c = L // b complete blocks, NB = ceil(L / b)), one safetensors file per row
(`row-00012.safetensors`) and `manifest.json` saying what was cached (model, data record, seq len,
tail, block size, target, recall rows, the build command). A build resumes: rows already written are skipped.
`python -m sas_backend.training.distill_cached` trains gates on a cache (milliseconds of gate math
per row instead of a full model forward).

    python -m sas_backend.training.features --model DIR --data @essays @stdlib --out DIR
        [--seq-len 4096] [--tail 1024] [--block-size 64] [--sub-blocks 1] [--target mass|max] [--split train|heldout]
        [--seed 0] [--max-rows N] [--recall-rows FRACTION] [--recall-facts N] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from sas_backend.hf.causal import causal_sdpa
from sas_backend.hf.sparse_eval import model_rope_table
from sas_backend.ops import sub_blocks_ok
from sas_backend.ops.rope import invert_rope
from sas_backend.ops.summary.torch_path import pool_block_keys

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
CAPTURE_ATTN = "sas_feature_capture"
STORE_DTYPE = torch.float16
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class FeatureCacheError(ValueError):
    """A feature cache that is missing, incomplete, corrupt or made for other settings."""


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """What a cache holds: the last `tail` positions of rows of `seq_len` tokens are the queries;
    blocks of `block_size`, their keys pooled per run of block_size / sub_blocks tokens; distill `target` "mass"
    or "max" (per block)."""

    seq_len: int = 4096
    tail: int = 1024
    block_size: int = 64
    target: str = "mass"
    sub_blocks: int = 1

    def __post_init__(self):
        from sas_backend.training.model import DISTILL_TARGETS

        if self.target not in DISTILL_TARGETS:
            raise ValueError(f"target must be one of {DISTILL_TARGETS}, got {self.target!r}")
        if self.block_size < 1 or self.seq_len < 2 * self.block_size:
            raise ValueError(f"seq_len {self.seq_len} must hold at least two blocks of {self.block_size}")
        n = self.sub_blocks
        if not sub_blocks_ok(n, self.block_size):
            raise ValueError(f"sub_blocks must be a power of two dividing the block size {self.block_size}, got {n}")
        if not 1 <= self.tail <= self.seq_len - self.block_size:
            raise ValueError(f"tail {self.tail} must be in [1, seq_len - block_size = "
                             f"{self.seq_len - self.block_size}] (a query needs a previous block)")

    @property
    def num_blocks(self) -> int:
        """NB = ceil(seq_len / block_size), the block axis of the targets."""
        return -(-self.seq_len // self.block_size)

    @classmethod
    def from_manifest(cls, m: dict) -> "FeatureSpec":
        """The spec a manifest records (caches made before sub-block pooling: one run a block)."""
        return cls(m["seq_len"], m["tail"], m["block_size"], m["target"], m.get("sub_blocks", 1))

    def record(self) -> dict:
        """The manifest's fields for this spec (sub_blocks only when above 1: older caches keep resuming)."""
        d = dataclasses.asdict(self)
        if d["sub_blocks"] == 1:
            del d["sub_blocks"]
        return d


def pool_runs(pooled: torch.Tensor, have: int, want: int) -> torch.Tensor:
    """`[NB * have, ..., 3D]` max|min|mean pooled per run of b / have tokens -> `[NB * want, ..., 3D]` per run of
    b / want (want dividing have): the max of the maxes, the min of the mins, the mean of the means (equal runs)."""
    if have % want:
        raise ValueError(f"runs of b / {have} cannot be regrouped into b / {want} (want must divide have)")
    if have == want:
        return pooled
    x = pooled.unflatten(0, (-1, have // want))  # [NB * want, have / want, ..., 3D]
    mx, mn, mean = x.chunk(3, dim=-1)
    return torch.cat([mx.amax(dim=1), mn.amin(dim=1), mean.mean(dim=1)], dim=-1)


def row_file(i: int) -> str:
    return f"row-{i:05d}.safetensors"


def _capture_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers attention function: dense causal attention, and the layer's features stored in
    `module._sas_capture["out"][layer]`. query `[1, Hq, L, D]`, key/value `[1, Hkv, L, D]` post-RoPE."""
    from sas_backend.training.model import pooled_attention_target

    ctx = module._sas_capture
    spec: FeatureSpec = ctx["spec"]
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError("feature capture runs one whole row at a time (batch 1, no KV cache)")
    length, b = key.shape[2], spec.block_size
    table = ctx["model_table"]
    q = query[0].transpose(0, 1)  # [L, Hq, D]
    k = key[0].transpose(0, 1)  # [L, Hkv, D]
    start = length - spec.tail
    q_tail_pre = invert_rope(q[start:].float(), table[start:length])
    k_pre = invert_rope(k.float(), table[:length])
    full, n = length // b, spec.sub_blocks
    pooled = pool_block_keys(k_pre[: full * b].view(full * n, b // n, k.shape[1], k.shape[2]))  # [NB_c * n, Hkv, 3D]
    target = pooled_attention_target(q[start:], k, [(0, length)], b, spec.num_blocks, scaling,
                                     query_start=start, pool=spec.target)
    ctx["out"][module.layer_idx] = {"q": q_tail_pre, "pooled": pooled, "target": target}
    return causal_sdpa(query, key, value, scaling).transpose(1, 2), None


@torch.no_grad()
def row_features(model, ids: torch.Tensor, spec: FeatureSpec) -> Dict[str, torch.Tensor]:
    """Features of one row `[L]` (L = spec.seq_len): `{"q.{i}", "pooled.{i}", "target.{i}"}` per
    layer i, shapes in the module docstring, stored dtype fp16. The model runs densely (SDPA)."""
    from transformers import AttentionInterface

    if ids.dim() != 1 or ids.shape[0] != spec.seq_len:
        raise ValueError(f"a row must be [{spec.seq_len}] token ids, got {tuple(ids.shape)}")
    device = next(model.parameters()).device
    layers = [layer.self_attn for layer in model.model.layers]
    ctx = {"spec": spec, "model_table": model_rope_table(model, spec.seq_len, device), "out": {}}
    AttentionInterface.register(CAPTURE_ATTN, _capture_attention)
    previous = model.config._attn_implementation
    for attn in layers:
        attn._sas_capture = ctx
    model.set_attn_implementation(CAPTURE_ATTN)
    try:
        model(input_ids=ids[None].to(device), logits_to_keep=1, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        for attn in layers:
            del attn._sas_capture
    out = {}
    for i, feats in sorted(ctx["out"].items()):
        for name, t in feats.items():
            out[f"{name}.{i}"] = t.to(STORE_DTYPE).contiguous().cpu()
    return out


def _manifest(spec: FeatureSpec, model_dir: str, geometry, data_record: dict, recall: Optional[dict],
              rows: int, seed: int, compute_dtype: str = "float32") -> dict:
    from sas_backend.provenance import portable_path

    # only a non-default forward dtype is recorded: caches built before the option keep their manifest
    extra = {} if compute_dtype == "float32" else {"compute_dtype": compute_dtype}
    return {
        "format_version": FORMAT_VERSION,
        "model": portable_path(model_dir),
        "num_layers": geometry.num_layers,
        "num_attention_heads": geometry.num_q_heads,
        "num_key_value_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        **spec.record(),
        "rows": rows,
        "seed": seed,
        "data": data_record,
        "recall": recall,
        "dtype": str(STORE_DTYPE).removeprefix("torch."),
        "method": "dense forward of the frozen model; per layer the tail's pre-RoPE q, the blocks' pooled "
                  "pre-RoPE keys and the distill target (sas_backend.training.features)",
        **extra,
    }


def build_feature_cache(model, rows: torch.Tensor, spec: FeatureSpec, out_dir: str, manifest: dict,
                        progress=None, shard=(0, 1)) -> int:
    """Write the features of every row `[R, L]` into `out_dir` (module docstring), skipping rows a
    previous build wrote with the same manifest. shard (I, N): only the rows r with r % N == I, so N
    processes can fill one cache. Returns the number of rows written now.
    Raises FeatureCacheError if `out_dir` holds a cache made with other settings."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, MANIFEST)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        if old != manifest:
            diff = sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))
            raise FeatureCacheError(f"{out_dir} holds a feature cache made with other settings ({', '.join(diff)}); "
                                    "use another directory or delete it")
    else:
        tmp = f"{path}.{os.getpid()}.tmp"  # shards may start together
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, path)
    from safetensors.torch import save_file

    written = 0
    for i in range(rows.shape[0]):
        target = os.path.join(out_dir, row_file(i))
        if i % shard[1] == shard[0] and not os.path.exists(target):
            save_file(row_features(model, rows[i], spec), target + ".tmp")
            os.replace(target + ".tmp", target)  # a killed build never leaves a half row
            written += 1
        if progress is not None:
            progress(i + 1, rows.shape[0])
    return written


@dataclasses.dataclass
class FeatureCache:
    """A loaded cache: `manifest` and per row `{name: tensor}` (fp16, as stored); `rows` is a list, or
    `LazyRows` (read from disk on each access) when loaded with lazy=True."""

    manifest: dict
    rows: Sequence[Dict[str, torch.Tensor]]

    @property
    def spec(self) -> FeatureSpec:
        return FeatureSpec.from_manifest(self.manifest)

    @property
    def num_layers(self) -> int:
        return int(self.manifest["num_layers"])


class LazyRows(Sequence):
    """The rows of a cache, each read from its file when indexed (the page cache keeps hot ones): a
    training set of many rows need not fit in memory (at 4096 tokens and tail 1024 a row is ~47 MB)."""

    def __init__(self, files: List[str]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        from safetensors.torch import load_file

        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return load_file(self.files[i])


def load_feature_cache(cache_dir: str, max_rows: Optional[int] = None, lazy: bool = False) -> FeatureCache:
    """Read a cache written by `build_feature_cache` (all rows, or the first `max_rows`).
    lazy: check every row's tensor names and shapes now (file headers only) and read the tensors
    when a row is used (`LazyRows`), instead of holding every row in memory.
    Raises FeatureCacheError naming what is missing or malformed."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = os.path.join(cache_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise FeatureCacheError(
            f"{cache_dir}: no {MANIFEST} (build it with python -m sas_backend.training.features)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise FeatureCacheError(f"{path}: cannot read: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise FeatureCacheError(f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    n = int(manifest["rows"]) if max_rows is None else min(max_rows, int(manifest["rows"]))
    spec = FeatureSpec.from_manifest(manifest)
    h_q, h_kv, d = manifest["num_attention_heads"], manifest["num_key_value_heads"], manifest["head_dim"]
    want = {"q": (spec.tail, h_q, d), "pooled": (spec.seq_len // spec.block_size * spec.sub_blocks, h_kv, 3 * d),
            "target": (h_kv, spec.tail, spec.num_blocks)}
    rows = []
    for i in range(n):
        f = os.path.join(cache_dir, row_file(i))
        if not os.path.exists(f):
            raise FeatureCacheError(f"{cache_dir}: row {i} of {manifest['rows']} missing ({row_file(i)}): "
                                    "the build did not finish; run it again to resume")
        try:
            if lazy:
                with safe_open(f, "pt") as h:
                    shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
            else:
                tensors = load_file(f)
                shapes = {k: tuple(t.shape) for k, t in tensors.items()}
        except (SafetensorError, OSError) as e:
            raise FeatureCacheError(f"{f}: unreadable ({e}); delete it and run the build again") from None
        for layer in range(manifest["num_layers"]):
            for name, shape in want.items():
                got = shapes.get(f"{name}.{layer}")
                if got != shape:
                    raise FeatureCacheError(f"{f}: {name}.{layer} is {got}, expected {shape}")
        rows.append(f if lazy else tensors)
    return FeatureCache(manifest, LazyRows(rows) if lazy else rows)


# ---- CLI ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sas_backend.training.features",
                                description="Cache a frozen model's dense per-layer features "
                                            "for fast gate distillation.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, nargs="+", help="same sources as training (files, dirs, @essays, @stdlib)")
    p.add_argument("--out", required=True, help="cache directory (manifest + one file per row; resumable)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per packed row")
    p.add_argument("--tail", type=int, default=1024, help="the last N positions of each row are the distilled queries")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--sub-blocks", type=int, default=1,
                   help="pool each block's keys per run of block-size / N tokens (distill_cached --sub-blocks M "
                        "trains on runs of block-size / M for any M dividing N; 1: whole blocks)")
    p.add_argument("--target", choices=("mass", "max"), default="mass",
                   help="distill target: block attention mass (the oracle's quantity) or SeerAttention-R's max")
    p.add_argument("--split", choices=("train", "heldout", "all"), default="train",
                   help="heldout: a validation cache for distill_cached --val-cache (never trained on)")
    p.add_argument("--heldout-fraction", type=float, default=None,
                   help="must match training and evaluation (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="document order of the packed rows (and recall facts)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="use only about this many tokens of each source "
                        "(as train --max-tokens: balances @essays and @stdlib)")
    p.add_argument("--max-rows", type=int, default=None, help="cache only the first N rows")
    p.add_argument("--shard", default="0/1", metavar="I/N",
                   help="write only the rows r with r %% N == I (run N processes on one cache directory)")
    p.add_argument("--recall-rows", type=float, default=0.0, metavar="FRACTION",
                   help="make this share of the rows recall rows (sas_backend.training.recall), "
                        "facts restated in the tail")
    p.add_argument("--recall-facts", type=int, default=4, help="facts per recall row")
    p.add_argument("--recall-min-distance", type=int, default=0, metavar="TOKENS",
                   help="place every fact at least this many tokens before the tail (default 0: anywhere before it)")
    p.add_argument("--dtype", choices=tuple(COMPUTE_DTYPES), default="float32",
                   help="the frozen model's forward dtype; bfloat16 speeds the matmuls on CPUs with AVX512-BF16 (a 4K "
                        "row 1.6x; little at 16K, where attention dominates) and is what a GPU serves; q, k and the "
                        "target are computed in fp32 from its q and k either way")
    p.add_argument("--no-progress", action="store_true", help="a log line per 10 rows instead of a tqdm bar")
    return p


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sas_backend.geometry import ModelGeometry
    from sas_backend.training.data import DEFAULT_HELDOUT_FRACTION, DataError, load_packed
    from sas_backend.training.model import check_supported

    try:
        spec = FeatureSpec(args.seq_len, args.tail, args.block_size, args.target, args.sub_blocks)
        shard, shards = (int(x) for x in args.shard.split("/"))
        if not 0 <= shard < shards:
            raise ValueError
    except ValueError as e:
        raise SystemExit(f"error: {e or f'--shard {args.shard!r}: expected I/N with 0 <= I < N'}") from None
    if not 0.0 <= args.recall_rows <= 1.0 or args.recall_facts < 1:
        raise SystemExit("error: --recall-rows must be in [0, 1] and --recall-facts >= 1")
    frac = DEFAULT_HELDOUT_FRACTION if args.heldout_fraction is None else args.heldout_fraction
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    try:
        data = load_packed(args.data, tokenizer, args.seq_len, split=args.split, heldout_fraction=frac, seed=args.seed,
                           max_tokens=args.max_tokens)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    rows = data.rows if args.max_rows is None else data.rows[: args.max_rows]
    recall = None
    if args.recall_rows > 0:
        from sas_backend.training.recall import RecallSpec, add_recall_rows

        rs = RecallSpec(args.recall_rows, args.recall_facts, tail=args.tail, seed=args.seed,
                        min_distance=args.recall_min_distance)
        try:
            rows, made = add_recall_rows(rows, tokenizer, rs)
        except ValueError as e:
            raise SystemExit(f"error: recall rows: {e}") from None
        recall = {**rs.record(), **made}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=COMPUTE_DTYPES[args.dtype])
    check_supported(model)
    model.eval()
    geometry = ModelGeometry.from_model_dir(args.model)
    manifest = _manifest(spec, args.model, geometry, {**data.record(), "rows_used": int(rows.shape[0])},
                         recall, int(rows.shape[0]), args.seed, args.dtype)
    manifest["command"] = command_line(argv)
    print(f"[features] {rows.shape[0]} {args.split} rows x {args.seq_len} tokens -> {args.out} "
          f"(tail {args.tail}, target {args.target}, ~{_row_mb(spec, geometry):.0f} MB a row)", flush=True)
    t0 = time.time()
    bar = None
    if not args.no_progress:
        from sas_backend.training.loop import progress_bar

        bar = progress_bar(int(rows.shape[0]), "features")

    def progress(done, total):
        if bar is not None:
            bar.n = done
            bar.refresh()
        elif done % 10 == 0 or done == total:
            print(f"[features] {done}/{total} rows, {time.time() - t0:.0f} s", flush=True)

    try:
        written = build_feature_cache(model, rows, spec, args.out, manifest, progress, shard=(shard, shards))
    except FeatureCacheError as e:
        raise SystemExit(f"error: {e}") from None
    if bar is not None:
        bar.close()
    print(f"[features] wrote {written} rows ({rows.shape[0] - written} were cached already) in "
          f"{time.time() - t0:.0f} s", flush=True)
    return 0


def command_line(argv) -> str:
    """The build command as the manifest keeps it: no machine path, and without --shard / --no-progress
    (every shard of one cache writes the same manifest)."""
    import shlex

    from sas_backend.provenance import portable_argv

    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--shard":
            skip = True
        elif not (a.startswith("--shard=") or a == "--no-progress"):
            kept.append(a)
    return "python -m sas_backend.training.features " + shlex.join(portable_argv(kept))


def _row_mb(spec: FeatureSpec, geometry) -> float:
    per_layer = (spec.tail * geometry.num_q_heads * geometry.head_dim
                 + spec.seq_len // spec.block_size * spec.sub_blocks * geometry.num_kv_heads * 3 * geometry.head_dim
                 + geometry.num_kv_heads * spec.tail * spec.num_blocks)
    return per_layer * geometry.num_layers * 2 / 2**20


if __name__ == "__main__":
    raise SystemExit(main())

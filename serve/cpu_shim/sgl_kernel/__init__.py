"""CPU stand-in for the `sgl_kernel` CPU ops that SGLang imports at load time.

No PyPI package ships the CPU build of `sgl_kernel`. With `SGLANG_USE_CPU_ENGINE=1`
SGLang imports a few `*_cpu` helpers from it; serving a Llama/Qwen model with the
torch-native (or `sas`) backend calls none of them in SGLang 0.5.21.
Speculative decoding (`--speculative-algorithm NGRAM`) calls `assign_req_to_token_pool_cpu` (below)
and the five ops of `sgl_kernel/speculative.py` (plain torch; re-exported here, as the real
sgl_kernel re-exports its `sgl_kernel.speculative`).
Everything else raises, so an op we did not expect fails loudly instead of silently.
This package is installed only by the CPU path of `serve/install.sh`, never on a GPU host.
"""

import torch

from .speculative import (  # noqa: F401  (SGLang imports these from `sgl_kernel` itself)
    assign_extend_cache_locs_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    reconstruct_indices_from_tree_mask,
    request_ranges,
    verify_tree_greedy_cpu,
)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the req->token table (in place).

    req_to_token: [max_reqs, pool_len] int32; out_cache_loc: [sum(end - start)] slots, request after
    request: `req_to_token[req_pool_indices[i], start_offset[i] + j] = out_cache_loc[o_i + j]` for j in
    [0, end_offset[i] - start_offset[i]), o_i = sum over earlier requests of (end - start).
    The requests are those of `req_pool_indices`. The last argument is the table's row length in
    sgl_kernel's CPU op (SGLang 0.5.21 passes `req_to_token.shape[1]`, from `alloc_for_spec_decode`); it is
    not needed here (a batch size in this shim's first version, which read it as one: wrong for 0.5.21,
    whose only caller is speculative decoding).
    """
    rows, cols = request_ranges(req_pool_indices, start_offset, end_offset)
    req_to_token[rows, cols] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def __getattr__(name):
    # Any other op SGLang resolves lazily: a clear error instead of an AttributeError deep inside.
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in the CPU stand-in (serve/cpu_shim); "
            "the sas CPU path was not expected to call it"
        )

    return _missing

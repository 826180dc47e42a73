"""CPU stand-in for the `sgl_kernel` CPU ops that SGLang imports at load time.

No PyPI package ships the CPU build of `sgl_kernel`. With `SGLANG_USE_CPU_ENGINE=1`
SGLang imports a few `*_cpu` helpers from it; serving a Llama/Qwen model with the
torch-native (or `sas`) backend only ever calls `assign_req_to_token_pool_cpu`.
Everything else raises, so an op we did not expect fails loudly instead of silently.
This package is installed only by the CPU path of `serve/install.sh`, never on a GPU host.
"""

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """Write each request's new KV slots into its row of the req->token table.

    req_to_token: [max_reqs, max_context] int32; out_cache_loc: [sum(end - start)] slots,
    request after request. Row `req_pool_indices[i]`, columns [start_offset[i], end_offset[i]).
    """
    pt = 0
    for i in range(batch_size):
        start = int(start_offset[i])
        end = int(end_offset[i])
        n = end - start
        req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[pt : pt + n].to(
            req_to_token.dtype
        )
        pt += n


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

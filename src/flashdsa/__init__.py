"""FlashDSA: fast kernels for DeepSeek Sparse Attention (indexer, top-k, sparse MLA, MLA decode).

Every op runs its TileLang kernel on Hopper GPUs and a PyTorch reference elsewhere (``backend=`` picks).
Nothing is compiled or imported eagerly: ``import flashdsa`` works on a CPU-only machine without tilelang.
"""

__version__ = "0.1.0"

from .cache import write_indexer_cache, write_kv_cache
from .decode.api import mla_decode
from .decode.plan import mla_decode_plan
from .indexer.api import indexer_logits, indexer_logits_paged
from .quant import dequantize_kv_fp8, quantize_fp8, quantize_kv_fp8
from .sparse.api import sparse_attn, sparse_mla, sparse_mla_fwd
from .topk.api import dsa_topk, topk_indices

__all__ = [
    "__version__",
    "indexer_logits",
    "indexer_logits_paged",
    "topk_indices",
    "dsa_topk",
    "mla_decode",
    "mla_decode_plan",
    "sparse_mla_fwd",
    "sparse_mla",
    "sparse_attn",
    "quantize_fp8",
    "quantize_kv_fp8",
    "dequantize_kv_fp8",
    "write_kv_cache",
    "write_indexer_cache",
]

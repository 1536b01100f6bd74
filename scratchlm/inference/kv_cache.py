"""The paged KV cache tensors, sized from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def bytes_per_block(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block in every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * n_layers * block_size * n_kv_heads * head_dim * itemsize


def num_blocks_for_budget(memory_bytes: int, n_layers: int, n_kv_heads: int, head_dim: int, block_size: int,
                          dtype: torch.dtype) -> int:
    """How many blocks fit in `memory_bytes`; a clear error when not even one does."""
    per_block = bytes_per_block(n_layers, n_kv_heads, head_dim, block_size, dtype)
    n = memory_bytes // per_block
    if n < 1:
        raise ValueError(
            f"kv_cache_memory={memory_bytes} bytes holds no KV block: one block of {block_size} tokens "
            f"needs {per_block} bytes ({n_layers} layers x {n_kv_heads} kv heads x {head_dim} dims x K,V)"
        )
    return int(n)


@dataclass
class KVCache:
    """k, v: (n_layers, num_blocks, block_size, n_kv_heads, head_dim). Slot s = block * block_size + offset."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of a forked partial block)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.k.device)
        dst = torch.tensor([d for _, d in copies], device=self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

"""The engine's fp32 linears: weights packed once into panels, multiplied by the C++ panel kernel at any row count.

`use_skinny_linears(model)` (the runner calls it at set-up) swaps every plain `Linear` of a float32 CPU model for a
`PanelLinear` whose weight is stored ONLY in the panel layout of `csrc/panel_gemm.h` ((ceil(N/16), K, 16): 16
output columns per contiguous panel), which the kernel streams front to back for decode batches (1..64 rows) and
prefill chunks (hundreds) alike. The matrices that read the same input are packed into one tensor, q/k/v and
gate/up, so the fused decode step multiplies each group in one call (the input read once); each layer's
PanelLinear is a view of its panels, so there is still one copy of the weights.

All the linears' panels are views of ONE buffer (`pack_linears`), 2 MiB-aligned and advised as transparent huge
pages: the kernel's next-group prefetch, which lets a decode batch's FMAs overlap its weight reads, only pays off
without a page boundary every 4 KiB.

Measured (`benchmarks/fp32_gemm.py`, one core, the 30 layers of SmolLM2-135M): 1.1-1.9x the previous kernels
(skinny tiles over the plain layout, oneDNN repacking the weight per call) and about oneDNN's own rate over
prepacked weights (what vLLM-CPU runs) at prefill sizes, ahead of it for decode batches (`--decode`: a decode
step's GEMMs 1.17-1.97x oneDNN at 1-32 rows).

Each call runs the kernel chosen for its shape class on this machine (`kernel_choice.py`: the panel kernel, the
skinny tiles, MKL or oneDNN over prepacked weights, measured at first use and cached); a kernel other than the panel
kernel reads a plain or prepacked copy of the weight, made the first time it is chosen for that linear.

The model's `state_dict()` stays plain ((N, K) `weight` per linear: `PanelLinear` unpacks on save and packs on
load), `.weight` reads an unpacked copy. Other dtypes, other devices, autograd, and a machine where the kernels
cannot be built keep torch's matmul over the plain weight (`SkinnyLinear`, a plain `Linear` in all but name).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from scratchlm.inference import kernel_choice
from scratchlm.inference.cpp_extensions import load_engine_kernels
from scratchlm.model.layers import Embedding, Linear

MAX_ROWS = 64  # the old skinny tiles' limit (skinny_linear): above it torch's matmul
PANELS_ENV = "SCRATCHLM_FP32_PANELS"  # "0": keep the plain weights (SkinnyLinear), e.g. to measure against
LANES = 16  # output columns per panel (csrc/panel_gemm.h)


def load_kernels(verbose: bool = False):
    """The compiled kernel module (`panel_linear`, `skinny_linear`), or None (torch matmul) if it cannot be built."""
    return load_engine_kernels(verbose)


def skinny_linear(x: Tensor, w: Tensor) -> Tensor:
    """x (..., K) @ w (N, K).T -> (..., N) over a plain weight: the C++ skinny tiles for few float32 CPU rows, torch
    otherwise."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > MAX_ROWS or x.device.type != "cpu" or x.dtype != torch.float32
            or w.dtype != torch.float32 or torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return x @ w.t()
    ext = load_kernels()
    if ext is None:
        return x @ w.t()
    return ext.skinny_linear(x.reshape(rows, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


def unpack(panels: Tensor, n: int) -> Tensor:
    """(P, K, 16) panels -> the plain (n, K) weight (a new tensor)."""
    return panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[:n].contiguous()  # (P * 16, K) -> (n, K)


class SkinnyLinear(Linear):
    """`Linear` whose forward uses `skinny_linear` (plain weight (d_out, d_in)): where the weights cannot be packed."""

    @classmethod
    def from_linear(cls, linear: Linear) -> SkinnyLinear:
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.d_in, new.d_out, new.weight = linear.d_in, linear.d_out, linear.weight
        return new

    def forward(self, x: Tensor) -> Tensor:
        return skinny_linear(x, self.weight)


class _Panels(torch.nn.Module):
    """A float32 (rows, cols) matrix held only as panels (P, cols, 16); state_dict saves / loads it plain as
    `weight`."""

    def __init__(self, rows: int, cols: int, panels: Tensor, what: str):
        super().__init__()
        want = (-(-rows // LANES), cols, LANES)
        if panels.shape != want or panels.dtype != torch.float32:
            raise ValueError(f"panels for a ({rows}, {cols}) {what} must be float32 {want}, "
                             f"got {tuple(panels.shape)} {panels.dtype}")
        self.register_buffer("panels", panels, persistent=False)  # counted by .buffers(), moved by .to()
        self._op = None  # (panels, the C++ PanelMatmul over them: kernel choice, other kernels' copies), on first use

    def _plain_shape(self) -> tuple[int, int]:
        raise NotImplementedError

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_op"] = None  # copies and pickles hold the panels only (the C++ object does not pickle)
        return state

    def _matmul(self, ext, x: Tensor) -> Tensor:
        """x (rows, K) @ W^T -> (rows, N) by the kernel chosen for this shape class (kernel_choice.py, measured at
        first use; a kernel other than the panel kernel reads a copy of the weight kept in `_op`)."""
        if self._op is None or self._op[0] is not self.panels:  # first use, or the buffer was replaced (.to())
            kernel_choice.chooser(ext)
            self._op = (self.panels, ext.PanelMatmul(self.panels, [self._plain_shape()[0]]))
        (y,) = self._op[1].forward(x, -1)
        return y

    @property
    def weight(self) -> Tensor:
        """The plain weight, unpacked (a new tensor per access: not for hot paths)."""
        return unpack(self.panels, self._plain_shape()[0])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        w = state_dict[key]
        if tuple(w.shape) != self._plain_shape():
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(w.shape)}, the "
                              f"current model has {self._plain_shape()}")
            return
        with torch.no_grad():
            self.panels.copy_(load_kernels().panel_pack(w.detach().to(torch.float32, copy=False).cpu()))
        self._op = None  # its copies were of the old weight


class PanelLinear(_Panels):
    """y = x W^T with W (d_out, d_in) held only as panels (P, d_in, 16) (`csrc/panel_gemm.h`), float32 on the CPU.

    `panels` may be a view into a tensor shared with the other linears of its group (q/k/v, gate/up).
    state_dict saves / loads the plain `weight`; the `weight` attribute is an unpacked copy (made per access)."""

    def __init__(self, d_in: int, d_out: int, panels: Tensor):
        super().__init__(d_out, d_in, panels, "weight")
        self.d_in, self.d_out = d_in, d_out

    in_features = property(lambda self: self.d_in, doc="CS336 / torch name of d_in")
    out_features = property(lambda self: self.d_out, doc="CS336 / torch name of d_out")

    def _plain_shape(self) -> tuple[int, int]:
        return self.d_out, self.d_in

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.d_in
        if (rows == 0 or x.dtype != torch.float32 or x.device.type != "cpu" or self.panels.device.type != "cpu"
                or torch.is_grad_enabled() and x.requires_grad):
            return x @ self.weight.t()
        y = self._matmul(load_kernels(), x.reshape(rows, self.d_in))  # (rows, d_out)
        return y.view(*x.shape[:-1], self.d_out)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, panels={tuple(self.panels.shape)}"


class PanelEmbedding(_Panels):
    """`Embedding` (num_embeddings, dim) held only as panels, for a tied head: the head multiplies the panels
    (`head`), a lookup gathers row n from panel n // 16, lane n % 16 (strided: a few microseconds per token, against
    a second 113 MB copy of SmolLM2's table)."""

    def __init__(self, num_embeddings: int, dim: int, panels: Tensor):
        super().__init__(num_embeddings, dim, panels, "table")
        self.num_embeddings, self.dim = num_embeddings, dim

    embedding_dim = property(lambda self: self.dim, doc="CS336 / torch name of dim")

    def _plain_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.dim

    def forward(self, ids: Tensor) -> Tensor:
        return self.panels[ids // LANES, :, ids % LANES]  # (..., dim)

    def head(self, h: Tensor) -> Tensor:
        """h (rows, dim) @ table.T -> (rows, num_embeddings) through the kernel chosen for its shape class."""
        return self._matmul(load_kernels(), h.contiguous())

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, dim={self.dim}, panels={tuple(self.panels.shape)}"


def _packable(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return type(m) is Linear and w is not None and w.dtype == torch.float32 and w.device.type == "cpu"


def pack_linears(ext, groups: list[list[Linear]]) -> list[list[PanelLinear]]:
    """PanelLinears for groups of linears, the linears of a group reading the same input: a group's panels lie one
    after another in ONE tensor, and all groups are views of one buffer (`panel_pack_groups`: 2 MiB-aligned,
    advised as huge pages, which the kernel's prefetching needs to stream at full speed; the plain weights are not
    kept)."""
    with torch.no_grad():
        packed = ext.panel_pack_groups([[m.weight.detach() for m in g] for g in groups])  # each (sum P_i, K, 16)
    out = []
    for group, panels in zip(groups, packed):
        row, p = [], 0
        for m in group:
            n = -(-m.d_out // LANES)
            row.append(PanelLinear(m.d_in, m.d_out, panels[p : p + n]))
            p += n
        out.append(row)
    return out


def use_skinny_linears(model: torch.nn.Module, pack: bool | None = None) -> int:
    """Swap every plain `Linear` in `model` for the engine's linear; returns how many. With the kernels built, a
    float32 CPU linear becomes a `PanelLinear` (q/k/v and gate/up of a layer packed together), and a tied
    embedding table (the head) a `PanelEmbedding`; otherwise (or `pack=False`) a `SkinnyLinear` sharing the plain
    weight. `pack` None: unless $SCRATCHLM_FP32_PANELS is "0"."""
    if pack is None:
        pack = os.environ.get(PANELS_ENV, "1") != "0"
    ext = load_kernels() if pack else None
    if ext is not None:
        kernel_choice.chooser(ext)  # the fused step's classes are measured at first use too (the C++ table asks)
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is Linear]
    packed: dict[int, PanelLinear] = {}
    if ext is not None:
        groups = []
        for block in getattr(model, "layers", []):
            a, f = getattr(block, "attn", None), getattr(block, "ffn", None)
            groups.append([getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj")])
            groups.append([getattr(f, n, None) for n in ("w1", "w3")])
            for mlp in [*getattr(f, "experts", []), getattr(f, "shared", None)]:  # an MoE's experts: gate/up too
                groups.append([getattr(mlp, n, None) for n in ("w1", "w3")])
        groups = [g for g in groups if all(m is not None and _packable(m) for m in g) and len({m.d_in for m in g}) == 1]
        grouped = {id(m) for g in groups for m in g}
        groups += [[child] for _, _, child in swaps if id(child) not in grouped and _packable(child)]
        order = {id(child): i for i, (_, _, child) in enumerate(swaps)}
        groups.sort(key=lambda g: order[id(g[0])])  # the buffer in the order a step reads it: qkv, o, gate/up, down
        for g, ps in zip(groups, pack_linears(ext, groups)):
            packed.update((id(m), p) for m, p in zip(g, ps))
    emb = getattr(model, "tok_embeddings", None)
    if ext is not None and getattr(model, "lm_head", 0) is None and type(emb) is Embedding and \
            emb.weight.dtype == torch.float32 and emb.weight.device.type == "cpu":  # a tied head: pack the table
        with torch.no_grad():
            model.tok_embeddings = PanelEmbedding(emb.num_embeddings, emb.dim, ext.panel_pack(emb.weight.detach()))
    for parent, name, child in swaps:
        new = packed.get(id(child))
        setattr(parent, name, new if new is not None else SkinnyLinear.from_linear(child))
    return len(swaps)

"""Dynamic Axial Parallelism (FastFold) for the Pairformer: the pair representation sharded by rows over P ranks.

Layout: rank r holds rows [r R, (r + 1) R) of z (B, N', N', c) with N' = P R the token count padded up to a
multiple of P (padded tokens carry mask 0, so they never reach a real token's output), and the single track
s (B, N', c_s) replicated. One block:

    op                       layout   communication (per rank, fp32)
    triangle update out      rows     the contracted operand b: ring of P - 1 row blocks, (P-1) R N' c
    triangle update in       cols     all-to-all to columns, then the ring over a^T, all-to-all back
    triangle attn starting   rows     all-gather of the bias rows (B, H, R, N') -> (B, H, N', N')
    triangle attn ending     cols     all-to-all to columns, bias all-gather
    pair transition          cols     none (pointwise), then all-to-all back to rows
    single attention         rows     none for the bias: queries are sharded with the pair rows, so each
                                      rank's bias rows are local; all-gather of the s rows (R c_s)

so 4 all-to-alls (each (P-1)/P of the local shard), 2 rings of P - 1 shard-sized blocks, and
H/c of that in bias gathers. The all-to-all is `dist.all_to_all_single` (gloo supports it in torch
2.13; checked by the tests), NCCL on CUDA.

Overlap (FastFold's Duality Async, `overlap=True`): the triangle update's operand travels in a ring of
async isend/irecv, and rank r multiplies the block it holds while the next one arrives; the bias
all-gather is started async before the queries/keys of the first chunk are projected. With
`overlap=False` the operand is all-gathered whole first (N' x N' x c transient on every rank) and the
bias gather is blocking: the same numbers, the difference is the measured time and memory.

Every collective runs on one group with a short timeout (`timeout_s`, 60 s by default), so a dead rank
fails the run with an error within the timeout instead of hanging; gloo's p2p waits take the timeout too.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from scratchlm.fold.pairformer import Pairformer, PairformerBlock
from scratchlm.parallel.comm import backend_for


class DapComm:
    """One rank's DAP group: timed all-to-all / all-gather / ring p2p, with byte counts for the benchmarks."""

    def __init__(self, device: str | torch.device = "cpu", timeout_s: float = 60.0, ranks: list[int] | None = None):
        if not dist.is_initialized():
            raise RuntimeError("DapComm: torch.distributed is not initialised (init_default_group first)")
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.timeout_s = timeout_s
        ranks = ranks if ranks is not None else list(range(dist.get_world_size()))
        self.group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), backend=self.backend)
        self.ranks = ranks
        self.rank = ranks.index(dist.get_rank())
        self.world = len(ranks)
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def reset_stats(self) -> None:
        self.seconds.clear()
        self.bytes_sent.clear()
        self.calls.clear()

    def _count(self, kind: str, start: float, nbytes: int) -> None:
        self.seconds[kind] += time.perf_counter() - start
        self.bytes_sent[kind] += nbytes
        self.calls[kind] += 1

    def _wait(self, work) -> None:
        work.wait(timedelta(seconds=self.timeout_s)) if self.backend == "gloo" else work.wait()

    def transpose(self, x: Tensor, overlap: bool = True, chunks: int = 8) -> Tensor:
        """Row shard (B, R, N', c) of z -> row shard of z^T (B, R, N', c) (this rank's columns), by all-to-alls.

        The channels go in `chunks` pieces, so the send/receive buffers are 2/chunks of the shard; with
        overlap, piece i+1's all-to-all runs while piece i is unpacked."""
        p = self.world
        if p == 1:
            return x.transpose(1, 2).contiguous()
        b, r, n, c = x.shape
        out = x.new_empty(b, r, n, c)
        bounds = [(c * i // chunks, c * (i + 1) // chunks) for i in range(chunks)]
        bounds = [(c0, c1) for c0, c1 in bounds if c1 > c0]

        def start(c0: int, c1: int):
            t = time.perf_counter()
            send = x[..., c0:c1].view(b, r, p, r, c1 - c0).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, Ri, Rj, cc)
            recv = torch.empty_like(send)  # recv[q] = z[rows of rank q, my columns, c0:c1]
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
            self._count("all_to_all", t, send.numel() * send.element_size() * (p - 1) // p)
            return send, recv, work

        def finish(c0: int, c1: int, pending) -> None:
            send, recv, work = pending
            t = time.perf_counter()
            self._wait(work)
            self._count("all_to_all_wait", t, 0)
            del send
            out[..., c0:c1].view(b, r, p, r, c1 - c0).copy_(recv.permute(1, 3, 0, 2, 4))  # (B, Rj, P, Ri, cc)

        pending = start(*bounds[0])
        for i, (c0, c1) in enumerate(bounds):
            nxt = start(*bounds[i + 1]) if overlap and i + 1 < len(bounds) else None
            finish(c0, c1, pending)
            if nxt is None and i + 1 < len(bounds):
                nxt = start(*bounds[i + 1])
            pending = nxt
        return out

    def all_gather(self, x: Tensor, dim: int, async_op: bool = False):
        """Concatenate every rank's `x` along `dim`; with async_op, a callable that waits and returns it."""
        p = self.world
        if p == 1:
            return (lambda: x) if async_op else x
        t = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(p)]
        work = dist.all_gather(parts, x, group=self.group, async_op=async_op)
        nbytes = x.numel() * x.element_size() * (p - 1)
        if not async_op:
            self._count("all_gather", t, nbytes)
            return torch.cat(parts, dim=dim)

        def wait() -> Tensor:
            t2 = time.perf_counter()
            self._wait(work)
            self._count("all_gather", t2, nbytes)
            return torch.cat(parts, dim=dim)
        return wait

    def ring_contract(self, a: list[Tensor], b: list[Tensor], overlap: bool) -> list[Tensor]:
        """x = a @ b_all^T over every rank's b, per channel chunk: a, b lists of (B, cc, R, N') row shards ->
        x list of (B, cc, R, N'). Empties a and b as it goes (each chunk freed once used).

        overlap: b's blocks travel in a ring (isend to r+1, irecv from r-1) while the block in hand is
        multiplied; otherwise each chunk of b is all-gathered whole first."""
        p, r = self.world, self.rank
        x = []
        while a:
            ai, cur = a.pop(0), b.pop(0)
            rows = ai.shape[2]
            if p == 1:
                x.append(torch.matmul(ai, cur.transpose(-1, -2)))
                continue
            if not overlap:
                b_all = self.all_gather(cur, dim=2)  # (B, cc, N', N')
                del cur
                x.append(torch.matmul(ai, b_all.transpose(-1, -2)))
                del b_all
                continue
            out = ai.new_empty(*ai.shape[:3], rows * p)
            cur = cur.contiguous()
            nbytes = cur.numel() * cur.element_size()
            for step in range(p):
                works = []
                if step < p - 1:
                    nxt = torch.empty_like(cur)
                    t = time.perf_counter()
                    works = dist.batch_isend_irecv([
                        dist.P2POp(dist.isend, cur, self.ranks[(r + 1) % p], group=self.group),
                        dist.P2POp(dist.irecv, nxt, self.ranks[(r - 1) % p], group=self.group),
                    ])
                    self._count("ring", t, nbytes)
                src = (r - step) % p  # the rank whose rows `cur` holds
                out[..., src * rows:(src + 1) * rows] = torch.matmul(ai, cur.transpose(-1, -2))  # (B, cc, R, R)
                if works:
                    t = time.perf_counter()
                    for w in works:
                        self._wait(w)
                    self._count("ring_wait", t, 0)
                    cur = nxt
            x.append(out)
        return x


def pad_to(n: int, world: int) -> int:
    """The token count padded up to a multiple of the DAP world size."""
    return -(-n // world) * world


class DapPairformer:
    """A `Pairformer` (or one block) run with its pair representation sharded by rows over `comm`'s ranks.

    `shard` pads and slices full inputs; `forward_sharded` runs the blocks on the local shard; `gather_z`
    and `unpad` put the full result back together (tests; a real run keeps z sharded)."""

    def __init__(self, model: Pairformer | PairformerBlock, comm: DapComm, overlap: bool = True,
                 chunk_rows: int | None = None, channel_chunks: int = 16):
        """`chunk_rows`: row chunk of the attentions/transitions/projections (None: whole shard);
        `channel_chunks`: pieces of the triangle update's operand and of each all-to-all (more pieces:
        smaller in-flight buffers, 3/k of the shard, and more messages)."""
        if channel_chunks < 1:
            raise ValueError(f"channel_chunks must be >= 1, got {channel_chunks}")
        self.blocks = [model] if isinstance(model, PairformerBlock) else list(model.blocks)
        self.comm, self.overlap, self.chunk_rows = comm, overlap, chunk_rows
        self.channel_chunks = channel_chunks

    # --- layout ---------------------------------------------------------------------------------
    def shard(self, s: Tensor, z: Tensor, mask: Tensor, pair_mask: Tensor):
        """Full (s, z, mask, pair_mask) -> padded s, this rank's z rows, padded mask, pair-mask rows and columns."""
        p, r = self.comm.world, self.comm.rank
        n = s.shape[1]
        n_pad = pad_to(n, p)
        rows = n_pad // p
        extra = n_pad - n
        s = torch.nn.functional.pad(s, (0, 0, 0, extra))
        mask = torch.nn.functional.pad(mask, (0, extra))
        pm = torch.nn.functional.pad(pair_mask, (0, extra, 0, extra))
        z_rows = torch.nn.functional.pad(z[:, r * rows:(r + 1) * rows], (0, 0, 0, extra))
        if z_rows.shape[1] < rows:  # this rank's rows run past N: pad them too
            z_rows = torch.nn.functional.pad(z_rows, (0, 0, 0, 0, 0, rows - z_rows.shape[1]))
        sl = slice(r * rows, (r + 1) * rows)
        return s, z_rows.contiguous(), mask, pm[:, sl].contiguous(), pm[:, :, sl].transpose(1, 2).contiguous()

    def gather_z(self, z_rows: Tensor, n: int) -> Tensor:
        """Row shards -> the full (B, n, n, c) z (unpadded) on every rank."""
        return self.comm.all_gather(z_rows, dim=1)[:, :n, :n]

    # --- compute --------------------------------------------------------------------------------
    def block(self, blk: PairformerBlock, s: Tensor, zbox: list[Tensor], mask: Tensor, pm_rows: Tensor,
              pm_cols: Tensor) -> tuple[Tensor, Tensor]:
        """One block on the local shard: s (B, N', c_s) full, zbox = [z rows (B, R, N', c)] -> (s, z).

        z is taken out of the box and updated in place (so no caller reference keeps an old shard alive)."""
        comm, ch, ov, k = self.comm, self.chunk_rows, self.overlap, self.channel_chunks
        z = zbox.pop()
        rows = z.shape[1]
        r0 = comm.rank * rows
        # triangle update, outgoing: rows local, the operand b over every row
        m = blk.tri_mul_out
        a, b = m.project(z, pm_rows, ch, k)
        x = comm.ring_contract(a, b, ov)
        m.finish_(z, x, ch)
        del x
        # triangle update, incoming: on z^T's rows (this rank's columns), operands swapped
        zt = comm.transpose(z, ov, k)
        del z
        m = blk.tri_mul_in
        a, b = m.project(zt, pm_cols, ch, k)
        x = comm.ring_contract(b, a, ov)
        m.finish_(zt, x, ch)
        del x
        z = comm.transpose(zt, ov, k)
        del zt
        # triangle attention, starting node: rows local, the bias over the whole pair
        self._tri_attention(blk.tri_att_start, z, pm_rows)
        # triangle attention, ending node, and the pair transition on the columns
        zt = comm.transpose(z, ov, k)
        del z
        self._tri_attention(blk.tri_att_end, zt, pm_cols)
        blk.transition_z.update_(zt, ch)
        z = comm.transpose(zt, ov, k)
        del zt
        # single track: query rows with the pair rows, so the bias rows are local; then gather s
        s_normed = blk.pre_norm_s(s)
        bias = blk.attention.pair_bias(z, ch)
        s_rows = s[:, r0:r0 + rows] + blk.attention(s_normed, bias, mask, (r0, r0 + rows))
        s_rows = s_rows + blk.transition_s(s_rows)
        return comm.all_gather(s_rows, dim=1), z

    def _tri_attention(self, att, z: Tensor, pm: Tensor) -> None:
        x = att.layer_norm(z)
        # overlap: a callable that attend_() calls after its first chunk's q k^T (the gather runs meanwhile)
        bias = self.comm.all_gather(att.bias(x), dim=2, async_op=self.overlap)
        att.attend_(z, x, bias, pm, self.chunk_rows)

    @torch.no_grad()
    def forward_sharded(self, s: Tensor, z_rows: Tensor, mask: Tensor, pm_rows: Tensor, pm_cols: Tensor,
                        inplace: bool = False) -> tuple[Tensor, Tensor]:
        """Every block on the shard; inputs as `shard` returns them. `inplace=False` copies z_rows first."""
        zbox = [z_rows if inplace else z_rows.clone()]
        del z_rows
        for blk in self.blocks:
            s, z = self.block(blk, s, zbox, mask, pm_rows, pm_cols)
            zbox.append(z)
            del z
        return s, zbox.pop()

    @torch.no_grad()
    def __call__(self, s: Tensor, z: Tensor, mask: Tensor, pair_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Full inputs on every rank -> the full (s, z) on every rank, equal to the single-rank model's."""
        n = s.shape[1]
        s_p, z_rows, mask_p, pm_rows, pm_cols = self.shard(s, z, mask, pair_mask)
        s_out, z_rows = self.forward_sharded(s_p, z_rows, mask_p, pm_rows, pm_cols)
        return s_out[:, :n], self.gather_z(z_rows, n)


def block_comm_bytes(cfg, n: int, world: int, overlap: bool = True, batch: int = 1, elem: int = 4) -> dict[str, int]:
    """Bytes one rank sends per block, by kind, as `DapComm` counts them (R = ceil(N/P), N' = P R).

    ring / all_gather of the triangle updates' operand: 2 (P-1) B R N' c; all_to_all: 4 transposes of
    (P-1)/P of the shard; bias gathers: 2 (P-1) B H R N'; the single track: (P-1) B R c_s."""
    if world == 1:
        return {}
    rows = -(-n // world)
    n_pad = rows * world
    shard = batch * rows * n_pad * cfg.c_z * elem
    operand = 2 * (world - 1) * shard
    out = {"all_to_all": 4 * (world - 1) * shard // world,
           "all_gather": 2 * (world - 1) * batch * cfg.pair_heads * rows * n_pad * elem
           + (world - 1) * batch * rows * cfg.c_s * elem}
    if overlap:
        out["ring"] = operand
    else:
        out["all_gather"] += operand
    return out

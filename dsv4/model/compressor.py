"""KV compressor of the ratio-4 and ratio-128 layers (docs/model.md#compressor).

Every token t at position p projects a_t = W_kv x_t and z_t = W_gate x_t + ape[p mod r]
(both [c*d'], fp32). Window i = tokens r*i .. r*i + r - 1 yields one entry by a per-channel
softmax over its candidates:
- ratio 128 (c = 1): the r tokens of window i;
- ratio 4 (c = 2, overlapping): channels [0, d') of window i-1's tokens and channels
  [d', 2d') of window i's tokens, 2r candidates (window -1 does not exist: weight 0).
Each entry is then cast to the model dtype, RMS-normed (`norm`) and roped at position r*i.
The same module (d' = index_head_dim) is the indexer's key compressor.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.model.hot_ops import REFERENCE_OPS, HotOps
from dsv4.model.layers import RMSNorm, linear, linear_fp32
from dsv4.model.rope import inv_freq
from dsv4.model.state import CompressorState
from dsv4.ops.rope import apply_rope, rope_cos_sin


class Compressor(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.ratio = ratio
        self.dim = dim
        width = cfg.overlap(ratio) * dim
        self.wkv = linear(cfg.hidden_size, width)
        self.wgate = linear(cfg.hidden_size, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.ops: HotOps = REFERENCE_OPS  # compress_windows (DeepseekV4.use_hot_ops)

    def forward(
        self, x: torch.Tensor, start_pos: int, state: CompressorState | None
    ) -> torch.Tensor:
        """x [S, D] of one sequence at positions start_pos.. -> all entries so far [N, d'].

        Without `state` the call must start at position 0 and an incomplete tail window is
        dropped; with it the tail is kept in `state.pending_*` and completed by later calls.

        With `state.stored` the new entries are returned as the cache gives them back (earlier
        ones were read from it) while `state.entries` keeps them raw for the cache to encode.
        """
        r = self.ratio
        positions = torch.arange(start_pos, start_pos + x.shape[0], device=x.device)
        kv = linear_fp32(x, self.wkv.weight)  # [S, c*d']
        gate = linear_fp32(x, self.wgate.weight) + self.ape.float()[positions % r]
        num_done = 0
        if state is not None:
            num_done = state.num_entries
            if state.pending_kv is not None:
                kv = torch.cat((state.pending_kv, kv))
                gate = torch.cat((state.pending_gate, gate))
        else:
            assert start_pos == 0, "a stateless compressor call must start at position 0"
        usable = kv.shape[0] // r * r
        n = usable // r
        new = x.new_zeros(0, self.dim)
        if n:
            kv_w = kv[:usable].view(n, r, -1)  # [n, r, c*d']
            gate_w = gate[:usable].view(n, r, -1)
            overlap_kv = overlap_gate = None
            if state is not None:
                overlap_kv, overlap_gate = state.overlap_kv, state.overlap_gate
            new = self.ops.compress_windows(kv_w, gate_w, overlap_kv, overlap_gate, r == 4)
            new = self.norm(new.to(x.dtype))  # [n, d']
            entry_pos = (num_done + torch.arange(n, device=x.device)) * r
            cos, sin = rope_cos_sin(entry_pos, inv_freq(self.cfg, r, x.device))
            new = apply_rope(new, cos, sin)
            if state is not None and r == 4:
                state.overlap_kv = kv_w[-1, :, : self.dim].clone()
                state.overlap_gate = gate_w[-1, :, : self.dim].clone()
        if state is None:
            return new
        state.pending_kv, state.pending_gate = kv[usable:], gate[usable:]
        if state.entries is None:
            state.entries = new
        elif n:
            state.entries = torch.cat((state.entries, new))
        if state.stored is None or not n:
            return state.entries
        return torch.cat((state.entries[:num_done], state.stored(new)))

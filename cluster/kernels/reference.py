"""The torch references of the forward pass's fused kernels: what runs on CPU, and what each Triton
kernel in this package must equal (its tests compare the two on random inputs).

They round where the unfused PyTorch model (and Hugging Face's) rounds, so in float32 they are the
model's original arithmetic, op for op: greedy decoding on CPU stays token-exact with transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.kernels.step_layout import DecodeStepLayout

# -- RMSNorm ------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x): statistics in float32, the normalised value cast back to x's dtype first."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual <- x + residual; returns (rms_norm(residual), residual). The add is in x's dtype."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


# -- rotary embedding + paged KV write ---------------------------------------------------------


def rotary_store_kv(
    qkv: torch.Tensor,  # [T, (H + 2 * KH) * D]: the fused projection's output
    positions: torch.Tensor,  # [T]
    cos_sin: torch.Tensor,  # [max_positions, D]: cos of the D/2 frequencies, then their sin
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, KH, D]
    slot_mapping: torch.Tensor,  # [T]: block * block_size + offset of each token's K/V
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_scale: float = 1.0,  # an FP8 cache stores k / k_scale, v / v_scale (kv_quantize); else unused
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotates q and k (Hugging Face's rotate_half convention) and writes k, v into their slots (an
    FP8 cache gets kv_quantize of them). Returns q, k, v as [T, heads, D], unquantized."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    cs = cos_sin[positions]
    cos, sin = cs.chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    if kv_layer.dtype == FP8:  # index_copy_ has no float8 kernel on CPU: copy the bytes
        for i, (x, scale) in enumerate(((k, k_scale), (v, v_scale))):
            kv_layer[i].view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
                0, slot_mapping, kv_quantize(x, scale).view(torch.uint8))
    else:
        kv_layer[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        kv_layer[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return q, k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# -- FP8 (float8_e4m3fn): KV cache entries, activations, weights ---------------------------------
# One rounding rule everywhere: q = e4m3(clamp(x / scale, -448, 448)), round to nearest even, in
# float32; x ~ float32(q) * scale. The kernels (rotary_kv, fp8_quant, fp8_gemm, the attention
# kernels) divide and clamp the same way, and multiply scales in after their float32 accumulation,
# where these references multiply them in before it: equal up to float32 rounding.

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # a dynamic scale's floor: an all-zero row quantizes to zeros


def div_rn(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c rounded once (IEEE division), on every device. NOTE: a CUDA tensor divided by a Python
    number is computed as x * (1 / c), two roundings (ATen's div_true_kernel_cuda): one float32 ulp
    off the kernels' div.rn, enough to move an e4m3 rounding at a tie (seen on H200). A 0-dim tensor
    on x's device takes the true division."""
    return x / torch.tensor(c, dtype=x.dtype, device=x.device)


def kv_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """An FP8 KV cache entry of x (k after rotary, or v): e4m3(clamp(x / scale))."""
    return div_rn(x.float(), scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def kv_dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 K or V from an FP8 cache entry (any other cache dtype: x as float32, scale unused)."""
    return x.float() * scale if x.dtype == FP8 else x.float()


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None):
    """[M, K] activations -> (e4m3 [M, K], float32 scales [M, 1]): each row's amax / 448 (at least
    FP8_MIN_SCALE), or the checkpoint's static per-tensor scale for every row. Must equal
    cluster/kernels/fp8_quant.py."""
    if static_scale is None:
        scale = div_rn(x.abs().amax(dim=-1, keepdim=True).float(), FP8_MAX).clamp(min=FP8_MIN_SCALE)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def fp8_dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [N, K] from e4m3 weights and their scales: per output channel ([N]) or per block
    ([ceil(N / bn), ceil(K / bk)])."""
    w = weight.float()
    if block is None:
        return w * scale.float()[:, None]
    n, k = w.shape
    s = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w * s


def fp8_linear_weight_only(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                           block: tuple[int, int] | None = None) -> torch.Tensor:
    """x @ dequantize(weight)^T (+ bias) in float32, rounded once to x's dtype: the weight-only path
    (cluster/kernels/fp8_gemm.py), activations unquantized."""
    y = x.float() @ fp8_dequantize_weight(weight, scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_linear_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: activations quantized per token (or with the static input_scale), an e4m3 x e4m3 product
    accumulated in float32, both scales applied to it, rounded once (what torch._scaled_mm computes
    with row-wise scales). Per-channel weight scales only."""
    xq, xs = quantize_per_token(x, input_scale)
    y = (xq.float() @ weight.float().t()) * xs * scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# -- SiLU and mul -------------------------------------------------------------------------------


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- sampling -----------------------------------------------------------------------------------
# Counter-based noise: a 32-bit hash of (seed, position, token id), so a seeded request draws the
# same noise in any batch, on any worker, and a CUDA graph can replay sampling. The kernel in
# cluster/kernels/sampling.py computes the same hash in uint32; here uint32 arithmetic is emulated
# in int64 (products split in 16-bit halves so that nothing overflows).

_M32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
POSITION_MUL = 0x85EBCA6B
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] 32-bit keys of (seed, position); seeds in [0, 2**63)."""
    seeds = seeds.long()
    k = mix32((seeds >> 32) ^ GOLDEN32)
    k = mix32(k ^ (seeds & _M32))
    return mix32((k + _mul32(positions.long() & _M32, POSITION_MUL)) & _M32)


# The largest float32 below 1. NOTE: the top 24-bit value plus half a step, 2^24 - 0.5, rounds to 2^24 in
# float32, so its u came out as 1.0: a noise of +inf, and a token whose logit is -inf (outside a grammar's
# mask, allowed_token_ids, a bad word) scored -inf + inf = NaN, which argmax picks (one element in 2^24:
# a structured-output request failed with "not allowed by the grammar" about once in 20 fuzz runs).
MAX_UNIFORM = 1.0 - 2.0**-24


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1): 24 bits of mix32(key + token * golden), plus half a step, at
    most MAX_UNIFORM."""
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = mix32((row_keys(seeds, positions)[:, None] + _mul32(cols, GOLDEN32)[None, :]) & _M32)
    return (((h >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp_(max=MAX_UNIFORM)


def kept_tokens(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                log_min_p: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] bool: the top-k / top-p / min-p set of each row of temperature-scaled logits.

    Tokens are ranked by (logit descending, token id ascending). A token is kept iff fewer than top_k
    tokens rank before it (top_k <= 0: no limit), the probability mass ranked before it is below
    top_p (the smallest prefix reaching top_p; the first token is always kept), and its scaled logit
    is at least the row's maximum + log(min_p) (its probability at least min_p times the top one's;
    log_min_p = -inf: off). The three are one prefix of the ranking each, so the set is their
    intersection whatever the order: min_p is unchanged by renormalisation, so this is also min_p
    applied after top-k/top-p (Hugging Face's order). top-p counts the mass of the whole row."""
    vocab = scaled.shape[-1]
    s, order = scaled.sort(dim=-1, descending=True, stable=True)
    e = torch.exp(s - s[:, :1])
    before = e.cumsum(dim=-1) - e
    total = e.sum(dim=-1, keepdim=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    keep = ((top_k <= 0)[:, None] | (ranks < top_k[:, None])) & ((top_p >= 1)[:, None] | (before < top_p[:, None] * total))
    if log_min_p is not None:
        keep &= s >= s[:, :1] + log_min_p[:, None]
    return torch.empty_like(keep).scatter_(-1, order, keep)


def sample(
    logits: torch.Tensor,  # [B, V], any float dtype
    temperature: torch.Tensor,  # [B] float32, 0 = greedy
    top_k: torch.Tensor,  # [B] int, <= 0 = off
    top_p: torch.Tensor,  # [B] float32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B]: position of the token being sampled
    filtered: bool | None = None,  # some row filters; None: find out (a host sync on CUDA)
    log_min_p: torch.Tensor | None = None,  # [B] float32, log(min_p); -inf or None: off
) -> torch.Tensor:  # [B] int64
    """Greedy rows take the argmax. Sampled rows take argmax(logits / T + Gumbel) over their kept set:
    the Gumbel-max trick (an exponential race), which draws exactly from softmax(logits / T) restricted
    to the kept set, with noise -log(-log(u)) from uniform_noise."""
    x = logits.float()
    greedy = x.argmax(dim=-1)
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = x / temp[:, None]
    score = scaled - torch.log(-torch.log(uniform_noise(seeds, positions, x.shape[-1])))
    if filtered is None:
        filtered = bool((top_k > 0).any() or (top_p < 1).any()
                        or (log_min_p is not None and (log_min_p > float("-inf")).any()))
    if filtered:
        score = score.masked_fill(~kept_tokens(scaled, top_k, top_p, log_min_p), float("-inf"))
    return torch.where(temperature == 0, greedy, score.argmax(dim=-1))


# -- logits processing (cluster/kernels/logits_processing.py) -------------------------------------
# Per row whose slot >= 0, in vLLM's order: tokens outside allowed_token_ids -> -inf; logit_bias
# added; repetition penalty (tokens of the prompt or generated: x / r if x > 0 else x * r); then
# x - frequency * count - presence * (count > 0) over generated tokens; the last token of each bad
# word whose other tokens were the last ones generated -> -inf. Rows without a slot: float32 copy.

def _unpack_bits(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, W] int32 bitmasks -> [n, vocab] bool."""
    t = torch.arange(vocab, device=bits.device)
    return ((bits[:, t >> 5] >> (t & 31)) & 1).bool()


def _penalise(x, counts, in_prompt, fp, on):
    """Repetition, then frequency and presence penalties, where `on`; each op rounds like the kernel's."""
    rep, freq, pres = fp[..., 0], fp[..., 1], fp[..., 2]
    seen = (counts > 0) | in_prompt
    y = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    y = y - freq * counts.float() - pres * (counts > 0).float()
    return torch.where(on, y, x)


def process_logits(logits: torch.Tensor, row_slots: torch.Tensor, state, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] float32 processed logits (see above); `state` is a cluster.sampling.sampling_state.SamplingState."""
    from cluster.sampling.sampling_state import ALLOWED, FLAGS, NUM_BAD, NUM_BIAS, NUM_GENERATED, PENALTIES

    raw = logits.float()
    x = raw.clone()
    vocab = x.shape[1]
    rows = torch.nonzero(row_slots >= 0).flatten()
    if len(rows):
        s = row_slots[rows].long()
        ip, fp = state.iparams[s], state.fparams[s]
        flags = ip[:, FLAGS]
        allowed = ~((flags & ALLOWED) > 0)[:, None] | _unpack_bits(state.allowed[s], vocab)
        base = torch.where(allowed, raw[rows], float("-inf"))
        counts = state.counts[s]
        in_prompt = _unpack_bits(state.prompt[s], vocab)
        pen = ((flags & PENALTIES) > 0)[:, None]
        y = _penalise(base, counts, in_prompt, fp[:, None, :], pen)
        for i in range(len(rows)):  # sparse parts: logit_bias entries, then bad words
            nb = int(ip[i, NUM_BIAS])
            if nb:
                ids = state.bias_ids[s[i], :nb].long()
                b = base[i, ids] + state.bias_vals[s[i], :nb]
                y[i, ids] = _penalise(b, counts[i, ids], in_prompt[i, ids], fp[i], pen[i])
            n_gen, hist = int(ip[i, NUM_GENERATED]), state.history[s[i]].tolist()
            for j in range(int(ip[i, NUM_BAD])):
                length = int(state.bad_len[s[i], j])
                word = state.bad_ids[s[i], j, :length].tolist()
                prefix = word[:-1]
                if n_gen >= len(prefix) and (not prefix or hist[len(hist) - len(prefix):] == prefix):
                    y[i, word[-1]] = float("-inf")
        x[rows] = y
    return x if out is None else out.copy_(x)


def apply_token_bitmask(logits: torch.Tensor, row_mask: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Grammar masks (cluster/kernels/token_bitmask.py): rows with row_mask >= 0 get -inf at every
    token whose bit in bitmask[row_mask] is 0; in place; returns logits."""
    b, vocab = logits.shape
    index = row_mask[:b].long()
    on = index >= 0
    allowed = _unpack_bits(bitmask[index.clamp(min=0)], vocab) | ~on[:, None]
    logits.masked_fill_(~allowed, float("-inf"))
    return logits


def update_sampling_state(row_slots: torch.Tensor, tokens: torch.Tensor, state) -> None:
    """After a draw: each row with a slot counts its token and appends it to the slot's history."""
    from cluster.sampling.sampling_state import NUM_GENERATED

    rows = torch.nonzero(row_slots >= 0).flatten()
    if not len(rows):
        return
    s, t = row_slots[rows].long(), tokens[rows].long()
    state.counts[s, t] += 1
    state.history[s] = torch.cat([state.history[s, 1:], t[:, None].to(state.history.dtype)], dim=1)
    state.iparams[s, NUM_GENERATED] += 1


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """log_softmax of the logits as given (the model's distribution), in float32: the logprob of each
    row's token, and the k largest with their ids -> ([B] float32, [B, k] int64, [B, k] float32)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], torch.zeros(lp.shape[0], 0, dtype=torch.int64, device=lp.device))
    return lp.gather(1, tokens.long()[:, None])[:, 0], top_ids, top_lp


# -- a decode step's inputs from the packed per-step buffer -------------------------------------


def decode_inputs(packed, rows, out_tokens, ids, positions, slots, context_lens, next_positions, tables,
                  block_size) -> None:
    """Fills the step's input buffers from `packed` (laid out by DecodeStepLayout(rows)); see
    cluster/kernels/decode_step_inputs.py. Reads the width on the host: CPU only."""
    lay = DecodeStepLayout(rows)
    width = int(packed[lay.width])
    prev = packed[lay.prev_row : lay.prev_row + rows].long()
    pos = packed[lay.positions : lay.positions + rows].long()
    table = packed[lay.tables : lay.tables + rows * width].view(rows, width)
    tables[:rows, :width] = table
    ids[:rows] = torch.where(prev >= 0, out_tokens[prev.clamp(min=0)], packed[lay.host_ids : lay.host_ids + rows].long())
    blk = table.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).long()
    positions[:rows] = pos
    slots[:rows] = blk * block_size + pos % block_size
    context_lens[:rows] = (pos + 1).to(context_lens.dtype)
    next_positions[:rows] = pos + 1

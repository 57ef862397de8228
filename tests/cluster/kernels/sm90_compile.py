"""Compiles every Triton kernel of the forward pass for sm_90 (H100/H200) without a GPU, with the
argument types and meta-parameters its launcher uses, and prints one JSON line per kernel with its
register count and stack bytes (spills) from the resource report of Triton's own cuobjdump.

Run by test_kernels_compile_for_sm90.py in a subprocess: TRITON_INTERPRET must be unset here.
"""

import json
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cluster.attention import triton_decode
from cluster.kernels import (decode_step_inputs, fp8_gemm, fp8_gemm_configs, fp8_quant, logits_processing, logprobs,
                             prefill_attention, rmsnorm, rotary_kv, sampling, silu_mul, token_bitmask)
from cluster.sampling.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def report(name, fn, types: dict, meta: dict, num_warps: int, num_stages: int = 3, aligned: tuple[str, ...] | None = None,
           **options):
    """`aligned`: compile as a launch would specialize it, every pointer and these integer arguments
    divisible by 16 (what vectorizes loads); `options`: the launch's compile options."""
    signature = {**types, **{k: "constexpr" for k in meta}}
    attrs = None
    if aligned is not None:
        names = list(fn.arg_names)
        attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, t in types.items()
                 if t.startswith("*") or k in aligned}
    kernel = triton.compile(ASTSource(fn, signature, meta, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages, **options))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(item.split(":", 1) for item in next(line for line in usage.splitlines() if "REG:" in line).split()
                  if ":" in item)
    ptx = kernel.asm["ptx"]
    print(json.dumps({"kernel": name, "registers": int(fields["REG"]), "stack": int(fields["STACK"]),
                      "wgmma": "wgmma" in ptx, "bf16_fma": "fma.rn.bf16" in ptx,
                      "fast_widen": "0x87F087F0" in ptx}), flush=True)


def main():
    i32, bf16 = "i32", "*bf16"
    for hidden, res in ((4096, True), (2048, False)):
        report(f"rmsnorm/{hidden}/{res}", rmsnorm._rms_norm_kernel,
               dict(X=bf16, R=bf16, W=bf16, Out=bf16, stride_x=i32, stride_r=i32, stride_o=i32, n=i32, eps="fp32"),
               dict(HAS_RESIDUAL=res, BLOCK=hidden), num_warps=hidden // 512)
    for heads, kv_heads, d, kv in ((32, 8, 128, bf16), (28, 4, 128, bf16), (32, 8, 128, "*fp8e4nv")):
        report(f"rotary_kv/{heads}/{kv_heads}/{d}/{kv}", rotary_kv._rotary_kv_kernel,
               dict(QKV=bf16, Pos="*i64", CosSin=bf16, KC=kv, VC=kv, Slots="*i64", stride_t=i32, stride_cs=i32,
                    stride_slot=i32, k_scale="fp32", v_scale="fp32"),
               dict(H=heads, KH=kv_heads, QKP=triton.next_power_of_2(heads + kv_heads),
                    KP=triton.next_power_of_2(kv_heads), D=d, KV_FP8=kv != bf16), num_warps=4,
               enable_fp_fusion=False)  # as rotary_kv.py launches it
    report("silu_mul", silu_mul._silu_mul_kernel, dict(GateUp=bf16, Out=bf16, stride_g=i32, stride_o=i32, n=i32),
           dict(BLOCK=silu_mul.BLOCK), num_warps=4)
    for d, group, sliding, kv in ((128, 4, False, bf16), (128, 8, True, bf16), (64, 4, False, bf16),
                                  (128, 4, False, "*fp8e4nv")):
        report(f"prefill_attention/{d}/{group}/{sliding}/{kv}", prefill_attention._prefill_attention_kernel,
               dict(Q=bf16, KC=kv, VC=kv, Out=bf16, BT="*i64", CuQ="*i32", Ctx="*i64", Tiles="*i32",
                    stride_qt=i32, stride_qh=i32, stride_kb=i32, stride_kt=i32, stride_kh=i32, stride_bt=i32,
                    stride_ot=i32, stride_oh=i32, num_tiles=i32, scratch_row=i32, scale_log2="fp32", v_scale="fp32",
                    window=i32),
               dict(G=group, D=d, PAGE=16, BLOCK_M=prefill_attention.BLOCK_M, BLOCK_N=64 if d >= 128 else 128,
                    SLIDING=sliding, IEEE=False), num_warps=8)
    nbp = triton.next_power_of_2(sampling.NBINS + 1)
    for dtype in (bf16, "*fp32"):  # raw logits (plain step), processed ones (features step)
        report(f"sampling/first_pass/{dtype}", sampling._first_pass_kernel,
               dict(Logits=dtype, stride_row=i32, Temp="*fp32", TopK="*i32", TopP="*fp32", LogMinP="*fp32",
                    Seeds="*i64", Pos="*i64", PartF="*fp32", PartI="*i32", Hist="*i32", V=i32),
               dict(CHUNK=sampling.CHUNK, BLOCK=sampling.BLOCK, NBINS=sampling.NBINS, NBP=nbp), num_warps=8)
        report(f"sampling/threshold/{dtype}", sampling._threshold_kernel,
               dict(Logits=dtype, stride_row=i32, Temp="*fp32", TopK="*i32", TopP="*fp32", LogMinP="*fp32",
                    PartF="*fp32", PartI="*i32", Hist="*i32", Out="*i64", RowF="*fp32", RowI="*i32", UncN="*i32",
                    V=i32, num_chunks=i32),
               dict(CP=16, NBINS=sampling.NBINS, NBP=nbp), num_warps=8)
        report(f"sampling/candidates/{dtype}", sampling._candidate_kernel,
               dict(Logits=dtype, stride_row=i32, Temp="*fp32", Seeds="*i64", Pos="*i64", RowF="*fp32", RowI="*i32",
                    CandF="*fp32", CandI="*i32", UncX="*fp32", UncId="*i32", UncN="*i32", V=i32),
               dict(CHUNK=sampling.CHUNK, BLOCK=sampling.BLOCK, NBINS=sampling.NBINS, CAP=sampling.CAP), num_warps=8)
        report(f"sampling/resolve/{dtype}", sampling._resolve_kernel,
               dict(Logits=dtype, stride_row=i32, Temp="*fp32", TopK="*i32", TopP="*fp32", LogMinP="*fp32",
                    Seeds="*i64", Pos="*i64", RowF="*fp32", RowI="*i32", CandF="*fp32", CandI="*i32", UncX="*fp32",
                    UncId="*i32", UncN="*i32", Out="*i64", V=i32, num_chunks=i32),
               dict(CP=16, BLOCK=sampling.FINISH_BLOCK, NBINS=sampling.NBINS, CAP=sampling.CAP, UB=sampling.UB),
               num_warps=8)
    report("logits_processing/process", logits_processing._process_kernel,
           dict(Logits=bf16, stride_l=i32, Out="*fp32", stride_o=i32, RowSlot="*i32", Counts="*i32", Prompt="*i32",
                Allowed="*i32", FParams="*fp32", IParams="*i32", BiasIds="*i32", BiasVals="*fp32", BadIds="*i32",
                BadLen="*i32", History="*i32", V=i32, W=i32),
           dict(CHUNK=logits_processing.CHUNK, BLOCK=logits_processing.BLOCK, NB=MAX_LOGIT_BIAS,
                NBP=triton.next_power_of_2(MAX_LOGIT_BIAS), NBW=MAX_BAD_WORDS, LBW=MAX_BAD_WORD_TOKENS), num_warps=8)
    report("logits_processing/update", logits_processing._update_kernel,
           dict(RowSlot="*i32", Tokens="*i64", Counts="*i32", History="*i32", IParams="*i32", V=i32),
           dict(LBW=MAX_BAD_WORD_TOKENS), num_warps=1)
    report("logprobs/lse", logprobs._lse_partial_kernel, dict(Logits=bf16, stride_l=i32, Part="*fp32", V=i32),
           dict(CHUNK=logprobs.CHUNK, BLOCK=logprobs.BLOCK), num_warps=8)
    report("logprobs/finish", logprobs._finish_kernel,
           dict(Logits=bf16, stride_l=i32, Part="*fp32", num_chunks=i32, Tokens="*i64", TopVals=bf16, stride_t=i32,
                OutLp="*fp32", OutTop="*fp32", K=i32), dict(CP=16, KP=32), num_warps=1)
    for dtype in (bf16, "*fp32"):  # the plain step's raw logits, the features step's processed ones
        report(f"token_bitmask/{dtype}", token_bitmask._apply_token_bitmask_kernel,
               dict(Logits=dtype, stride_l=i32, RowMask="*i32", Bitmask="*i32", stride_b=i32, V=i32),
               dict(BLOCK=token_bitmask.BLOCK), num_warps=4)
    report("decode_step_inputs", decode_step_inputs._decode_inputs_kernel,
           dict(Packed="*i32", OutTokens="*i64", Ids="*i64", Pos="*i64", Slots="*i64", Ctx="*i32", NextPos="*i64",
                Tables="*i32", off_ids=i32, off_prev=i32, off_pos=i32, off_width=i32, off_tables=i32,
                stride_tables=i32, block_size=i32), dict(BLOCK=256), num_warps=1)
    for d, splits, kv in ((128, 32, bf16), (128, 1, bf16), (64, 32, bf16), (128, 32, "*fp8e4nv")):
        report(f"decode_attention/{d}/{splits}/{kv}", triton_decode._decode_split_kernel,
               dict(Q=bf16, KC=kv, VC=kv, BT="*i32", CTX="*i32", MidO="*fp32", MidLse="*fp32", Out=bf16,
                    stride_qt=i32, stride_qh=i32, stride_kb=i32, stride_kt=i32, stride_kh=i32, stride_bt=i32,
                    stride_mb=i32, stride_mh=i32, stride_ms=i32, stride_ot=i32, stride_oh=i32, scale="fp32",
                    v_scale="fp32", window=i32),
               dict(G=4, GP=16, D=d, PAGE=16, BLOCK=triton_decode.BLOCK_N, NUM_SPLITS=splits, SLIDING=False,
                    IEEE=False, KV_FP8=kv != bf16, FAST_WIDEN=True), num_warps=8 if d >= 128 else 4, num_stages=2)

    # The FP8 GEMMs at the default config of decode GEMV, mid-size and prefill-size M (fp8_gemm_configs.py;
    # the tuned table's configs are the tuner's to check: it drops what does not compile or spills slowly).
    ints = ("N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split")
    for m, n, k, block, bias in ((1, 4096, 14336, False, False), (32, 6144, 4096, False, True),
                                 (64, 6144, 4096, False, True), (256, 28672, 4096, True, False),
                                 (1, 4096, 4096, True, False)):
        cfg = fp8_gemm_configs.default_config(m, n, k, False, block, 132)
        report(f"fp8_gemm/{m}/{n}/{k}/{block}", fp8_gemm._fp8_gemm_kernel,
               dict(X=bf16, W="*fp8e4nv", S="*fp32", Bias=bf16, Out=bf16, Part="*fp32", Locks="*i32", M=i32, N=i32,
                    K=i32, stride_xm=i32, stride_wn=i32, stride_om=i32, stride_s=i32, k_per_split=i32, split_k=i32),
               dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True, BLOCK_SCALED=block,
                    SB=fp8_gemm.SCALE_BLOCK, HAS_BIAS=bias, FAST_DEQUANT=True, IEEE=False),
               num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=ints)
    for m, n, k in ((1, 4096, 14336), (64, 6144, 4096), (256, 28672, 4096)):
        cfg = fp8_gemm_configs.default_config(m, n, k, True, False, 132)
        report(f"fp8_gemm_w8a8/{m}/{n}/{k}", fp8_gemm._fp8_w8a8_kernel,
               dict(XQ="*fp8e4nv", XS="*fp32", W="*fp8e4nv", S="*fp32", Bias=bf16, Out=bf16, Part="*fp32",
                    Locks="*i32", M=i32, N=i32, K=i32, stride_xm=i32, stride_wn=i32, stride_om=i32, k_per_split=i32,
                    split_k=i32),
               dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True, HAS_BIAS=False),
               num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=ints)
    for k in (4096, 14336):
        block = triton.next_power_of_2(k)
        report(f"fp8_quant/{k}", fp8_quant._quant_kernel,
               dict(X=bf16, Q="*fp8e4nv", Scale="*fp32", StaticScale="*fp32", K=i32, stride_x=i32, stride_q=i32),
               dict(FMAX=448.0, MIN_SCALE=1.0 / (448 * 512), STATIC=False, BLOCK=block),
               num_warps=max(1, min(16, block // 1024)))


if __name__ == "__main__":
    main()

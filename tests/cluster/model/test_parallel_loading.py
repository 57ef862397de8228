"""Each rank of a tensor-parallel model loads only its part of every split tensor, and its parts equal the
corresponding slices of the whole model: fused QKV / gate-up rows (KV rows replicated where the model has
fewer KV heads than ranks), o_proj / down_proj columns, LM-head vocabulary rows; FP8 scales follow the
rows and columns they scale (per channel, per tensor, 128 x 128 blocks). Bytes are counted by wrapping
safetensors' reader: a split tensor is never read whole."""

import pytest
import torch
from fp8_checkpoints import write_compressed_tensors, write_float_llama, write_hf_fp8_block

import cluster.model.checkpoint as checkpoint
from cluster.distributed.sharding import TPShard
from cluster.errors import ModelLoadError
from cluster.model.config import ModelArchConfig
from cluster.model.loader import load_model
from cluster.model.parallel_linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TensorParallel

SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


class _CountingReader:
    """safe_open, counting the bytes of every tensor it hands out (whole reads and slice reads)."""

    def __init__(self, log):
        self.log = log

    def __call__(self, path, framework, device):
        real = _REAL_SAFE_OPEN(path, framework=framework, device=device)
        log = self.log

        class Reader:
            def __enter__(self):
                real.__enter__()
                return self

            def __exit__(self, *a):
                return real.__exit__(*a)

            def keys(self):
                return real.keys()

            def get_tensor(self, name):
                t = real.get_tensor(name)
                log.append((name, "whole", t.numel() * t.element_size()))
                return t

            def get_slice(self, name):
                sl = real.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, index):
                        t = sl[index]
                        log.append((name, "slice", t.numel() * t.element_size()))
                        return t
                return Slice()
        return Reader()


_REAL_SAFE_OPEN = checkpoint.safe_open  # where the loader's safetensors files are opened


def _load_rank(model_dir, rank, size, monkeypatch, **kw):
    arch = ModelArchConfig.from_dir(model_dir)
    log = []
    monkeypatch.setattr(checkpoint, "safe_open", _CountingReader(log))
    model = load_model(model_dir, tp=TensorParallel(TPShard.of(arch, rank, size), comm=None), **kw)
    monkeypatch.setattr(checkpoint, "safe_open", _REAL_SAFE_OPEN)
    return model, log


def _file_bytes(model_dir):
    from safetensors import safe_open

    total = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt", "cpu") as r:
            for name in r.keys():
                t = r.get_tensor(name)
                total[name] = t.numel() * t.element_size()
    return total


def _rows(w, parts):
    return torch.cat([w[a:b] for a, b in parts])


@pytest.mark.parametrize("arch_fixture", ["demo_model_dir", "qwen2_model_dir", "mistral_model_dir"])
def test_each_rank_reads_only_its_slices_and_they_equal_the_whole_models(arch_fixture, request, monkeypatch):
    model_dir = request.getfixturevalue(arch_fixture)
    whole = load_model(model_dir)
    arch = whole.cfg
    file_bytes = _file_bytes(model_dir)
    read_per_rank = []
    for rank in range(2):
        model, log = _load_rank(model_dir, rank, 2, monkeypatch)
        sh = model.tp.shard
        hd = arch.head_dim
        for i, (layer, ref) in enumerate(zip(model.layers, whole.layers)):
            qkv, rq = layer.self_attn.qkv_proj, ref.self_attn.qkv_proj
            assert isinstance(qkv, ColumnParallelLinear) and isinstance(layer.self_attn.o_proj, RowParallelLinear)
            q0, qn = sh.q_rows
            k0, kn = sh.kv_rows
            qs, ks = arch.q_size, arch.kv_size
            parts = [(q0, q0 + qn), (qs + k0, qs + k0 + kn), (qs + ks + k0, qs + ks + k0 + kn)]
            assert torch.equal(qkv.weight, _rows(rq.weight, parts))
            if rq.bias is not None:  # Qwen2's q/k/v bias
                assert torch.equal(qkv.bias, _rows(rq.bias, parts))
            assert torch.equal(layer.self_attn.o_proj.weight, ref.self_attn.o_proj.weight[:, q0:q0 + qn])
            i0, n = sh.mlp_rows
            inter = arch.intermediate_size
            assert torch.equal(layer.mlp.gate_up_proj.weight,
                               _rows(ref.mlp.gate_up_proj.weight, [(i0, i0 + n), (inter + i0, inter + i0 + n)]))
            assert torch.equal(layer.mlp.down_proj.weight, ref.mlp.down_proj.weight[:, i0:i0 + n])
            assert torch.equal(layer.input_layernorm.weight, ref.input_layernorm.weight)  # replicated
        assert torch.equal(model.embed_tokens.weight, whole.embed_tokens.weight)
        lo, hi = sh.vocab_rows
        assert isinstance(model.lm_head, ParallelLMHead)
        assert torch.equal(model.lm_head.weight[: hi - lo], whole.lm_head.weight[lo:hi])
        if arch.tie_word_embeddings:  # the demo's: a view of the embedding, nothing read for it
            assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight[lo:].data_ptr()
        # Bytes: every split tensor is read as a slice (never whole), for its part only.
        for name, how, nbytes in log:
            split = any(s in name for s in SPLIT)
            kv_replicated = arch.num_kv_heads < 2 and ("k_proj" in name or "v_proj" in name)
            if split and not kv_replicated and not name.endswith("bias"):
                assert how == "slice", name
                assert nbytes == file_bytes[name] // 2, name
            elif not split:
                assert how == "whole" and nbytes == file_bytes[name], name
        read_per_rank.append(sum(b for _, _, b in log))
    total = sum(file_bytes.values())
    for read in read_per_rank:
        assert read < 0.75 * total, (read, total)  # most of a checkpoint is split weights
    print(f"\n{arch_fixture}: checkpoint {total} bytes, rank 0 read {read_per_rank[0]}, rank 1 {read_per_rank[1]}")


def test_mistral_single_kv_head_is_read_whole_by_both_ranks(mistral_model_dir, monkeypatch):
    whole = load_model(mistral_model_dir)
    for rank in range(2):
        model, log = _load_rank(mistral_model_dir, rank, 2, monkeypatch)
        assert list(model.tp.shard.kv_heads) == [0] and model.num_kv_heads == 1
        kv = model.layers[0].self_attn.qkv_proj.weight[whole.cfg.q_size // 2:]
        ref = whole.layers[0].self_attn.qkv_proj.weight[whole.cfg.q_size:]
        assert torch.equal(kv, ref)  # k and v of the one head, on both ranks


@pytest.fixture(scope="module")
def ct_dynamic(demo_model_dir, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    return write_compressed_tensors(demo_model_dir, tmp_path_factory.mktemp("ct_dyn_tp"), "FP8_DYNAMIC")


@pytest.fixture(scope="module")
def ct_static(demo_model_dir, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    return write_compressed_tensors(demo_model_dir, tmp_path_factory.mktemp("ct_static_tp"), "FP8")


def _check_fp8_shards(model_dir, monkeypatch, size=2):
    whole = load_model(model_dir)
    for rank in range(size):
        model, log = _load_rank(model_dir, rank, size, monkeypatch)
        sh = model.tp.shard
        a = whole.cfg
        (q0, qn), (k0, kn), (i0, n) = sh.q_rows, sh.kv_rows, sh.mlp_rows
        qs, ks = a.q_size, a.kv_size
        qkv_parts = [(q0, q0 + qn), (qs + k0, qs + k0 + kn), (qs + ks + k0, qs + ks + k0 + kn)]
        for layer, ref in zip(model.layers, whole.layers):
            qkv, rqkv = layer.self_attn.qkv_proj, ref.self_attn.qkv_proj
            o, ro = layer.self_attn.o_proj, ref.self_attn.o_proj
            assert qkv.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(qkv.weight.view(torch.uint8), _rows(rqkv.weight.view(torch.uint8), qkv_parts))
            assert torch.equal(o.weight.view(torch.uint8), ro.weight.view(torch.uint8)[:, q0:q0 + qn])
            block = qkv.method.scheme.block
            if block is None:  # channel / per-tensor scales: one per output row
                assert torch.equal(qkv.weight_scale, _rows(rqkv.weight_scale, qkv_parts))
                assert torch.equal(o.weight_scale, ro.weight_scale)  # a row-parallel layer keeps every row
            else:
                bn, bk = block
                assert torch.equal(qkv.weight_scale, _rows(rqkv.weight_scale, [(a0 // bn, b0 // bn) for a0, b0 in qkv_parts]))
                assert torch.equal(o.weight_scale, ro.weight_scale[:, q0 // bk:(q0 + qn) // bk])
            if qkv.method.scheme.activations == "static":
                assert torch.equal(qkv.input_scale, rqkv.input_scale) and torch.equal(o.input_scale, ro.input_scale)
            d, rd = layer.mlp.down_proj, ref.mlp.down_proj
            assert torch.equal(d.weight.view(torch.uint8), rd.weight.view(torch.uint8)[:, i0:i0 + n])


def test_fp8_channel_scales_shard_with_the_rows(ct_dynamic, monkeypatch):
    _check_fp8_shards(ct_dynamic, monkeypatch)


def test_fp8_per_tensor_static_scales_go_to_every_rank(ct_static, monkeypatch):
    _check_fp8_shards(ct_static, monkeypatch)


def test_fp8_block_scales_shard_with_rows_and_columns(demo_model_dir, tmp_path, monkeypatch):
    # Parts of 128 rows per rank: q 256 / 2, k and v 256 / 2, gate/up 512 / 2, o and down columns too.
    src = write_float_llama(demo_model_dir, tmp_path / "f", seed=4, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    _check_fp8_shards(write_hf_fp8_block(src, tmp_path / "b"), monkeypatch)


def test_fp8_block_scales_that_a_rank_would_cut_are_refused(demo_model_dir, tmp_path, monkeypatch):
    # 2 KV heads of 64: a rank's k rows are 64, half a 128-row scale block.
    src = write_float_llama(demo_model_dir, tmp_path / "f", seed=3, hidden_size=256, intermediate_size=384,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    with pytest.raises(ModelLoadError, match="multiple of 128 rows, got .128, 64, 64.: this rank's part"):
        _load_rank(write_hf_fp8_block(src, tmp_path / "b"), 1, 2, monkeypatch)


def test_online_fp8_quantizes_each_ranks_own_part(demo_model_dir, monkeypatch):
    """--quantization fp8: a column-parallel rank's rows keep the whole model's per-row scales; a
    row-parallel rank quantizes its own columns (its scales are over them)."""
    whole = load_model(demo_model_dir, quantization="fp8")
    model, _ = _load_rank(demo_model_dir, 1, 2, monkeypatch, quantization="fp8")
    q0, qn = model.tp.shard.q_rows
    qkv, rqkv = model.layers[0].self_attn.qkv_proj, whole.layers[0].self_attn.qkv_proj
    assert torch.equal(qkv.weight_scale[:qn], rqkv.weight_scale[q0:q0 + qn])
    float_model = load_model(demo_model_dir)
    cols = float_model.layers[0].self_attn.o_proj.weight[:, q0:q0 + qn]
    expect = cols.abs().amax(dim=1) / 448.0
    torch.testing.assert_close(model.layers[0].self_attn.o_proj.weight_scale, expect)

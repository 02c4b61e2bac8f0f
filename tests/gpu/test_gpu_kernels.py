"""The fast paths a GPU takes, each against its unfused reference (outputs and gradients), and the
device and data plumbing that only exists with CUDA (device placement, pinned loader memory)."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_ds.config import DataConfig, parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.model.kernels import apex_norm_classes
from megatron_ds.model.language_model import document_ids
from megatron_ds.model.transformer import ParallelTransformerLayer
from megatron_ds.parallel.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy
from megatron_ds.parallel.cross_entropy import vocab_parallel_cross_entropy

pytestmark = pytest.mark.gpu

FUSED_SDPA_OPS = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                  "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_fused_attention_overrideable"}
MATH_SDPA_OP = "aten::_scaled_dot_product_attention_math"
FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def _model_config(*flags):
    cfg, _ = parse_args(("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
                         "--max-position-embeddings 512 --micro-batch-size 2 --mock-data --train-iters 1 "
                         "--lr 1e-4 --hidden-dropout 0 --attention-dropout 0").split() + list(flags))
    return resolve(cfg, world_size=1, vocab_size=1024, device_type="cuda", family=GPT).layout.model


ATTENTION_CASES = {
    "gpt2": [],
    "gqa_rope": ["--num-key-value-heads", "2", "--use-rotary-position-embeddings"],
    "document_mask": [],  # --reset-attention-mask: an explicit boolean mask instead of is_causal
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_runs_a_fused_sdpa_kernel(case):
    """The training layer in bf16, forward and backward: a flash / memory-efficient / cuDNN kernel
    runs, never the math fallback (which would be ~3x slower and store the [s, s] scores). Also
    with only the fused backends allowed, so an unsupported layout would raise here."""
    cfg = _model_config(*ATTENTION_CASES[case])
    layer = ParallelTransformerLayer(cfg, 1, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(512, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inputs = x
    if case == "document_mask":
        tokens = torch.randint(0, 50, (2, 512), device="cuda")
        inputs = (x, document_ids(tokens, eod_token=0))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        out = layer(inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
    names = {event.key for event in prof.key_averages()}
    assert names & FUSED_SDPA_OPS and MATH_SDPA_OP not in names, sorted(n for n in names if "attention" in n)
    with sdpa_kernel(FUSED_BACKENDS):
        out = layer(inputs)
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()


@pytest.mark.parametrize("backend", FUSED_BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_sdpa_matches_the_math_reference(backend, dtype):
    """Causal attention in half precision through one fused backend vs float64 math on the same
    (already rounded) inputs. Error budget: the output and the gradients are rounded once to the
    half type (bf16 2^-8 = 3.9e-3, fp16 2^-11 relative), and the kernels round the softmax
    probabilities to it before the P @ V product: a few roundings of O(1) values; atol 2e-2 for
    bf16 (5 roundings), 4e-3 for fp16, rtol the same."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 8, 256, 64)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_(True) for _ in range(3))
    upstream = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(upstream)
    except RuntimeError as exc:  # e.g. cuDNN attention absent from this build or GPU
        pytest.skip(f"{backend.name} not available here: {str(exc).splitlines()[0]}")
    ref_inputs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*ref_inputs, is_causal=True)
    ref.backward(upstream.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for got, want in zip((q, k, v), ref_inputs):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=tol, atol=tol)


def test_chunked_cross_entropy_on_the_gpu():
    """bf16 logits of a GPT-2 vocabulary: loss and gradient against float64, and no fp32 copy of
    the logits: the loss adds at most the bf16 gradient plus one fp32 chunk (256 MB) to memory,
    where the fp32 path needs three fp32 tensors of the logits' size."""
    tokens, vocab = 4096, 50304
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(tokens, vocab, device="cuda", generator=gen) * 3).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = chunked_vocab_parallel_cross_entropy(logits, target, None)
    loss.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    bf16_bytes = logits.numel() * 2
    # Besides the bf16 gradient and one fp32 chunk with its temporaries, the loss allocates vectors
    # of one value per token (the loss itself, row maxima, sums of exp, target logits, their
    # gradients: 4096 x 4 B = 16 KiB each) and a few scalars, each block rounded up to a multiple
    # of 512 B by the CUDA caching allocator; measured on an H200: 60,416 B above the two big terms.
    # Allow 64 such vectors (1 MiB): still ~800x less than the fp32 copy of the logits (824 MB)
    # this bound exists to exclude.
    allocator_margin = 64 * tokens * 4
    assert extra < bf16_bytes + 2 * 2 ** 28 + allocator_margin, (extra, bf16_bytes)  # grad + chunk + vectors
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, target, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-5)  # fp32 math, as on CPU
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=2 ** -8, atol=2 ** -9)  # one bf16 rounding
    old = vocab_parallel_cross_entropy(logits.detach().float(), target, None)
    torch.testing.assert_close(loss, old, rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(apex_norm_classes() is None, reason="apex with its CUDA extension is not installed")
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_apex_norms_match_torch(kind):
    """apex's fused norms vs torch's on bf16 input: both compute statistics in fp32 and round the
    output once to bf16 (2^-8 relative of O(1) values): atol/rtol 1e-2 allows two roundings."""
    from megatron_ds.model.norms import _RMSNorm

    fused_layernorm, fused_rmsnorm = apex_norm_classes()
    fused = (fused_layernorm if kind == "layernorm" else fused_rmsnorm)(512, eps=1e-5).cuda().bfloat16()
    plain = (torch.nn.LayerNorm(512, eps=1e-5) if kind == "layernorm" else _RMSNorm(512, 1e-5)).cuda().bfloat16()
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = fused(xa), plain(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-2, atol=1e-2)
    ya.float().square().sum().backward()
    yb.float().square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-2, atol=1e-2)


def test_each_local_rank_gets_its_own_gpu(monkeypatch):
    from megatron_ds.training.device import select_device

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert select_device(0) == torch.device("cuda", 0)
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"LOCAL_RANK {count} has no GPU: {count} CUDA device"):
        select_device(count, count + 1)


def test_loader_workers_hand_over_pinned_batches(monkeypatch):
    """The path that crashed every GPU run: two workers, pin_memory on (as training sets it when
    batches go to the GPU), every tensor of every micro-batch arrives pinned."""
    from megatron_ds.training.data import BatchCollator, MockGPTDataset, build_loader

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    cfg = DataConfig(num_workers=2, reset_position_ids=False)
    collator = BatchCollator(cfg, eod=0, vocab_size=64, source="test")
    loader = build_loader(MockGPTDataset(16, 32, 64, seed=0), cfg, collator, consumed_samples=0,
                          micro_batch_size=4, dp_rank=0, dp_size=1)
    assert loader.pin_memory
    batches = list(loader)
    assert len(batches) == 4
    for inputs, labels in batches:
        assert all(t.is_pinned() for t in (*inputs, *labels))

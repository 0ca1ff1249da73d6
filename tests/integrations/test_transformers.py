"""attention_c as a Hugging Face transformers backend
(attention_c.integrations.transformers): eleven architectures from tiny
random configs against transformers' own eager attention (float64 where
eager is exact enough, else float32), logits, every parameter's gradient,
greedy generation on left-padded batches, the attention weights, packed
sequences and a save/reload.  No hub access: models come from configs."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attention_c as ac  # noqa: E402
from attention_c.integrations import transformers as act  # noqa: E402

NAME = act.register()
V = 61  # vocabulary


def _llama():
    return transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64)


def _qwen3():
    return transformers.Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, head_dim=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64)


def _mistral():
    return transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, sliding_window=5)


def _gemma2():
    return transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, head_dim=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, sliding_window=5,
        query_pre_attn_scalar=8, attn_logit_softcapping=1.5,
        final_logit_softcapping=30.0)


def _gemma3():
    return transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, head_dim=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, sliding_window=5,
        query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"])


def _gpt_oss():
    return transformers.GptOssConfig(
        vocab_size=V, hidden_size=32, intermediate_size=32, head_dim=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])


def _gpt2():
    return transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2,
                                   n_head=4, n_positions=64)


DECODERS = {
    "llama": (_llama, transformers.LlamaForCausalLM),
    "qwen3": (_qwen3, transformers.Qwen3ForCausalLM),
    "mistral": (_mistral, transformers.MistralForCausalLM),
    "gemma2": (_gemma2, transformers.Gemma2ForCausalLM),
    "gemma3": (_gemma3, transformers.Gemma3ForCausalLM),
    "gpt_oss": (_gpt_oss, transformers.GptOssForCausalLM),
    "gpt2": (_gpt2, transformers.GPT2LMHeadModel),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _pair(make, cls, dtype, ref="eager", seed=0):
    """(ours, reference): the same random weights, two backends."""
    cfg = make()
    torch.manual_seed(seed)
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith("sinks"):      # gpt-oss starts them at 0
                p.normal_()
    theirs = cls._from_config(copy.deepcopy(cfg), attn_implementation=ref)
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == NAME
    return ours.to(dtype).eval(), theirs.to(dtype).eval()


def _grads(model, out_fn, mask=None):
    model.zero_grad()
    y = out_fn(model)
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    if mask is not None:
        w = w * mask[..., None]
    (y * w).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                        if p.grad is not None}


def _close(a, b, tol):
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= tol * (1 + b.abs().max().item()), err


def _compare(ours, theirs, fn, tol, mask=None):
    y1, g1 = _grads(ours, fn, mask)
    y2, g2 = _grads(theirs, fn, mask)
    if mask is not None:
        y1, y2 = y1[mask.bool()], y2[mask.bool()]
    _close(y1, y2, tol)
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        _close(g1[n], g2[n], tol)


# Eager's softmax runs in float32 in several models, whatever the dtype:
# float64 agrees to float32's rounding.
TOL64 = 1e-5
TOL32 = 2e-4


def _precision(arch):
    # gpt-oss's experts (grouped_mm) run in float32 only
    return ((torch.float32, TOL32) if arch == "gpt_oss"
            else (torch.float64, TOL64))


@pytest.mark.parametrize("arch", sorted(DECODERS))
def test_decoder_logits_and_gradients(arch):
    dtype, tol = _precision(arch)
    ours, theirs = _pair(*DECODERS[arch], dtype)
    ids = torch.randint(0, V, (2, 13), generator=_gen(1))
    _compare(ours, theirs, lambda m: m(ids).logits, tol)


@pytest.mark.parametrize("arch", sorted(DECODERS))
def test_decoder_left_padded_generate(arch):
    # Eager's finfo.min mask overflows to -inf in float64 on padded rows
    # (NaN), so float32 here.
    ours, theirs = _pair(*DECODERS[arch], torch.float32)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (3, 9), generator=g)
    am = torch.ones_like(ids)
    am[0, :3] = 0
    am[2, :1] = 0
    _compare(ours, theirs,
             lambda m: m(ids, attention_mask=am).logits, TOL32, mask=am)
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False,
              pad_token_id=0)
    t1 = ours.generate(ids, **kw)
    t2 = theirs.generate(ids, **kw)
    assert torch.equal(t1, t2)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "mistral"])
def test_output_attentions(arch):
    dtype, tol = _precision(arch)
    ours, theirs = _pair(*DECODERS[arch], dtype)
    ids = torch.randint(0, V, (2, 11), generator=_gen(3))
    a1 = ours(ids, output_attentions=True).attentions
    a2 = theirs(ids, output_attentions=True).attentions
    assert len(a1) == len(a2) == 2
    for x, y in zip(a1, a2):
        _close(x, y, tol)
    if arch == "mistral":       # the window is a band: nothing below it
        assert bool((a1[0][..., 10, :5] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_cache_read_as_stored(dtype):
    """16-bit queries, keys and values (a decoding step, GQA, strided
    cache views, and a prefill) go to the kernels as they are: the bits
    of the call on float32 copies (for bfloat16, with the bf16 products
    that a bfloat16 call takes: set_fp32_precision("bf16")), rounded once
    to the dtype; with gradients too, the gradients in the dtype."""
    module = torch.nn.Module()
    g = _gen(11)
    for Tq, T in ((1, 40), (3, 40), (17, 17)):
        q = torch.randn(2, 4, Tq, 8, generator=g).to(dtype)
        cache = torch.randn(2, 2, 2, 50, 8, generator=g).to(dtype)
        k, v = cache[0, ..., :T, :], cache[1, ..., :T, :]
        wide = [x.float() for x in (q, k, v)]
        precision = "bf16" if dtype == torch.bfloat16 else "ieee"
        with torch.no_grad(), ac.set_fp32_precision(precision):
            got, _ = act.attention_forward(module, q, k, v, None)
            want, _ = act.attention_forward(module, *wide, None)
        assert got.dtype == dtype
        assert torch.equal(got, want.to(dtype))
    q.requires_grad_(True)
    with ac.set_fp32_precision(precision):
        out, _ = act.attention_forward(module, q, k, v, None)
        assert torch.equal(out, want.to(dtype))
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == dtype


def test_bf16_greedy_tokens_equal_sdpa():
    """A bfloat16 model generating greedily (its cache bfloat16): the
    tokens of transformers' sdpa backend."""
    ours, theirs = _pair(*DECODERS["qwen3"], torch.bfloat16, ref="sdpa")
    ids = torch.randint(0, V, (2, 9), generator=_gen(12))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kw),
                           theirs.generate(ids, **kw))


def test_bf16_training_step_as_accurate_as_sdpa():
    """A bfloat16 model's logits and parameter gradients through our
    backend (bf16 tensors to the kernels as they are, bf16 products where
    the CPU has them, gradients summed in float32) against a float64 copy
    of it: no further off than transformers' sdpa backend in bfloat16,
    and every gradient bfloat16."""
    ours, theirs = _pair(*DECODERS["qwen3"], torch.bfloat16, ref="sdpa")
    exact = copy.deepcopy(theirs).to(torch.float64)
    ids = torch.randint(0, V, (2, 33), generator=_gen(13))

    def fn(m):
        return m(ids).logits.float()

    y0, g0 = _grads(exact, lambda m: m(ids).logits)
    y1, g1 = _grads(ours, fn)
    y2, g2 = _grads(theirs, fn)
    assert all(g.dtype == torch.bfloat16 for g in g1.values())

    def err(y, ref):
        return ((y.double() - ref).norm() / ref.norm()).item()
    errs1 = [err(y1, y0)] + [err(g1[n], g0[n]) for n in g0]
    errs2 = [err(y2, y0)] + [err(g2[n], g0[n]) for n in g0]
    assert max(errs1) < 0.05, errs1
    # normwise over all of them: bfloat16's rounding differs entry by entry
    assert np.linalg.norm(errs1) <= 1.25 * np.linalg.norm(errs2), (
        errs1, errs2)


def test_static_cache_generate():
    ours, theirs = _pair(*DECODERS["llama"], torch.float32)
    ids = torch.randint(0, V, (2, 7), generator=_gen(4))
    kw = dict(max_new_tokens=5, do_sample=False, cache_implementation="static",
              pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), theirs.generate(ids, **kw))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_packed_equals_padded(arch):
    # transformers detects packing only without a cache: use_cache=False
    ours, theirs = _pair(*DECODERS[arch], torch.float64)
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, V, (1, 7), generator=g)
    b = torch.randint(0, V, (1, 9), generator=g)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    y = ours(packed, position_ids=pos, use_cache=False).logits
    _close(y[:, :7], ours(a).logits, 1e-10)
    _close(y[:, 7:], ours(b).logits, 1e-10)
    _close(y, theirs(packed, position_ids=pos, use_cache=False).logits,
           TOL64)
    # the same through flash-attention's keywords
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    y2 = ours(packed, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
              max_length_q=9, max_length_k=9, use_cache=False).logits
    _close(y2, y, 1e-12)


def test_save_and_reload(tmp_path):
    ours, _ = _pair(*DECODERS["llama"], torch.float32)
    ours.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation=NAME)
    assert back.config._attn_implementation == NAME
    ids = torch.randint(0, V, (2, 8), generator=_gen(6))
    _close(back(ids).logits, ours(ids).logits, 1e-6)
    back.set_attn_implementation("eager")
    _close(back(ids).logits, ours(ids).logits, TOL32)
    back.set_attn_implementation(NAME)
    assert back.config._attn_implementation == NAME


def test_bert_padding():
    cfg = lambda: transformers.BertConfig(  # noqa: E731
        vocab_size=V, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64)
    ours, theirs = _pair(cfg, transformers.BertForMaskedLM, torch.float32)
    ids = torch.randint(0, V, (3, 12), generator=_gen(7))
    am = torch.ones_like(ids)
    am[1, 8:] = 0
    am[2, 5:] = 0
    _compare(ours, theirs, lambda m: m(ids, attention_mask=am).logits,
             TOL32, mask=am)


def _seq2seq(make, cls, inputs, dec, am=None):
    ours, theirs = _pair(make, cls, torch.float64)

    def fn(m):
        return m(**inputs, decoder_input_ids=dec).logits
    _compare(ours, theirs, fn, TOL64)
    return ours, theirs


def test_t5_position_bias_and_cross_attention():
    def make():
        return transformers.T5Config(
            vocab_size=V, d_model=32, d_kv=8, num_heads=4, d_ff=48,
            num_layers=2, relative_attention_num_buckets=8,
            decoder_start_token_id=0, pad_token_id=0)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(1, V, (2, 11), generator=g)
    dec = torch.randint(1, V, (2, 6), generator=g)
    ours, theirs = _seq2seq(make, transformers.T5ForConditionalGeneration,
                            {"input_ids": ids}, dec)
    # the relative position bias gets its gradient through the kernel
    rel = [n for n, p in ours.named_parameters()
           if "relative_attention_bias" in n]
    assert rel
    kw = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(ours.generate(ids, **kw), theirs.generate(ids, **kw))


def test_bart():
    def make():
        return transformers.BartConfig(
            vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=48, decoder_ffn_dim=48,
            max_position_embeddings=64)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, V, (2, 10), generator=g)
    dec = torch.randint(3, V, (2, 7), generator=g)
    _seq2seq(make, transformers.BartForConditionalGeneration,
             {"input_ids": ids}, dec)


def test_whisper():
    def make():
        return transformers.WhisperConfig(
            vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=48, decoder_ffn_dim=48, num_mel_bins=8,
            max_source_positions=12, max_target_positions=32,
            decoder_start_token_id=1, pad_token_id=0, eos_token_id=2,
            bos_token_id=1)
    g = torch.Generator().manual_seed(10)
    feats = torch.randn(2, 8, 24, generator=g, dtype=torch.float64)
    dec = torch.randint(3, V, (2, 6), generator=g)
    _seq2seq(make, transformers.WhisperForConditionalGeneration,
             {"input_features": feats}, dec)


def test_refusals():
    ours, _ = _pair(*DECODERS["llama"], torch.float32)
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 3, 8)
    attn = ours.model.layers[0].self_attn
    with pytest.raises(NotImplementedError, match="frobnicate"):
        act.attention_forward(attn, q, k, k, None, frobnicate=1.0)
    # a head mask (gone from transformers 5) would change the result
    with pytest.raises(NotImplementedError, match="head_mask"):
        act.attention_forward(attn, q, k, k, None, head_mask=torch.ones(4))
    with pytest.raises(NotImplementedError, match="s_aux"):
        act.attention_forward(attn, q, k, k, None, s_aux=torch.zeros(3))


def test_masks_stay_structured():
    mu = transformers.masking_utils
    full = torch.ones(2, 10, dtype=torch.bool)
    m = act.mask_forward(2, 10, 10)
    assert (m.causal, m.window, m.key_mask, m.dense) == (True, None, None,
                                                         None)
    # a decoding step against a cache of 9 keys: bottom-right causal
    m = act.mask_forward(2, 1, 10, q_offset=9, attention_mask=full)
    assert m.causal and m.kv_length == 10 and m.key_mask is None
    # a static cache of 16 slots, 10 written: the rest is cut off
    m = act.mask_forward(2, 3, 16, q_offset=7, attention_mask=full)
    assert m.causal and m.kv_length == 10
    # a sliding window of 4: kv > q - 4, i.e. 3 keys to the left
    window = mu.sliding_window_causal_mask_function(4)
    m = act.mask_forward(2, 10, 10, mask_function=window)
    assert m.causal and m.window == (3, None) and m.dense is None
    # padding: a (B, S) key mask
    pad = full.clone()
    pad[0, :3] = False
    m = act.mask_forward(2, 10, 10, attention_mask=pad,
                         mask_function=mu.bidirectional_mask_function)
    assert not m.causal and torch.equal(m.key_mask, pad)
    # a pattern it does not know: dense, and the same as sdpa's
    odd = mu.or_masks(mu.causal_mask_function,
                      lambda b, h, q, kv: kv == 0)
    m = act.mask_forward(2, 10, 10, mask_function=odd)
    ref = mu.sdpa_mask(2, 10, 10, mask_function=odd,
                       allow_is_causal_skip=False)
    assert m.dense is not None and torch.equal(m.dense, ref)


def test_dropout_in_training_is_seeded():
    cfg = _llama()
    cfg.attention_dropout = 0.3
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(
        cfg, attn_implementation=NAME).train()
    ids = torch.randint(0, V, (2, 9), generator=_gen(11))
    torch.manual_seed(1)
    y1 = model(ids).logits
    torch.manual_seed(1)
    y2 = model(ids).logits
    y3 = model(ids).logits
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)
    y1.sum().backward()
    q = model.model.layers[0].self_attn.q_proj.weight.grad
    assert q is not None and bool(q.abs().sum() > 0)
    model.eval()
    assert torch.equal(model(ids).logits, model(ids).logits)


def test_bart_padding_and_cross_attention():
    def make():
        return transformers.BartConfig(
            vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=48, decoder_ffn_dim=48,
            max_position_embeddings=64)
    ours, theirs = _pair(make, transformers.BartForConditionalGeneration,
                         torch.float32)
    ids = torch.randint(3, V, (2, 10), generator=_gen(12))
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    dec = torch.randint(3, V, (2, 7), generator=_gen(13))
    _compare(ours, theirs, lambda m: m(input_ids=ids, attention_mask=am,
                                       decoder_input_ids=dec).logits, TOL32)


def test_gemma2_sdpa_refuses_softcap_ours_runs():
    ours, _ = _pair(*DECODERS["gemma2"], torch.float32)
    ids = torch.randint(0, V, (1, 6), generator=_gen(14))
    assert torch.isfinite(ours(ids).logits).all()
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        ours.set_attn_implementation("sdpa")

"""CompactCache (attention_c.integrations.transformers): a transformers
Cache of bfloat16, float16 or int8 keys and values, contiguous or paged,
read in place by attention_c's backend through attention_c.cache_attention.
Greedy tokens against transformers' sdpa backend, the same cache under
sdpa, buffers that stay where they are between steps (no dense copy), the
memory its dtype says, the Cache protocol (lengths, crop, reset, beam
search) and the refusals.  Tiny random Qwen3 / Llama models, no hub."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attention_c as ac  # noqa: E402
from attention_c.integrations import compact_cache as cc  # noqa: E402
from attention_c.integrations import transformers as act  # noqa: E402

NAME = act.register()
V = 61  # vocabulary
INT8 = hasattr(ac, "quantize_kv")
needs_int8 = pytest.mark.skipif(not INT8, reason="no attention_c.quantize_kv "
                                "(int8 caches) in this build")


def _qwen3(head_dim=8, layers=2):
    return transformers.Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48,
        head_dim=head_dim, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)


def _llama():
    return transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64)


def _mistral():
    return transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, sliding_window=5)


def _pair(make=_qwen3, cls=transformers.Qwen3ForCausalLM,
          dtype=torch.bfloat16, ref="sdpa", seed=0):
    """(ours, reference): the same random weights, two backends."""
    cfg = make()
    torch.manual_seed(seed)
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    theirs = cls._from_config(copy.deepcopy(cfg), attn_implementation=ref)
    theirs.load_state_dict(ours.state_dict())
    return ours.to(dtype).eval(), theirs.to(dtype).eval()


def _ids(seed, shape=(2, 9)):
    # no pad token (0) among them: generate would take it for padding
    return torch.randint(1, V, shape, generator=torch.Generator()
                         .manual_seed(seed))


GREEDY = dict(do_sample=False, pad_token_id=0)


def _no_dense_reads(monkeypatch):
    def refuse(self, t):
        raise AssertionError("a dense copy of the cache was made")
    monkeypatch.setattr(cc.CompactLayer, "_dense", refuse)


LAYOUTS = [None, 4]             # contiguous, paged in blocks of 4
LAYOUT_IDS = ["contiguous", "paged"]


@pytest.mark.parametrize("block_size", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=["bf16", "f16"])
def test_greedy_tokens_equal_sdpa(dtype, block_size, monkeypatch):
    """A 16-bit model generating with a CompactCache of its dtype (read in
    place, never copied): sdpa's tokens with its own DynamicCache.  20
    positions: the contiguous buffer grows once (16 -> 32), the paged
    pool takes blocks as it goes."""
    ours, theirs = _pair(dtype=dtype)
    ids = _ids(1)
    kw = dict(GREEDY, max_new_tokens=12)
    with torch.no_grad():
        want = theirs.generate(ids, **kw)
        cache = act.CompactCache(ours.config, dtype=dtype,
                                 block_size=block_size)
        _no_dense_reads(monkeypatch)
        got = ours.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == 9 + 12 - 1
    layer = cache.layers[0]
    assert layer.written == layer.seq_len == 20
    assert layer.k.dtype == dtype
    if block_size is None:
        assert layer.k.shape == (2, 32, 2, 8)
    else:                       # 5 blocks each, interleaved in the pool
        table = layer.block_table[:, :5]
        assert sorted(table.flatten().tolist()) == list(range(10))
        assert table[0].tolist() == [0, 2, 4, 6, 8]


def test_llama_and_string_dtype():
    ours, theirs = _pair(_llama, transformers.LlamaForCausalLM)
    ids = _ids(2, (3, 7))
    kw = dict(GREEDY, max_new_tokens=6)
    with torch.no_grad():
        cache = act.CompactCache(ours.config, "bfloat16", block_size=3)
        assert torch.equal(ours.generate(ids, past_key_values=cache, **kw),
                           theirs.generate(ids, **kw))
    assert cache.dense_reads == 0


def test_sliding_window_reads_in_place():
    """Mistral's window comes from the mask: the cache keeps every
    position and the kernel sees only the window."""
    ours, theirs = _pair(_mistral, transformers.MistralForCausalLM)
    ids = _ids(3)
    kw = dict(GREEDY, max_new_tokens=6)
    with torch.no_grad():
        cache = act.CompactCache(ours.config, block_size=4)
        assert torch.equal(ours.generate(ids, past_key_values=cache, **kw),
                           theirs.generate(ids, **kw))
    assert cache.dense_reads == 0


@pytest.mark.parametrize("block_size", LAYOUTS, ids=LAYOUT_IDS)
def test_other_backends_read_it_densely(block_size):
    """Under sdpa (or eager) a CompactCache works: update's keys and
    values are read back (a copy each), and the tokens are those of
    transformers' own cache."""
    _, theirs = _pair()
    ids = _ids(4)
    kw = dict(GREEDY, max_new_tokens=5)
    with torch.no_grad():
        want = theirs.generate(ids, **kw)
        cache = act.CompactCache(theirs.config, block_size=block_size)
        assert torch.equal(theirs.generate(ids, past_key_values=cache, **kw),
                           want)
    assert cache.dense_reads == 2 * 2 * 5   # layers x (k, v) x forwards


@pytest.mark.parametrize("block_size", LAYOUTS, ids=LAYOUT_IDS)
def test_buffers_stay_in_place(block_size, monkeypatch):
    """With max_cache_len the buffers are allocated once: every step
    writes its keys and values into them (data_ptr fixed) and the kernel
    reads them there; no dense copy is made (it would raise)."""
    ours, _ = _pair()
    _no_dense_reads(monkeypatch)
    cache = act.CompactCache(ours.config, block_size=block_size,
                             max_cache_len=24)
    ids = _ids(5)
    with torch.no_grad():
        out = ours(ids, past_key_values=cache)
        ptrs = [(la.k.data_ptr(), la.v.data_ptr()) for la in cache.layers]
        before = cache.layers[1].k.clone()
        tok = out.logits[:, -1:].argmax(-1)
        for step in range(4):
            out = ours(tok, past_key_values=cache)
            tok = out.logits[:, -1:].argmax(-1)
            assert [(la.k.data_ptr(), la.v.data_ptr())
                    for la in cache.layers] == ptrs
    assert cache.get_seq_length() == 13
    assert not torch.equal(cache.layers[1].k, before)   # written in place


def test_continued_prefill_is_bottom_right():
    """Prefill in two chunks (Tq > 1 against a cache): the logits of one
    forward over the whole prompt."""
    ours, _ = _pair(dtype=torch.bfloat16)
    ids = _ids(6, (2, 13))
    with torch.no_grad():
        full = ours(ids).logits.float()
        cache = act.CompactCache(ours.config, block_size=4)
        a = ours(ids[:, :6], past_key_values=cache).logits.float()
        b = ours(ids[:, 6:], past_key_values=cache).logits.float()
    assert cache.dense_reads == 0
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=2e-2,
                               rtol=0)


def _gemma2():
    return transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, head_dim=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, sliding_window=5,
        query_pre_attn_scalar=8, attn_logit_softcapping=1.5,
        final_logit_softcapping=30.0)


def _gpt_oss():
    return transformers.GptOssConfig(
        vocab_size=V, hidden_size=32, intermediate_size=32, head_dim=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_softcap_sinks_window_in_place(arch):
    """Gemma 2's softcap and gpt-oss's sinks, with sliding-window layers,
    in place: eager's logits on the same stored values (eager reads the
    cache densely), prefill and three decoding steps, float32."""
    make, cls = {"gemma2": (_gemma2, transformers.Gemma2ForCausalLM),
                 "gpt_oss": (_gpt_oss, transformers.GptOssForCausalLM)}[arch]
    ours, theirs = _pair(make, cls, torch.float32, ref="eager")
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith("sinks"):      # gpt-oss starts them at 0
                p.normal_()
        theirs.load_state_dict(ours.state_dict())
        ids = _ids(15, (2, 8))
        c1 = act.CompactCache(ours.config, block_size=4)
        c2 = act.CompactCache(theirs.config, block_size=4)
        for step in range(4):
            a = ours(ids, past_key_values=c1).logits
            b = theirs(ids, past_key_values=c2).logits
            torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
            ids = b[:, -1:].argmax(-1)
    assert c1.dense_reads == 0 and c2.dense_reads > 0


def test_float32_model_bf16_cache():
    """A float32 model may keep a bfloat16 cache: the same logits as
    transformers' float32 cache to bfloat16's rounding of the keys."""
    ours, theirs = _pair(dtype=torch.float32)
    ids = _ids(7)
    with torch.no_grad():
        cache = act.CompactCache(ours.config)
        got = ours(ids, past_key_values=cache).logits
        want = theirs(ids).logits
    assert cache.dense_reads == 0
    torch.testing.assert_close(got, want, atol=3e-2, rtol=0)


def test_left_padding_read_densely_and_correct():
    """Padding has no in-place form (cache_attention has no key mask):
    the backend reads the cache densely, with the padding mask, and
    generates sdpa's tokens."""
    ours, theirs = _pair()
    ids = _ids(8, (3, 9))
    am = torch.ones_like(ids)
    am[0, :3] = 0
    am[2, :1] = 0
    kw = dict(GREEDY, max_new_tokens=5, attention_mask=am)
    with torch.no_grad():
        cache = act.CompactCache(ours.config, block_size=4)
        got = ours.generate(ids, past_key_values=cache, **kw)
        want = theirs.generate(ids, **kw)
    assert torch.equal(got, want)
    assert cache.dense_reads == 2 * 2 * 5


def test_generate_continues_the_cache():
    ours, _ = _pair()
    ids = _ids(16, (2, 7))
    kw = dict(GREEDY, max_new_tokens=4)
    with torch.no_grad():
        cache = act.CompactCache(ours.config, block_size=4)
        a = ours.generate(ids, past_key_values=cache, **kw)
        b = ours.generate(a, past_key_values=cache, **kw)
        full = ours.generate(ids, **dict(kw, max_new_tokens=8))
    assert torch.equal(b, full)
    assert cache.get_seq_length() == 14 and cache.dense_reads == 0


def test_gradients_read_densely():
    """With gradients recorded the backend reads the cache densely (the
    kernel is inference only): the logits of the in-place path, and the
    gradient reaches the new keys through the stored values."""
    ours, _ = _pair(dtype=torch.float32)
    ids = _ids(17, (2, 7))
    cache = act.CompactCache(ours.config)
    y = ours(ids, past_key_values=cache).logits
    assert cache.dense_reads == 2 * 2
    y.sum().backward()
    assert ours.model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        cache = act.CompactCache(ours.config)
        y2 = ours(ids, past_key_values=cache).logits
    assert cache.dense_reads == 0
    torch.testing.assert_close(y.detach(), y2, atol=1e-5, rtol=0)


def test_beam_search_reorders():
    ours, theirs = _pair()
    ids = _ids(9)
    kw = dict(GREEDY, max_new_tokens=5, num_beams=3)
    with torch.no_grad():
        want = theirs.generate(ids, **kw)
        for bs in LAYOUTS:
            cache = act.CompactCache(ours.config, block_size=bs)
            assert torch.equal(
                ours.generate(ids, past_key_values=cache, **kw), want)
            assert cache.dense_reads == 0


@pytest.mark.parametrize("block_size", LAYOUTS, ids=LAYOUT_IDS)
def test_lengths_crop_reset_select(block_size):
    ours, _ = _pair()
    cache = act.CompactCache(ours.config, block_size=block_size,
                             max_cache_len=20)
    assert cache.get_seq_length() == 0 and cache.nbytes == 0
    ids = _ids(10, (2, 11))
    with torch.no_grad():
        full = ours(ids, past_key_values=cache).logits
    assert cache.get_seq_length() == 11
    assert cache.get_max_length() == 20
    assert cache.get_mask_sizes(1, 0) == (12, 0)
    cache.crop(-4)
    assert cache.get_seq_length() == 7
    with torch.no_grad():            # the cropped positions again
        again = ours(ids[:, 7:], past_key_values=cache).logits
    torch.testing.assert_close(again, full[:, 7:], atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.layers[0].batch_size == 1
    with torch.no_grad():            # sequence 1 alone, its cache kept
        cache.crop(-1)
        one = ours(ids[1:, 10:], past_key_values=cache).logits
    torch.testing.assert_close(one, full[1:, 10:], atol=1e-2, rtol=0)
    cache.reset()
    assert cache.get_seq_length() == 0
    with pytest.raises(ValueError, match="max_cache_len"):
        with torch.no_grad():
            ours(_ids(11, (1, 21)), past_key_values=cache)


def test_memory_is_the_dtype():
    """Bytes of the layer buffers: the dtype's itemsize per element, int8
    one byte plus a float32 scale per group."""
    cfg = _qwen3(head_dim=32)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM._from_config(
        cfg, attn_implementation=NAME).to(torch.bfloat16).eval()
    ids = _ids(12, (2, 5))
    L, B, S, H, d = 2, 2, 32, 2, 32
    kinds = [("bfloat16", 2.0), ("float16", 2.0)]
    if INT8:
        kinds.append(("int8", 1 + 4 / 32))
    for dtype, per in kinds:
        for bs in (None, 8):
            cache = act.CompactCache(cfg, dtype, max_cache_len=S,
                                     block_size=bs)
            with torch.no_grad():
                model(ids, past_key_values=cache)
            assert cache.nbytes == int(L * 2 * B * S * H * d * per)
            assert cache.dense_reads == 0


@needs_int8
@pytest.mark.parametrize("block_size", LAYOUTS, ids=LAYOUT_IDS)
def test_int8_close_to_unquantised(block_size, monkeypatch):
    """int8 keys and values in groups of 32 with float32 scales, read in
    place (dequantize_kv is never called): the logits of a float32 model
    within 2% of their range of those with transformers' own float32
    cache (0.5 to 0.8% seen), and at least 80% of 20 greedy tokens the
    same (all seen)."""
    cfg = lambda: _qwen3(head_dim=32)  # noqa: E731
    ours, theirs = _pair(cfg, dtype=torch.float32)
    ids = _ids(13, (2, 9))

    def refuse(*a, **k):
        raise AssertionError("dequantize_kv called: a dense copy")
    monkeypatch.setattr(ac, "dequantize_kv", refuse)
    with torch.no_grad():
        cache = act.CompactCache(ours.config, "int8",
                                 block_size=block_size)
        got = ours(ids, past_key_values=cache).logits
        want = theirs(ids).logits
        err = (got - want).abs().max().item()
        assert err <= 0.02 * want.abs().max().item(), err
        assert cache.layers[0].k.dtype == torch.int8
        kw = dict(GREEDY, max_new_tokens=10)
        cache = act.CompactCache(ours.config, torch.int8,
                                 block_size=block_size)
        t1 = ours.generate(ids, past_key_values=cache, **kw)[:, 9:]
        t2 = theirs.generate(ids, **kw)[:, 9:]
    assert (t1 == t2).float().mean().item() >= 0.8
    assert cache.dense_reads == 0


@needs_int8
def test_int8_under_sdpa_dequantises():
    """Another backend reads an int8 cache dequantised: our backend's
    tokens on the same stored values."""
    cfg = lambda: _qwen3(head_dim=32)  # noqa: E731
    ours, theirs = _pair(cfg, dtype=torch.float32)
    ids = _ids(14)
    kw = dict(GREEDY, max_new_tokens=6)
    with torch.no_grad():
        c1 = act.CompactCache(ours.config, "int8", group=8)
        c2 = act.CompactCache(theirs.config, "int8", group=8)
        t1 = ours.generate(ids, past_key_values=c1, **kw)
        t2 = theirs.generate(ids, past_key_values=c2, **kw)
    assert torch.equal(t1, t2)
    assert c1.dense_reads == 0 and c2.dense_reads > 0
    # layer 0's keys depend on the tokens only: stored alike
    a, b = c1.layers[0], c2.layers[0]
    assert torch.equal(a.k, b.k) and torch.equal(a.k_scales, b.k_scales)


def test_placeholders_carry_no_data():
    """update() returns (B, Hkv, N, d) placeholders of the model's dtype
    that store nothing; anything but their metadata reads them densely,
    with the values the cache stores."""
    cfg = _qwen3()
    cache = act.CompactCache(cfg, "float16")
    k = torch.randn(2, 2, 5, 8, dtype=torch.float32)
    v = torch.randn(2, 2, 5, 8, dtype=torch.float32)
    pk, pv = cache.update(k, v, 0)
    assert pk.shape == (2, 2, 5, 8) and pk.dtype == torch.float32
    with torch._C.DisableTorchFunctionSubclass():
        assert pk.untyped_storage().nbytes() == 4      # one scalar
    assert cache.layers[0].written == 0                 # still pending
    assert torch.equal(pk + 0, k.half().float())
    assert torch.equal(pv * 1, v.half().float())
    assert cache.layers[0].written == 5
    assert cache.dense_reads == 2


def test_refusals():
    cfg = _qwen3()
    for bad in ("float32", torch.float32, "bf16", None, 8):
        with pytest.raises(ValueError, match="dtype must be"):
            act.CompactCache(cfg, bad)
    with pytest.raises(ValueError, match="group must be >= 8"):
        act.CompactCache(cfg, group=4)
    with pytest.raises(TypeError, match="group must be an int"):
        act.CompactCache(cfg, group=8.0)
    with pytest.raises(TypeError, match="group must be an int"):
        act.CompactCache(cfg, group=True)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        act.CompactCache(cfg, block_size=0)
    with pytest.raises(ValueError, match="max_cache_len must be >= 1"):
        act.CompactCache(cfg, max_cache_len=0)
    if INT8:
        # the head dimension is 8: a group of 16 does not divide it
        with pytest.raises(ValueError, match="group = 16 must divide"):
            act.CompactCache(cfg, "int8", group=16)
    else:
        with pytest.raises(NotImplementedError, match="quantize_kv"):
            act.CompactCache(cfg, "int8", group=8)

"""A pass computed range by range (what a node of a cluster runs: Model.compute over its layers,
with a cache of its layers only) equals the pass through every layer; the cache's prefix, copy
and repeat move every layer's slots."""

import numpy as np

import ds2cli
from ds2cli.model.cache import LatentCache
from ds2cli.model.transformer import Pass, Step
from ds2cli.weights.source import bundled_model_dir


def test_ranges_of_layers_compute_the_whole_pass():
    whole = ds2cli.load(bundled_model_dir())
    L = whole.config.num_hidden_layers
    cuts = [0, 2, 5, L]
    parts = [ds2cli.load(bundled_model_dir(), layers=range(a, b)) for a, b in zip(cuts, cuts[1:])]
    assert parts[1].embed_tokens is None and parts[1].lm_head is None and parts[1].layers[0] is None
    ids = np.array(whole.tokenizer.encode("What is 451 - 123?"))
    ref_cache, caches = whole.new_cache(32), [LatentCache(L, 32, whole.config.kv_lora_rank,
                                                          whole.config.qk_rope_head_dim, layers=range(a, b))
                                              for a, b in zip(cuts, cuts[1:])]
    for chunk in (ids[:5], ids[5:], ids[-1:]):                    # a prefill in two pieces, then a step
        want = whole.forward(chunk, ref_cache, all_logits=True)
        p = Pass.of([chunk], [Step(chunk, caches[0], "all")], None)
        x = None
        for m, c, (a, b) in zip(parts, caches, zip(cuts, cuts[1:])):
            x = m.compute(p.with_caches([c], None), range(a, b), x)
        for c in caches:
            c.length += len(chunk)
        np.testing.assert_allclose(x, want, atol=1e-5)
    for c, (a, b) in zip(caches, zip(cuts, cuts[1:])):
        np.testing.assert_allclose(c.prefix(c.length)[0], ref_cache.prefix(ref_cache.length)[0][a:b], atol=1e-6)


def test_prefix_set_prefix_copy_and_repeat():
    a = LatentCache(3, 8, 4, 2)
    latent, k_pe = np.random.default_rng(0).standard_normal((2, 3, 5, 4)).astype(np.float32)[0], \
        np.random.default_rng(1).standard_normal((3, 5, 2)).astype(np.float32)
    a.set_prefix(latent, k_pe)
    assert a.length == 5
    got = a.prefix(5)
    np.testing.assert_array_equal(got[0], latent) and np.testing.assert_array_equal(got[1], k_pe)
    b = LatentCache(3, 8, 4, 2)
    b.copy_prefix(a, 3)
    assert b.length == 3 and np.array_equal(b.prefix(3)[0], latent[:, :3])
    b.repeat(3, 3)
    assert np.array_equal(b.latent[:, 3:6], latent[:, :3]) and np.array_equal(b.k_pe[:, 3:6], k_pe[:, :3])
    assert b.layer(1)[0].shape == (8, 4)

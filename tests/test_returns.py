"""Tests for diskreplay.episodes.returns against explicit-loop reference implementations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from reference_returns import ref_discount_cumsum, ref_episodic, ref_gae, ref_nstep

from diskreplay.episodes.returns import (
    discount_cumsum,
    episodic_returns,
    gae_advantages,
    normalize_advantages,
    nstep_targets,
    nstep_window,
)


# --------------------------------------------------------------------------- #
# random episode generators
# --------------------------------------------------------------------------- #
def random_lane(rng: np.random.Generator, T: int, p_end: float = 0.2):
    """Episodes of random lengths, ends split between termination and truncation."""
    ends = rng.random(T) < p_end
    kind = rng.random(T) < 0.5
    terminated = ends & kind
    truncated = ends & ~kind
    rewards = rng.normal(size=T)
    return rewards, terminated, truncated


def random_batch(rng: np.random.Generator, T: int, E: int, p_end: float = 0.2):
    ends = rng.random((T, E)) < p_end
    kind = rng.random((T, E)) < 0.5
    return rng.normal(size=(T, E)), ends & kind, ends & ~kind


flags = st.lists(st.sampled_from(["-", "term", "trunc"]), min_size=0, max_size=25)
gammas = st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0])


def lane_from_flags(fl, seed):
    rng = np.random.default_rng(seed)
    T = len(fl)
    terminated = np.array([f == "term" for f in fl], dtype=bool)
    truncated = np.array([f == "trunc" for f in fl], dtype=bool)
    return rng.normal(size=T), terminated, truncated


# --------------------------------------------------------------------------- #
# discount_cumsum
# --------------------------------------------------------------------------- #
def test_discount_cumsum_hand():
    x = [1.0, 1.0, 1.0]
    np.testing.assert_array_equal(discount_cumsum(x, 0.5), [1.75, 1.5, 1.0])
    np.testing.assert_array_equal(discount_cumsum(x, 0.5, [False, True, False]), [1.5, 1.0, 1.0])
    np.testing.assert_array_equal(discount_cumsum(x, 0.0), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(discount_cumsum(x, 1.0), [3.0, 2.0, 1.0])


@pytest.mark.parametrize("seed", range(5))
def test_discount_cumsum_random_1d_and_2d(seed):
    rng = np.random.default_rng(seed)
    T, E = int(rng.integers(1, 60)), 4
    x, term, trunc = random_batch(rng, T, E)
    dones = term | trunc
    out = discount_cumsum(x, 0.9, dones)
    assert out.shape == (T, E) and out.dtype == np.float64
    for e in range(E):
        np.testing.assert_allclose(out[:, e], ref_discount_cumsum(x[:, e], 0.9, dones[:, e]), rtol=1e-12)
        np.testing.assert_array_equal(discount_cumsum(x[:, e], 0.9, dones[:, e]), out[:, e])


@given(fl=flags, gamma=gammas, seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_discount_cumsum_hypothesis(fl, gamma, seed):
    x, term, trunc = lane_from_flags(fl, seed)
    dones = term | trunc
    np.testing.assert_allclose(discount_cumsum(x, gamma, dones), ref_discount_cumsum(x, gamma, dones),
                               rtol=1e-12, atol=1e-12)


def test_discount_cumsum_dtypes():
    assert discount_cumsum(np.ones(3, np.float32), 0.9).dtype == np.float32
    assert discount_cumsum(np.ones(3, np.int64), 0.9).dtype == np.float32
    assert discount_cumsum(np.ones(3, np.float64), 0.9).dtype == np.float64
    assert discount_cumsum(np.zeros(0), 0.9).shape == (0,)
    x = np.ones((4, 2, 3), np.float32)
    out = discount_cumsum(x, 0.5)
    assert out.shape == (4, 2, 3)
    np.testing.assert_array_equal(out[:, 1, 2], [1.875, 1.75, 1.5, 1.0])


# --------------------------------------------------------------------------- #
# gae_advantages
# --------------------------------------------------------------------------- #
R3 = np.array([1.0, 1.0, 1.0])
V3 = np.array([1.0, 2.0, 3.0])
F3 = np.zeros(3, dtype=bool)


def _gae(terminated=F3, truncated=F3, last_terminated=False, next_values=None, lam=0.5):
    return gae_advantages(R3, V3, terminated, truncated, 4.0, last_terminated, 0.5, lam, next_values=next_values)


def test_gae_hand_no_episode_end():
    # deltas: 1+0.5*2-1=1, 1+0.5*3-2=0.5, 1+0.5*4-3=0 ; gamma*lambda=0.25
    adv, ret = _gae()
    np.testing.assert_array_equal(adv, [1.125, 0.5, 0.0])
    np.testing.assert_array_equal(ret, [2.125, 2.5, 3.0])


def test_gae_hand_truncation_without_next_values():
    # truncated at 1: delta[1] = 1 + 0.5*V(s_1) - V(s_1) = 0, chain cut after 1
    adv, ret = _gae(truncated=[False, True, False])
    np.testing.assert_array_equal(adv, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(ret, [2.0, 2.0, 3.0])


def test_gae_hand_truncation_with_next_values():
    # final observation of the truncated episode has value 10
    adv, ret = _gae(truncated=[False, True, False], next_values=[2.0, 10.0, 4.0])
    np.testing.assert_array_equal(adv, [2.0, 4.0, 0.0])
    np.testing.assert_array_equal(ret, [3.0, 6.0, 3.0])


def test_gae_hand_termination_and_last_terminated():
    adv, _ = _gae(terminated=[False, True, False])
    np.testing.assert_array_equal(adv, [0.75, -1.0, 0.0])
    adv, _ = _gae(last_terminated=True)
    np.testing.assert_array_equal(adv, [1.0, 0.0, -2.0])
    adv2, _ = _gae(terminated=[False, False, True])
    np.testing.assert_array_equal(adv, adv2)


def _ref_gae_batch(r, v, term, trunc, last_v, last_t, gamma, lam, nv):
    T, E = r.shape
    out = np.zeros((T, E))
    for e in range(E):
        out[:, e] = ref_gae(r[:, e], v[:, e], term[:, e], trunc[:, e], last_v[e], last_t[e], gamma, lam,
                            None if nv is None else nv[:, e])
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("use_next_values", [False, True])
def test_gae_random_batch(seed, use_next_values):
    rng = np.random.default_rng(seed)
    T, E = int(rng.integers(1, 50)), 5
    r, term, trunc = random_batch(rng, T, E)
    v = rng.normal(size=(T, E))
    last_v = rng.normal(size=E)
    last_t = rng.random(E) < 0.3
    nv = rng.normal(size=(T, E)) if use_next_values else None
    gamma, lam = 0.97, 0.9
    adv, ret = gae_advantages(r, v, term, trunc, last_v, last_t, gamma, lam, next_values=nv)
    want = _ref_gae_batch(r, v, term, trunc, last_v, last_t, gamma, lam, nv)
    assert adv.dtype == np.float64 and adv.shape == (T, E)
    np.testing.assert_allclose(adv, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(ret, want + v, rtol=1e-10, atol=1e-10)
    # 1-D lanes give the same numbers
    for e in range(E):
        a1, _ = gae_advantages(r[:, e], v[:, e], term[:, e], trunc[:, e], last_v[e], last_t[e], gamma, lam,
                               next_values=None if nv is None else nv[:, e])
        np.testing.assert_allclose(a1, adv[:, e], rtol=1e-12, atol=1e-12)


@given(fl=flags, seed=st.integers(0, 2**16), gamma=gammas, lam=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
       use_nv=st.booleans(), last_t=st.booleans())
@settings(max_examples=80, deadline=None)
def test_gae_hypothesis(fl, seed, gamma, lam, use_nv, last_t):
    r, term, trunc = lane_from_flags(fl, seed)
    rng = np.random.default_rng(seed + 1)
    T = len(r)
    v, nv, last_v = rng.normal(size=T), rng.normal(size=T), float(rng.normal())
    adv, ret = gae_advantages(r, v, term, trunc, last_v, last_t, gamma, lam, next_values=nv if use_nv else None)
    want = ref_gae(r, v, term, trunc, last_v, last_t, gamma, lam, nv if use_nv else None)
    np.testing.assert_allclose(adv, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(ret, np.asarray(want) + v, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_gae_lambda_one_equals_bootstrapped_discounted_returns(seed):
    rng = np.random.default_rng(seed)
    T, E, gamma = 40, 3, 0.99
    r = rng.normal(size=(T, E))
    term = rng.random((T, E)) < 0.1
    trunc = np.zeros((T, E), dtype=bool)
    v = rng.normal(size=(T, E))
    last_v = rng.normal(size=E)
    adv, ret = gae_advantages(r, v, term, trunc, last_v, False, gamma, 1.0)
    boot = r.copy()
    boot[-1] += gamma * last_v * (1.0 - term[-1])
    np.testing.assert_allclose(adv + v, discount_cumsum(boot, gamma, term), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(ret, adv + v, rtol=1e-12)


def test_gae_next_values_none_matches_explicit_fallback():
    rng = np.random.default_rng(7)
    T, E = 30, 4
    r, term, trunc = random_batch(rng, T, E, p_end=0.3)
    v, last_v = rng.normal(size=(T, E)), rng.normal(size=E)
    nv = np.concatenate([v[1:], last_v[None]])
    nv = np.where(trunc & ~term, v, nv)
    a_none, _ = gae_advantages(r, v, term, trunc, last_v, None, 0.9, 0.8)
    a_expl, _ = gae_advantages(r, v, term, trunc, None, None, 0.9, 0.8, next_values=nv)
    np.testing.assert_allclose(a_none, a_expl, rtol=1e-12, atol=1e-12)


def test_gae_does_not_cross_episode_boundaries():
    rng = np.random.default_rng(3)
    T = 12
    r, v, nv = rng.normal(size=T), rng.normal(size=T), rng.normal(size=T)
    term = np.zeros(T, bool)
    trunc = np.zeros(T, bool)
    trunc[5] = True
    a, _ = gae_advantages(r, v, term, trunc, None, None, 0.99, 0.95, next_values=nv)
    r2, v2, nv2 = r.copy(), v.copy(), nv.copy()
    r2[6:] += 100.0
    v2[6:] -= 50.0
    nv2[6:] += 7.0
    b, _ = gae_advantages(r2, v2, term, trunc, None, None, 0.99, 0.95, next_values=nv2)
    np.testing.assert_array_equal(a[:6], b[:6])
    # ...but the truncated step bootstraps from next_values[5]
    nv3 = nv.copy()
    nv3[5] += 1.0
    c, _ = gae_advantages(r, v, term, trunc, None, None, 0.99, 0.95, next_values=nv3)
    assert c[5] - a[5] == pytest.approx(0.99)


def test_gae_dtypes_and_empty():
    r = np.ones((4, 2), np.float32)
    adv, ret = gae_advantages(r, r, np.zeros((4, 2)), np.zeros((4, 2)), np.zeros(2, np.float32), None, 0.9, 0.9)
    assert adv.dtype == ret.dtype == np.float32
    adv, ret = gae_advantages(np.zeros((0, 2)), np.zeros((0, 2)), np.zeros((0, 2)), np.zeros((0, 2)),
                              np.zeros(2), np.zeros(2), 0.9, 0.9)
    assert adv.shape == ret.shape == (0, 2)


# --------------------------------------------------------------------------- #
# nstep_targets
# --------------------------------------------------------------------------- #
def test_nstep_hand():
    r = [1.0, 1.0, 1.0]
    f = [False, False, False]
    ret, disc, k = nstep_targets(r, f, f, 2, 0.5)
    np.testing.assert_array_equal(ret, [1.5, 1.5, 1.0])
    np.testing.assert_array_equal(disc, [0.25, 0.25, 0.5])
    np.testing.assert_array_equal(k, [2, 2, 1])
    ret, disc, k = nstep_targets(r, [False, True, False], f, 2, 0.5)
    np.testing.assert_array_equal(ret, [1.5, 1.0, 1.0])
    np.testing.assert_array_equal(disc, [0.0, 0.0, 0.5])
    np.testing.assert_array_equal(k, [2, 1, 1])
    ret, disc, k = nstep_targets(r, f, [False, True, False], 2, 0.5)
    np.testing.assert_array_equal(ret, [1.5, 1.0, 1.0])
    np.testing.assert_array_equal(disc, [0.25, 0.5, 0.5])
    np.testing.assert_array_equal(k, [2, 1, 1])
    ret, disc, k = nstep_targets(r, f, f, 1, 0.5)
    np.testing.assert_array_equal(ret, r)
    np.testing.assert_array_equal(disc, [0.5, 0.5, 0.5])
    np.testing.assert_array_equal(k, [1, 1, 1])
    ret, disc, k = nstep_targets(r, f, f, 10, 0.5)
    np.testing.assert_array_equal(ret, [1.75, 1.5, 1.0])
    np.testing.assert_array_equal(disc, [0.125, 0.25, 0.5])
    np.testing.assert_array_equal(k, [3, 2, 1])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 20])
def test_nstep_random(seed, n):
    rng = np.random.default_rng(seed)
    T = int(rng.integers(1, 80))
    r, term, trunc = random_lane(rng, T, p_end=0.25)
    gamma = 0.97
    ret, disc, k = nstep_targets(r, term, trunc, n, gamma)
    want_r, want_d, want_k = ref_nstep(r, term, trunc, n, gamma)
    assert k.dtype == np.int64 and ret.dtype == disc.dtype == np.float64
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(ret, want_r)
    np.testing.assert_array_equal(disc, want_d)


def test_nstep_discounts_are_pythons_powers_of_gamma():
    """Every discount is exactly Python's ``gamma**k``, under any numpy: numpy 1.26 (the floor)
    computes ``gamma ** np.arange(n)`` with a vectorised power that rounds some an ulp apart."""
    k = np.arange(1, 21)
    for gamma in (0.9, 0.97, 0.99, 0.995):
        _, discounts = nstep_window(np.zeros((20, 20)), k, np.zeros(20, dtype=bool), gamma)
        assert discounts.tolist() == [gamma**i for i in range(1, 21)]


@given(fl=flags, seed=st.integers(0, 2**16), gamma=gammas, n=st.integers(1, 8), f32=st.booleans())
@example(fl=["-", "-", "-"], seed=0, gamma=0.99, n=3, f32=False)  # gamma**3 one ulp off the reference's
@settings(max_examples=100, deadline=None)
def test_nstep_hypothesis(fl, seed, gamma, n, f32):
    r, term, trunc = lane_from_flags(fl, seed)
    if f32:
        r = r.astype(np.float32)
    ret, disc, k = nstep_targets(r, term, trunc, n, gamma)
    want_r, want_d, want_k = ref_nstep(r, term, trunc, n, gamma)
    dt = np.float32 if f32 else np.float64
    assert ret.dtype == disc.dtype == dt
    np.testing.assert_array_equal(k, np.asarray(want_k, dtype=np.int64))
    tol = 1e-6 if f32 else 1e-12  # a few ulps: gamma**k and the reference's running product may round apart
    np.testing.assert_allclose(ret, np.asarray(want_r).astype(dt), rtol=tol, atol=tol)
    np.testing.assert_allclose(disc, np.asarray(want_d).astype(dt), rtol=tol, atol=tol)
    assert np.all((k >= 1) & (k <= n))


def test_nstep_trailing_axes_match_lanes():
    rng = np.random.default_rng(11)
    r, term, trunc = random_batch(rng, 25, 3, p_end=0.3)
    ret, disc, k = nstep_targets(r, term, trunc, 4, 0.9)
    for e in range(3):
        r1, d1, k1 = nstep_targets(r[:, e], term[:, e], trunc[:, e], 4, 0.9)
        np.testing.assert_array_equal(ret[:, e], r1)
        np.testing.assert_array_equal(disc[:, e], d1)
        np.testing.assert_array_equal(k[:, e], k1)


def test_nstep_empty():
    ret, disc, k = nstep_targets(np.zeros(0), np.zeros(0, bool), np.zeros(0, bool), 3, 0.9)
    assert ret.shape == disc.shape == k.shape == (0,)


# --------------------------------------------------------------------------- #
# episodic_returns
# --------------------------------------------------------------------------- #
def test_episodic_hand():
    ret, comp = episodic_returns([1.0, 1.0, 1.0], [False, False, True], 0.5)
    np.testing.assert_array_equal(ret, [1.75, 1.5, 1.0])
    np.testing.assert_array_equal(comp, [True, True, True])
    ret, comp = episodic_returns([1.0, 1.0, 1.0], [False, True, False], 0.5, default_return=-9.0)
    np.testing.assert_array_equal(ret, [1.5, 1.0, -9.0])
    np.testing.assert_array_equal(comp, [True, True, False])
    ret, comp = episodic_returns([3.0, -2.0, 0.5], [False, False, True], 0.5, clip=(-1.0, 1.0))
    np.testing.assert_array_equal(ret, [1.0 - 0.5 + 0.125, -1.0 + 0.25, 0.5])
    ret, comp = episodic_returns([1.0, 1.0], [False, False], 0.5)
    np.testing.assert_array_equal(ret, [0.0, 0.0])
    np.testing.assert_array_equal(comp, [False, False])


@given(fl=flags, seed=st.integers(0, 2**16), gamma=gammas, default=st.sampled_from([0.0, -1.5, 7.0]),
       clip=st.sampled_from([None, (-1.0, 1.0), (0.0, 0.5)]))
@settings(max_examples=80, deadline=None)
def test_episodic_hypothesis(fl, seed, gamma, default, clip):
    r, term, trunc = lane_from_flags(fl, seed)
    r = r * 3.0
    done = term | trunc
    ret, comp = episodic_returns(r, done, gamma, default_return=default, clip=clip)
    want_r, want_c = ref_episodic(r, done, gamma, default, clip)
    assert comp.dtype == bool
    np.testing.assert_array_equal(comp, want_c)
    np.testing.assert_allclose(ret, want_r, rtol=1e-12, atol=1e-12)


def test_episodic_float32():
    ret, _ = episodic_returns(np.ones(4, np.float32), [False, True, False, True], 0.9)
    assert ret.dtype == np.float32


# --------------------------------------------------------------------------- #
# normalize_advantages
# --------------------------------------------------------------------------- #
def test_normalize_advantages():
    rng = np.random.default_rng(0)
    a = (rng.normal(size=(64, 4)) * 5 + 3).astype(np.float32)
    out = normalize_advantages(a)
    assert out.dtype == np.float32 and out.shape == a.shape
    assert abs(float(out.mean())) < 1e-5
    assert float(out.std()) == pytest.approx(1.0, abs=1e-5)
    assert normalize_advantages(a.astype(np.float64)).dtype == np.float64
    np.testing.assert_array_equal(normalize_advantages(np.full(5, 2.0)), np.zeros(5))
    assert normalize_advantages(np.zeros(0)).shape == (0,)
    np.testing.assert_allclose(normalize_advantages([1.0, 3.0]), [-1.0, 1.0], atol=1e-7)
    with pytest.raises(ValueError, match="eps"):
        normalize_advantages(a, eps=-1.0)


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #
def test_shape_errors_name_argument_and_shapes():
    z4, z5, b4 = np.zeros(4), np.zeros(5), np.zeros(4, bool)
    with pytest.raises(ValueError, match=r"dones.*\(5,\).*\(4,\)"):
        discount_cumsum(z4, 0.9, np.zeros(5, bool))
    with pytest.raises(ValueError, match=r"values.*\(5,\).*\(4,\)"):
        gae_advantages(z4, z5, b4, b4, 0.0, False, 0.9, 0.9)
    with pytest.raises(ValueError, match=r"terminated.*\(5,\).*\(4,\)"):
        gae_advantages(z4, z4, np.zeros(5, bool), b4, 0.0, False, 0.9, 0.9)
    with pytest.raises(ValueError, match=r"truncated.*\(5,\).*\(4,\)"):
        gae_advantages(z4, z4, b4, np.zeros(5, bool), 0.0, False, 0.9, 0.9)
    with pytest.raises(ValueError, match=r"next_values.*\(5,\).*\(4,\)"):
        gae_advantages(z4, z4, b4, b4, 0.0, False, 0.9, 0.9, next_values=z5)
    with pytest.raises(ValueError, match=r"last_values.*\(3,\).*\(2,\)"):
        gae_advantages(np.zeros((4, 2)), np.zeros((4, 2)), np.zeros((4, 2)), np.zeros((4, 2)),
                       np.zeros(3), None, 0.9, 0.9)
    with pytest.raises(ValueError, match=r"last_terminated.*\(3,\).*\(2,\)"):
        gae_advantages(np.zeros((4, 2)), np.zeros((4, 2)), np.zeros((4, 2)), np.zeros((4, 2)),
                       np.zeros(2), np.zeros(3, bool), 0.9, 0.9)
    with pytest.raises(ValueError, match="last_values"):
        gae_advantages(z4, z4, b4, b4, None, None, 0.9, 0.9)
    with pytest.raises(ValueError, match=r"terminated.*\(5,\).*\(4,\)"):
        nstep_targets(z4, np.zeros(5, bool), b4, 2, 0.9)
    with pytest.raises(ValueError, match=r"truncated.*\(3,\).*\(4,\)"):
        nstep_targets(z4, b4, np.zeros(3, bool), 2, 0.9)
    with pytest.raises(ValueError, match=r"done.*\(5,\).*\(4,\)"):
        episodic_returns(z4, np.zeros(5, bool), 0.9)
    with pytest.raises(ValueError, match="rewards"):
        nstep_targets(np.float64(1.0), False, False, 2, 0.9)


@pytest.mark.parametrize("gamma", [-0.1, 1.5, float("nan")])
def test_gamma_out_of_range(gamma):
    z, b = np.zeros(3), np.zeros(3, bool)
    val = repr(gamma)
    for call in (
        lambda: discount_cumsum(z, gamma),
        lambda: gae_advantages(z, z, b, b, 0.0, False, gamma, 0.9),
        lambda: nstep_targets(z, b, b, 2, gamma),
        lambda: episodic_returns(z, b, gamma),
    ):
        with pytest.raises(ValueError, match="gamma") as info:
            call()
        assert val in str(info.value)
    with pytest.raises(ValueError, match=r"gae_lambda.*1\.2"):
        gae_advantages(z, z, b, b, 0.0, False, 0.9, 1.2)


@pytest.mark.parametrize("n", [0, -3, 2.5, True])
def test_bad_n(n):
    b = np.zeros(3, bool)
    with pytest.raises(ValueError, match="n must be") as info:
        nstep_targets(np.zeros(3), b, b, n, 0.9)
    assert repr(n) in str(info.value)


def test_bad_clip():
    with pytest.raises(ValueError, match="clip"):
        episodic_returns(np.zeros(3), np.zeros(3, bool), 0.9, clip=(1.0, -1.0))
    with pytest.raises(ValueError, match="clip"):
        episodic_returns(np.zeros(3), np.zeros(3, bool), 0.9, clip=(1.0,))

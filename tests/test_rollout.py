"""RolloutBuffer: GAE against explicit-loop references, minibatch iteration, reset, disk storage."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_returns import ref_discount_cumsum, ref_gae

import diskreplay as dr

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def fields(done_only: bool = False) -> dict[str, dr.Field]:
    out = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
           "value": dr.Field((), "float32"), "log_prob": dr.Field((), "float32")}
    if done_only:
        out["done"] = dr.Field((), "bool")
    else:
        out["terminated"] = dr.Field((), "bool")
        out["truncated"] = dr.Field((), "bool")
    return out


# --------------------------------------------------------------------------- #
# rollout generation
# --------------------------------------------------------------------------- #
def make_rollout(rng, T, E, p_end=0.15, with_trunc=True, done_only=False):
    obs_id = np.arange(T * E, dtype=np.float32).reshape(T, E)
    data = {
        "obs": np.stack([obs_id, rng.normal(size=(T, E)), -obs_id], axis=-1).astype(np.float32),
        "act": rng.integers(0, 5, size=(T, E)).astype(np.int64),
        "reward": rng.normal(size=(T, E)).astype(np.float32),
        "value": rng.normal(size=(T, E)).astype(np.float32),
        "log_prob": -rng.random(size=(T, E)).astype(np.float32),
    }
    ends = rng.random((T, E)) < p_end
    kind = rng.integers(0, 3, size=(T, E))  # 0 terminated, 1 truncated, 2 both
    if done_only:
        data["done"] = ends
    else:
        data["terminated"] = ends & ((kind != 1) | (not with_trunc))
        data["truncated"] = ends & (kind != 0) & with_trunc
    return data


def fill(rb: dr.RolloutBuffer, data: dict) -> None:
    T = data["reward"].shape[0]
    for t in range(T):
        assert not rb.full
        rb.add(**{k: v[t] for k, v in data.items()})
    assert rb.full


def reference(data, last_values, last_dones, gamma, lam, next_values=None):
    T, E = data["reward"].shape
    term = data["done"] if "done" in data else data["terminated"]
    trunc = np.zeros_like(term) if "done" in data else data["truncated"]
    adv = np.zeros((T, E))
    for e in range(E):
        nv = None if next_values is None else next_values[:, e]
        adv[:, e] = ref_gae(data["reward"][:, e], data["value"][:, e], term[:, e], trunc[:, e],
                            last_values[e], last_dones[e], gamma, lam, nv)
    return adv, adv + data["value"].astype(np.float64)


# --------------------------------------------------------------------------- #
# GAE
# --------------------------------------------------------------------------- #
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 24), E=st.sampled_from([1, 3, 4]),
       gamma=st.sampled_from([0.0, 0.9, 0.99, 1.0]), lam=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
       with_trunc=st.booleans(), use_next_values=st.booleans(), done_only=st.booleans())
def test_gae_matches_reference(seed, T, E, gamma, lam, with_trunc, use_next_values, done_only):
    rng = np.random.default_rng(seed)
    data = make_rollout(rng, T, E, with_trunc=with_trunc, done_only=done_only)
    rb = dr.RolloutBuffer(fields(done_only), T, E, cache_bytes=1 << 16)
    fill(rb, data)
    for name, value in rb.rows().items():
        np.testing.assert_array_equal(value, data[name], err_msg=name)
    last_values = rng.normal(size=E).astype(np.float32)
    last_dones = rng.random(E) < 0.3
    next_values = rng.normal(size=(T, E)).astype(np.float32) if use_next_values else None
    rb.compute_returns_and_advantages(last_values, last_dones, gamma=gamma, gae_lambda=lam, next_values=next_values)
    adv, ret = reference(data, last_values, last_dones, gamma, lam, next_values)
    assert rb.advantages.shape == (T, E) and rb.returns.shape == (T, E)
    np.testing.assert_allclose(rb.advantages, adv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rb.returns, ret, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rb.advantages + data["value"], rb.returns, rtol=1e-5, atol=1e-5)
    rb.close()


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 20), E=st.sampled_from([1, 2, 3]),
       gamma=st.sampled_from([0.5, 0.9, 1.0]))
def test_lambda_one_terminal_end_is_discounted_return(seed, T, E, gamma):
    """lambda=1, no truncations, every env terminal after the last step: returns are the plain
    discounted reward-to-go inside each episode (values cancel)."""
    rng = np.random.default_rng(seed)
    data = make_rollout(rng, T, E, with_trunc=False)
    rb = dr.RolloutBuffer(fields(), T, E, cache_bytes=1 << 16)
    fill(rb, data)
    rb.compute_returns_and_advantages(rng.normal(size=E), np.ones(E, bool), gamma=gamma, gae_lambda=1.0)
    dones = data["terminated"].copy()
    dones[-1] = True
    for e in range(E):
        np.testing.assert_allclose(rb.returns[:, e], ref_discount_cumsum(data["reward"][:, e], gamma, dones[:, e]),
                                   rtol=1e-4, atol=1e-4)
    rb.close()


def test_truncation_uses_next_values():
    """Hand-checked: a truncated step bootstraps from next_values; a terminated one does not."""
    T, E = 3, 1
    data = {"obs": np.zeros((T, E, 3), np.float32), "act": np.zeros((T, E), np.int64),
            "reward": np.array([[1.0], [2.0], [3.0]], np.float32),
            "value": np.array([[0.5], [0.25], [1.0]], np.float32),
            "log_prob": np.zeros((T, E), np.float32),
            "terminated": np.array([[False], [False], [True]]), "truncated": np.array([[True], [False], [False]])}
    rb = dr.RolloutBuffer(fields(), T, E, cache_bytes=1 << 16)
    fill(rb, data)
    nv = np.array([[10.0], [7.0], [99.0]], np.float32)
    rb.compute_returns_and_advantages(np.zeros(E), np.zeros(E, bool), gamma=0.5, gae_lambda=0.5, next_values=nv)
    a2 = 3.0 - 1.0  # terminated: no bootstrap
    a1 = 2.0 + 0.5 * 7.0 - 0.25 + 0.25 * a2
    a0 = 1.0 + 0.5 * 10.0 - 0.5  # truncated: bootstraps, chain cut
    np.testing.assert_allclose(rb.advantages[:, 0], [a0, a1, a2], rtol=1e-6)
    # without next_values: the truncated step's own value stands in
    rb.compute_returns_and_advantages(np.zeros(E), np.zeros(E, bool), gamma=0.5, gae_lambda=0.5)
    a1 = 2.0 + 0.5 * 1.0 - 0.25 + 0.25 * a2
    np.testing.assert_allclose(rb.advantages[:, 0], [1.0 + 0.5 * 0.5 - 0.5, a1, a2], rtol=1e-6)
    rb.close()


# --------------------------------------------------------------------------- #
# minibatches
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("storage", ["memory", "disk"])
@pytest.mark.parametrize("T,E,M", [(8, 4, 4), (5, 3, 3), (16, 1, 2), (6, 2, 1)])
def test_minibatches(tmp_path, storage, T, E, M):
    url = os.fspath(tmp_path / "rollout") if storage == "disk" else None
    rng = np.random.default_rng(T * 100 + E)
    data = make_rollout(rng, T, E)
    rb = dr.RolloutBuffer(fields(), T, E, url=url, cache_bytes=1 << 16)
    fill(rb, data)
    last_values = rng.normal(size=E)
    rb.compute_returns_and_advantages(last_values, np.zeros(E, bool), gamma=0.9, gae_lambda=0.8)
    ref_adv, _ = reference(data, last_values, np.zeros(E, bool), 0.9, 0.8)
    np.testing.assert_allclose(rb.advantages, ref_adv, rtol=1e-4, atol=1e-4)
    adv, ret = rb.advantages, rb.returns
    per, epochs = T * E // M, 3

    raw = list(rb.minibatches(M, epochs=epochs, seed=5, normalize=False))
    assert len(raw) == M * epochs
    for epoch in range(epochs):
        seen = []
        for batch in raw[epoch * M:(epoch + 1) * M]:
            assert set(batch) == set(data) | {"advantages", "returns"}
            for name, value in batch.items():
                assert isinstance(value, torch.Tensor), name
                assert value.shape[0] == per, name
                assert value.device.type == "cpu"
            assert batch["obs"].shape == (per, 3)
            ids = batch["obs"][:, 0].numpy().astype(np.int64)  # = t * E + e
            t, e = np.divmod(ids, E)
            seen.extend(ids.tolist())
            for name in data:
                np.testing.assert_array_equal(batch[name].numpy(), data[name][t, e], err_msg=name)
            np.testing.assert_array_equal(batch["advantages"].numpy(), adv[t, e])
            np.testing.assert_array_equal(batch["returns"].numpy(), ret[t, e])
        assert sorted(seen) == list(range(T * E)), f"epoch {epoch}: rows not each exactly once"

    again = list(rb.minibatches(M, epochs=epochs, seed=5, normalize=False))
    for a, b in zip(raw, again):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    other = list(rb.minibatches(M, epochs=epochs, seed=6, normalize=False))
    if T * E > 4:
        assert any(not torch.equal(a["obs"], b["obs"]) for a, b in zip(raw, other))

    normed = list(rb.minibatches(M, epochs=1, seed=5))
    for a, b in zip(normed, raw):
        assert torch.equal(a["obs"], b["obs"])  # same order, only advantages change
        x = b["advantages"].numpy().astype(np.float64)
        want = (x - x.mean()) / (x.std() + 1e-8)
        np.testing.assert_allclose(a["advantages"].numpy(), want, rtol=1e-4, atol=1e-5)
        if per > 1 and x.std() > 1e-3:
            assert abs(float(a["advantages"].mean())) < 1e-5
            assert abs(float(a["advantages"].double().std(unbiased=False)) - 1.0) < 1e-3
        assert torch.equal(a["returns"], b["returns"])
    rb.close()


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_reset_and_second_rollout(tmp_path, storage):
    T, E = 7, 3
    url = os.fspath(tmp_path / "rollout") if storage == "disk" else None
    rb = dr.RolloutBuffer(fields(), T, E, url=url, cache_bytes=1 << 16)
    rng = np.random.default_rng(0)
    for round_ in range(3):
        data = make_rollout(rng, T, E)
        data["obs"][..., 1] = round_
        fill(rb, data)
        with pytest.raises(RuntimeError):
            rb.add(**{k: v[0] for k, v in data.items()})
        for name, value in rb.rows().items():
            np.testing.assert_array_equal(value, data[name], err_msg=f"round {round_} {name}")
        lv, ld = rng.normal(size=E), rng.random(E) < 0.5
        rb.compute_returns_and_advantages(lv, ld, gamma=0.95, gae_lambda=0.9)
        adv, ret = reference(data, lv, ld, 0.95, 0.9)
        np.testing.assert_allclose(rb.advantages, adv, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(rb.returns, ret, rtol=1e-4, atol=1e-4)
        batches = list(rb.minibatches(3, seed=round_, normalize=False))
        assert all((b["obs"][:, 1] == round_).all() for b in batches)
        rb.reset()
        assert not rb.full
        with pytest.raises(RuntimeError):
            next(rb.minibatches(3))
    rb.close()


def test_done_only_fields():
    T, E = 6, 2
    rng = np.random.default_rng(3)
    data = make_rollout(rng, T, E, done_only=True)
    rb = dr.RolloutBuffer(fields(done_only=True), T, E, cache_bytes=1 << 16)
    fill(rb, data)
    lv, ld = rng.normal(size=E), np.zeros(E, bool)
    rb.compute_returns_and_advantages(lv, ld, gamma=0.9, gae_lambda=0.95)
    adv, ret = reference(data, lv, ld, 0.9, 0.95)
    np.testing.assert_allclose(rb.advantages, adv, rtol=1e-4, atol=1e-4)
    rb.close()


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #
def test_errors(tmp_path):
    T, E = 4, 3
    with pytest.raises(ValueError):
        dr.RolloutBuffer({"reward": dr.Field((), "float32")}, T, E)
    no_flags = {k: v for k, v in fields().items() if k not in ("terminated", "truncated")}
    with pytest.raises(ValueError):
        dr.RolloutBuffer(no_flags, T, E)

    rb = dr.RolloutBuffer(fields(), T, E, url=os.fspath(tmp_path / "r"), cache_bytes=1 << 16)
    data = make_rollout(np.random.default_rng(0), T, E)
    fill(rb, data)
    with pytest.raises(RuntimeError):
        next(rb.minibatches(2))  # before compute_returns_and_advantages
    with pytest.raises(RuntimeError):
        rb.add(**{k: v[0] for k, v in data.items()})  # past num_steps
    rb.compute_returns_and_advantages(np.zeros(E), np.zeros(E, bool))
    for bad in (5, 0, 13):
        with pytest.raises(ValueError):
            next(rb.minibatches(bad))
    assert len(list(rb.minibatches(12))) == 12
    rb.close()

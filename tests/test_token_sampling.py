"""Token-budgeted sampling (`ReplayBuffer.sample_tokens`): budgets, draw order, the where= filter,
packed output, resume, and bad arguments."""

import numpy as np
import pytest

import diskreplay as dr
from diskreplay.errors import ClosedError, EmptyBufferError, SchemaError

ROWS = 300


def lengths_of_rows(n=ROWS, seed=1):
    return np.random.default_rng(seed).integers(0, 24, n)


def make(tmp_path, sampler=None, chunk_rows=16, seed=0, lengths=None):
    lengths = lengths_of_rows() if lengths is None else lengths
    buf = dr.ReplayBuffer.create(tmp_path / "buf", {
        "prompt": dr.Field((None,), "int32"),
        "tokens": dr.Field((None,), "int32"),
        "logprobs": dr.Field((None,), "float32", length_of="tokens"),
        "version": dr.Field((), "int64"),
        "reward": dr.Field((), "float32"),
    }, capacity=None, chunk_rows=chunk_rows, sampler=sampler, seed=seed)
    n = len(lengths)
    buf.extend({"prompt": [np.full(2 + i % 3, i, np.int32) for i in range(n)],
                "tokens": [np.full(k, i, np.int32) for i, k in enumerate(lengths)],
                "logprobs": [np.full(k, -i, np.float32) for i, k in enumerate(lengths)],
                "version": np.arange(n) // 10, "reward": np.arange(n, dtype=np.float32)})
    buf.flush()
    return buf, lengths


def prompt_lengths(ids):
    return 2 + ids % 3


def test_budget_is_the_longest_prefix_of_the_draws_that_fits(tmp_path):
    buf, lengths = make(tmp_path)
    for budget in (23, 50, 100, 257):
        batch = buf.sample_tokens(budget, seed=7)
        drawn = buf.sample(64, seed=7)["index"]  # the sampler's first block, drawn with the same seed
        n = len(batch["index"])
        assert batch["index"].tolist() == drawn[:n].tolist()
        used = int(lengths[drawn[:n]].sum())
        assert int(batch["tokens"].lengths.sum()) == used <= budget
        assert used + int(lengths[drawn[n]]) > budget  # the next draw would pass the budget
        assert batch["tokens"].lengths.tolist() == lengths[batch["index"]].tolist()
        assert batch["logprobs"].offsets.tolist() == batch["tokens"].offsets.tolist()
        assert batch["reward"].tolist() == batch["index"].astype(np.float32).tolist()


def test_budget_of_many_blocks_continues_the_same_draw_sequence(tmp_path):
    buf, lengths = make(tmp_path)
    batch = buf.sample_tokens(3000, seed=5)
    n = len(batch["index"])
    assert n > 64  # several blocks
    assert int(lengths[batch["index"]].sum()) <= 3000
    assert int(batch["tokens"].lengths.sum()) == int(lengths[batch["index"]].sum())
    assert batch["index"][:40].tolist() == buf.sample(40, seed=5)["index"].tolist()


def test_several_fields_count_together(tmp_path):
    buf, lengths = make(tmp_path)
    batch = buf.sample_tokens(120, ("prompt", "tokens"), seed=2)
    ids = batch["index"]
    total = lengths[ids] + prompt_lengths(ids)
    assert int(total.sum()) <= 120
    drawn = buf.sample(64, seed=2)["index"]
    assert ids.tolist() == drawn[:len(ids)].tolist()
    nxt = drawn[len(ids)]
    assert int(total.sum() + lengths[nxt] + prompt_lengths(nxt)) > 120


def test_max_rows_caps_the_batch(tmp_path):
    buf, _ = make(tmp_path)
    batch = buf.sample_tokens(10_000, max_rows=7, seed=3)
    assert batch["index"].tolist() == buf.sample(7, seed=3)["index"].tolist()


def test_same_seed_same_batch_and_statistics_of_the_sampler(tmp_path):
    buf, lengths = make(tmp_path)
    a = buf.sample_tokens(400, seed=11)
    b = buf.sample_tokens(400, seed=11)
    assert a["index"].tolist() == b["index"].tolist()
    # over many batches the first rows are uniform draws: every row is drawn, none favoured
    firsts = np.concatenate([buf.sample_tokens(40, max_rows=1, rng=np.random.default_rng(i))["index"]
                             for i in range(3000)])
    counts = np.bincount(firsts, minlength=ROWS)
    assert counts.sum() == 3000
    expected = 3000 / ROWS
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < ROWS + 6 * np.sqrt(2 * ROWS)  # far above the p=1e-6 quantile of chi2(299)


def test_where_keeps_only_rows_in_range(tmp_path):
    buf, lengths = make(tmp_path)
    batch = buf.sample_tokens(60, where={"version": (25, None)}, seed=4)
    assert batch["version"].min() >= 25
    assert int(lengths[batch["index"]].sum()) <= 60
    drawn = buf.sample(64, seed=4)["index"]
    matching = drawn[drawn // 10 >= 25]
    n = len(batch["index"])
    assert batch["index"].tolist() == matching[:n].tolist()  # the matching draws, in order
    both = buf.sample_tokens(500, where={"version": (3, 5), "reward": (None, 45.0)}, seed=4)
    assert set(both["version"].tolist()) <= {3, 4} and both["reward"].max() <= 45.0


def test_where_that_matches_nothing_raises(tmp_path):
    buf, _ = make(tmp_path)
    with pytest.raises(EmptyBufferError, match=r"no row matched where=\{'version': \(100, None\)\} "
                                               r"among 500 rows drawn \(max_draws=500\)"):
        buf.sample_tokens(100, where={"version": (100, None)}, max_draws=500, seed=0)


def test_packed_output_numpy_and_torch(tmp_path):
    buf, lengths = make(tmp_path)
    batch = buf.sample_tokens(200, packed=True, seed=9)
    ids = batch["index"]
    cu = batch["tokens_cu_seqlens"]
    assert cu.dtype == np.int32 and len(cu) == len(ids) + 1 and cu[0] == 0
    assert np.diff(cu).tolist() == lengths[ids].tolist()
    assert batch["tokens"].shape == (int(cu[-1]),)
    assert batch["tokens"].tolist() == np.repeat(ids, lengths[ids]).tolist()
    assert batch["logprobs_cu_seqlens"].tolist() == cu.tolist()
    assert batch["tokens_max_seqlen"] == int(lengths[ids].max())
    torch = pytest.importorskip("torch")
    tensors = buf.sample_tokens(200, packed=True, seed=9, format="torch")
    assert tensors["tokens_cu_seqlens"].dtype == torch.int32
    assert tensors["tokens_cu_seqlens"].tolist() == cu.tolist()
    assert tensors["tokens"].tolist() == batch["tokens"].tolist()


def test_prioritized_keeps_weights_of_the_kept_rows(tmp_path):
    buf, lengths = make(tmp_path, sampler=dr.Prioritized())
    buf.update_priorities(np.arange(ROWS), np.arange(ROWS, dtype=np.float32))
    batch = buf.sample_tokens(150, seed=6, beta=0.5)
    ref = buf.sample(64, seed=6, beta=0.5)
    n = len(batch["index"])
    assert batch["index"].tolist() == ref["index"][:n].tolist()
    assert batch["weight"].tolist() == ref["weight"][:n].tolist()


def test_resume_exact_with_state_dict_and_reopen(tmp_path):
    buf, _ = make(tmp_path)
    buf.sample_tokens(300)
    state = buf.state_dict()
    after = [buf.sample_tokens(300, where={"version": (10, None)})["index"].tolist() for _ in range(3)]
    buf.load_state_dict(state)
    assert [buf.sample_tokens(300, where={"version": (10, None)})["index"].tolist() for _ in range(3)] == after
    buf.load_state_dict(state)
    buf.flush()  # the generator's state is committed
    buf.close()
    reopened = dr.ReplayBuffer.open(tmp_path / "buf", "r")
    assert [reopened.sample_tokens(300, where={"version": (10, None)})["index"].tolist()
            for _ in range(3)] == after


def test_reader_follows_a_ring_writer(tmp_path):
    buf = dr.ReplayBuffer.create(tmp_path / "ring", {"tokens": dr.Field((None,), "int32"),
                                                     "version": dr.Field((), "int64")},
                                 capacity=64, chunk_rows=8)
    reader = None
    for v in range(20):
        buf.extend({"tokens": [np.full(1 + (v + i) % 5, v, np.int32) for i in range(8)], "version": np.full(8, v)})
        buf.flush()
        reader = reader or dr.ReplayBuffer.open(tmp_path / "ring", "r")
        reader.refresh()
        batch = reader.sample_tokens(40, where={"version": (v - 2, None)}, seed=v)
        assert batch["version"].min() >= v - 2
        assert all((row == ver).all() for row, ver in zip(batch["tokens"], batch["version"]))
        assert int(batch["tokens"].lengths.sum()) <= 40


def test_a_row_longer_than_the_budget_raises(tmp_path):
    buf, lengths = make(tmp_path, lengths=np.full(20, 30))
    with pytest.raises(ValueError, match=r"row \d+ holds 30 values of \['tokens'\], more than max_tokens=29: "
                                         r"the budget must hold the longest row"):
        buf.sample_tokens(29, seed=0)
    assert len(buf.sample_tokens(30, seed=0)["index"]) == 1


def test_zero_length_rows_end_at_max_rows(tmp_path):
    buf, _ = make(tmp_path, lengths=np.zeros(50, np.int64))
    batch = buf.sample_tokens(5, seed=0)
    assert len(batch["index"]) == 5 and batch["tokens"].values.size == 0


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"lengths_of": "reward"}, SchemaError, r"lengths_of: field 'reward' is not ragged \(shape \(\)\)"),
    ({"lengths_of": "nope"}, SchemaError, r"lengths_of: 'nope' is not a field; the buffer has \['prompt'"),
    ({"lengths_of": ()}, ValueError, r"lengths_of: expected the name of a ragged field"),
    ({"max_tokens": 0}, ValueError, r"max_tokens must be an int >= 1, got 0"),
    ({"max_tokens": 1.5}, ValueError, r"max_tokens must be an int >= 1, got 1.5"),
    ({"max_rows": 0}, ValueError, r"max_rows must be an int >= 1, got 0"),
    ({"max_draws": -1}, ValueError, r"max_draws must be an int >= 1, got -1"),
    ({"where": {"tokens": (0, 1)}}, SchemaError, r"where: field 'tokens' is not a scalar number .* it is ragged"),
    ({"where": {"nope": (0, 1)}}, SchemaError, r"where: 'nope' is not a field"),
    ({"where": {"version": 3}}, ValueError, r"where\['version'\]: expected \(low, high\)"),
    ({"where": {"version": (5, 2)}}, ValueError, r"where\['version'\]: low 5 is above high 2"),
    ({"where": {"version": (float("nan"), 2)}}, ValueError, r"bounds must be numbers or None, got nan"),
    ({"packed": True, "format": "tensordict"}, ValueError, r"packed=True .* TensorDict"),
    ({"format": "jax"}, ValueError, r"format must be one of"),
    ({"beta": 0.5}, ValueError, r"Uniform takes no sampling option 'beta'"),
])
def test_bad_arguments_raise_before_drawing(tmp_path, kwargs, error, message):
    buf, _ = make(tmp_path)
    before = buf.rng.bit_generator.state
    args = {"max_tokens": 100, **kwargs}
    with pytest.raises(error, match=message):
        buf.sample_tokens(**args)
    assert buf.rng.bit_generator.state == before


def test_empty_and_closed(tmp_path):
    buf = dr.ReplayBuffer.create(tmp_path / "e", {"tokens": dr.Field((None,), "int32")}, capacity=None)
    with pytest.raises(EmptyBufferError, match="cannot sample from an empty buffer"):
        buf.sample_tokens(10)
    buf.close()
    with pytest.raises(ClosedError, match="is closed"):
        buf.sample_tokens(10)


def test_sharded_learner_samples_tokens_of_every_shard(tmp_path):
    url = str(tmp_path / "sharded")
    fields = {"tokens": dr.Field((None,), "int32"), "version": dr.Field((), "int64")}
    dr.ReplayBuffer.create(url, fields, capacity=64, shards=2, chunk_rows=4).close()
    for shard in range(2):
        with dr.ReplayBuffer.open_shard(url, shard, "r+") as writer:
            for step in range(12):
                writer.add(tokens=np.full(1 + step % 5, 100 * shard + step, np.int32), version=step)
    learner = dr.ReplayBuffer.open(url, "r", seed=0)
    batch = learner.sample_tokens(60, where={"version": (6, None)}, seed=1)
    shards, _, steps = learner.locate(batch["index"])
    assert set(shards.tolist()) == {0, 1}
    assert batch["version"].min() >= 6 and int(batch["tokens"].lengths.sum()) <= 60
    for row, shard, step in zip(batch["tokens"], shards, steps):
        assert row.tolist() == [100 * shard + step] * (1 + step % 5)


def test_tampered_ends_are_refused_before_any_value_is_read(tmp_path):
    zarr = pytest.importorskip("zarr")
    url = str(tmp_path / "t")
    with dr.ReplayBuffer.create(url, {"tokens": dr.Field((None,), "int32")}, capacity=None, chunk_rows=4) as buf:
        buf.extend({"tokens": [np.arange(1 + i % 3, dtype=np.int32) for i in range(8)]})
    ends = zarr.open_array(url + "/tokens.ends", mode="r+")
    ends[0, :] = [1, 3, 2, 4, 1, 3, 6, 7]  # row 2 of chunk 0 starts at 3 and ends at 2
    reader = dr.ReplayBuffer.open(url)
    with pytest.raises(dr.CorruptBufferError, match=r"ragged field 'tokens': row chunk 0 of lane 0 has values "
                                                    r"\[3, 2\): ends that do not add up"):
        reader.sample_tokens(100, max_rows=8, seed=0)

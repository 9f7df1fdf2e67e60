"""`dr.Mixture`: batches from several buffers in exact proportions, each source sampled by its own
sampler, priorities routed back by source, exact resume, and a torch dataset over a mixture."""

from __future__ import annotations

import numpy as np
import pytest
from s3server import s3  # the moto S3 server fixture
from scipy.stats import chisquare

import diskreplay as dr

pytestmark = pytest.mark.usefixtures("no_fsync")

FIELDS = {"obs": dr.Field((3,), "float32"), "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
          "done": dr.Field((), "bool")}


def steps(n: int, offset: float, episode: int = 10) -> dict[str, np.ndarray]:
    """``n`` steps whose obs say which source and row they are (``offset + row``)."""
    rows = np.arange(n)
    return {"obs": np.repeat((offset + rows)[:, None], 3, axis=1).astype(np.float32), "action": rows % 4,
            "reward": (offset + rows).astype(np.float32), "done": rows % episode == episode - 1}


def make(path, n: int, offset: float, **create) -> dr.ReplayBuffer:
    buf = dr.ReplayBuffer.create(path, FIELDS, chunk_rows=16, **create)
    buf.extend(steps(n, offset))
    buf.flush()
    return buf


@pytest.fixture
def pair(tmp_path):
    """An offline dataset of 200 rows (obs 0..199) and an online ring of 120 rows (obs 1000...)."""
    offline = make(tmp_path / "offline", 200, 0.0, seed=0)
    online = make(tmp_path / "online", 150, 1000.0, capacity=120, seed=0, sampler=dr.Prioritized(alpha=0.6))
    yield offline, online
    offline.close()
    online.close()


# ---- proportions ------------------------------------------------------------------------------

@pytest.mark.parametrize("weights, batch_size, expected", [
    ({"offline": 0.5, "online": 0.5}, 256, [128, 128]),
    ({"offline": 0.5, "online": 0.5}, 5, [3, 2]),  # a tie: the first source takes the row left
    ({"offline": 0.25, "online": 0.75}, 7, [2, 5]),  # 1.75 / 5.25: the larger remainder
    ({"offline": 1, "online": 2}, 10, [3, 7]),  # 3.33 / 6.67
    ({"offline": 0.9, "online": 0.1}, 3, [3, 0]),  # 2.7 / 0.3
    ({"offline": 0, "online": 1}, 9, [0, 9]),
])
def test_every_batch_holds_exactly_the_rows_of_each_source(pair, weights, batch_size, expected):
    mix = dr.Mixture(dict(zip(("offline", "online"), pair)), weights=weights, seed=0)
    assert list(mix.counts(batch_size).values()) == expected
    for _ in range(5):
        batch = mix.sample(batch_size)
        assert np.bincount(batch["source"], minlength=2).tolist() == expected
        assert batch["source"].dtype == np.uint8
        assert (np.diff(batch["source"].astype(int)) >= 0).all()  # source by source, in order
        offline = batch["source"] == 0
        assert (batch["reward"][offline] < 1000).all() and (batch["reward"][~offline] >= 1000).all()
        np.testing.assert_array_equal(batch["obs"][:, 0], batch["reward"])


def test_three_sources_split_the_remainder_by_largest_fraction_then_order(tmp_path, pair):
    third = make(tmp_path / "third", 50, 5000.0)
    mix = dr.Mixture({"a": pair[0], "b": pair[1], "c": third}, seed=0)  # equal weights
    assert [list(mix.counts(b).values()) for b in (10, 11, 12, 1)] == [[4, 3, 3], [4, 4, 3], [4, 4, 4], [1, 0, 0]]
    assert np.bincount(mix.sample(11)["source"]).tolist() == [4, 4, 3]
    third.close()


# ---- each source is sampled by its own sampler -------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"n_step": 3, "gamma": 0.9}, {"seq_len": 4}, {"seq_len": 4, "pad": True},
                                     {"stack": 2}, {"beta": 0.5}])
def test_each_part_is_what_its_source_draws_with_the_same_generator(pair, options):
    offline, online = pair
    mix = dr.Mixture({"offline": offline, "online": online}, weights={"offline": 1, "online": 3})
    batch = mix.sample(10, rng=np.random.default_rng(7), **options)
    rng = np.random.default_rng(7)  # the sources draw in turn from the mixture's generator
    offline_options = {k: v for k, v in options.items() if k != "beta"}  # a uniform sampler takes no beta
    parts = [offline.sample(3, rng=rng, **offline_options), online.sample(7, rng=rng, **options)]
    assert set(batch) == set(parts[1]) | {"source"}
    for name, value in batch.items():
        if name == "source":
            continue
        first = parts[0].get(name, np.ones(3, np.float32))  # a uniform source's rows weigh 1
        np.testing.assert_array_equal(value, np.concatenate([first, parts[1][name]]), err_msg=name)


def test_rows_of_each_source_follow_that_sources_sampler_chi_square(tmp_path):
    offline = make(tmp_path / "offline", 20, 0.0)
    online = make(tmp_path / "online", 10, 100.0, sampler=dr.Prioritized(alpha=1.0, eps=0.0))
    online.update_priorities(np.arange(10), np.arange(1, 11, dtype=np.float64))  # P(i) = (i + 1) / 55
    mix = dr.Mixture({"offline": offline, "online": online}, seed=1)
    counts = {0: np.zeros(20), 1: np.zeros(10)}
    for _ in range(400):
        batch = mix.sample(50)
        for code, seen in counts.items():
            seen += np.bincount(batch["index"][batch["source"] == code], minlength=len(seen))
    assert counts[0].sum() == counts[1].sum() == 400 * 25
    uniform = np.full(20, 400 * 25 / 20)
    prioritized = 400 * 25 * np.arange(1, 11) / 55
    assert chisquare(counts[0], uniform).pvalue > 0.001
    assert chisquare(counts[1], prioritized).pvalue > 0.001
    assert chisquare(counts[1], np.full(10, 1000.0)).pvalue < 1e-9  # the test can tell the two apart
    offline.close()
    online.close()


def test_mapped_and_selected_fields(tmp_path):
    offline = make(tmp_path / "offline", 40, 0.0)
    other = {"observation": FIELDS["obs"], "action": FIELDS["action"], "reward": FIELDS["reward"],
             "done": FIELDS["done"], "info": dr.Field((), "float32")}
    online = dr.ReplayBuffer.create(tmp_path / "online", other, chunk_rows=16)
    data = steps(30, 1000.0)
    online.extend({"observation": data["obs"], "action": data["action"], "reward": data["reward"],
                   "done": data["done"], "info": np.zeros(30, np.float32)})
    with pytest.raises(dr.SchemaError, match=r"source 'online' has no field 'obs' \(its fields: \['action', 'done', "
                                             r"'info', 'observation', 'reward'\]\); map one to it"):
        dr.Mixture({"offline": offline, "online": online})
    with pytest.raises(dr.SchemaError, match=r"source 'online' has field\(s\) \['info'\] that source 'offline' "
                                             r"lacks"):
        dr.Mixture({"offline": offline, "online": online}, fields={"online": {"obs": "observation"}})
    mix = dr.Mixture({"offline": offline, "online": online}, fields={"online": {"obs": "observation"}},
                     select=("obs", "reward", "done"), seed=0)
    assert list(mix.fields) == ["obs", "reward", "done"]
    batch = mix.sample(8, stack=2)  # stack_fields=("obs",) is the online source's "observation"
    assert sorted(batch) == ["done", "index", "obs", "reward", "source"]
    assert batch["obs"].shape == (8, 2, 3)
    np.testing.assert_array_equal(batch["obs"][:, -1, 0], batch["reward"])
    offline.close()
    online.close()


def test_out_arrays_are_filled_source_by_source(pair):
    mix = dr.Mixture(dict(zip(("offline", "online"), pair)), seed=3)
    out = {"obs": np.empty((9, 3), np.float32), "index": np.empty(9, np.int64), "source": np.empty(9, np.uint8),
           "weight": np.empty(9, np.float32)}
    batch = mix.sample(9, out=out)
    expected = dr.Mixture(dict(zip(("offline", "online"), pair)), seed=3).sample(9)
    for name, array in out.items():
        assert batch[name] is array
        np.testing.assert_array_equal(array, expected[name])
    with pytest.raises(ValueError, match=r"out\['obs'\]: expected an array of 9 rows, got shape \(8, 3\)"):
        mix.sample(9, out={"obs": np.empty((8, 3), np.float32)})


# ---- priorities -----------------------------------------------------------------------------------

def test_update_priorities_routes_each_row_to_its_source_bit_exact(tmp_path):
    made = {name: make(tmp_path / name, 64, 0.0, seed=0, sampler=dr.Prioritized(alpha=0.7, eps=1e-3))
            for name in ("a", "b", "ref_a", "ref_b")}
    plain = make(tmp_path / "plain", 64, 0.0)
    mix = dr.Mixture({"a": made["a"], "b": made["b"], "plain": plain}, weights={"a": 2, "b": 1, "plain": 1}, seed=5)
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = mix.sample(32)
        td = rng.standard_normal(32)
        assert mix.update_priorities(batch, td) == 24  # the 8 rows of "plain" have no priorities
        for code, ref in ((0, made["ref_a"]), (1, made["ref_b"])):
            rows = batch["source"] == code
            ref.update_priorities(batch["index"][rows], td[rows])
    for name in ("a", "b"):
        ours, theirs = made[name].sampler.state_dict(), made[f"ref_{name}"].sampler.state_dict()
        assert ours["leaves"].tobytes() == theirs["leaves"].tobytes()
        assert ours["max_priority"] == theirs["max_priority"]
    assert not np.array_equal(made["a"].sampler.state_dict()["leaves"], made["b"].sampler.state_dict()["leaves"])
    slices = mix.sample(8, seq_len=4)  # a slice's priority is its first row's
    assert mix.update_priorities(slices, np.ones(8)) == 6
    for buf in [*made.values(), plain]:
        buf.close()


def test_update_priorities_errors(pair, tmp_path):
    mix = dr.Mixture(dict(zip(("offline", "online"), pair)), seed=0)
    batch = mix.sample(4)
    with pytest.raises(ValueError, match=r"update_priorities: 3 TD errors for a batch of 4 rows"):
        mix.update_priorities(batch, np.ones(3))
    with pytest.raises(ValueError, match=r"expected a batch of Mixture.sample \(with 'source' and 'index'\)"):
        mix.update_priorities({"index": batch["index"]}, np.ones(4))
    with pytest.raises(ValueError, match=r"source numbers must be in \[0, 2\)"):
        mix.update_priorities({**batch, "source": np.full(4, 2, np.uint8)}, np.ones(4))
    with pytest.raises(ValueError, match=r"no source's sampler takes the sampling option 'alpha' \(offline: Uniform, "
                                         r"online: Prioritized\)"):
        mix.sample(4, alpha=0.5)
    plain = dr.Mixture({"offline": pair[0]})
    with pytest.raises(TypeError, match=r"no source of the mixture has one \(offline: Uniform\)"):
        plain.update_priorities(plain.sample(2), np.ones(2))


# ---- resume -----------------------------------------------------------------------------------

def test_state_dict_resumes_exactly_also_reopened(tmp_path):
    def sources(mode=None):
        if mode is None:
            return {"offline": make(tmp_path / "offline", 100, 0.0, sampler=dr.WithoutReplacement()),
                    "online": make(tmp_path / "online", 90, 1000.0, capacity=80, sampler=dr.Prioritized())}
        return {name: dr.ReplayBuffer.open(tmp_path / name, mode) for name in ("offline", "online")}

    def run(mix, calls):
        out = []
        for i in range(calls):
            batch = mix.sample(16, n_step=2) if i % 2 else mix.sample(16)
            mix.update_priorities(batch, (batch["index"] % 7).astype(np.float64))
            out.append(batch)
        return out

    first = dr.Mixture(sources(), seed=11)
    twin = dr.Mixture(sources("r"), seed=11)  # the same seed and calls: the same batches
    for a, b in zip(run(first, 4), run(twin, 4)):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    state = first.state_dict()
    golden = run(first, 6)
    first.load_state_dict(state)
    again = run(first, 6)
    reopened = dr.Mixture(sources("r"), seed=99)
    reopened.load_state_dict(state)
    resumed = run(reopened, 6)
    for batches in (again, resumed):
        for a, b in zip(golden, batches):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    for mix in (first, twin, reopened):
        mix.close()


def test_golden_batches(pair):
    """The batches a seed gives, pinned: a change to how a mixture draws shows here."""
    mix = dr.Mixture(dict(zip(("offline", "online"), pair)), weights={"offline": 1, "online": 2}, seed=2026)
    for index in ([170, 35, 139, 44, 71, 100], [166, 158, 147, 35, 79, 98]):
        batch = mix.sample(6)
        assert (batch["index"].tolist(), batch["source"].tolist()) == (index, [0, 0, 1, 1, 1, 1])
    batch = mix.sample(4, n_step=3)
    assert batch["index"].tolist() == [33, 36, 65, 110]
    np.testing.assert_allclose(batch["reward"], [100.9635, 3079.9739, 3166.1067, 3299.7612], rtol=1e-6)


def test_load_state_dict_is_all_or_nothing(pair, tmp_path):
    mix = dr.Mixture(dict(zip(("offline", "online"), pair)), seed=0)
    state = mix.state_dict()
    mix.sample(8)
    now = mix.state_dict()
    bad = {**state, "sources": {**state["sources"], "online": {**state["sources"]["online"], "total": [1]}}}
    with pytest.raises(ValueError, match=r"state is for a buffer with \[1\] steps per lane; this buffer has \[150\]"):
        mix.load_state_dict(bad)
    after = mix.state_dict()
    assert after["rng"] == now["rng"]
    assert after["sources"]["offline"]["rng"] == now["sources"]["offline"]["rng"]
    with pytest.raises(ValueError, match=r"state is of a mixture of \['offline'\], this one mixes \['offline', "
                                         r"'online'\]"):
        mix.load_state_dict({"rng": state["rng"], "sources": {"offline": state["sources"]["offline"]}})


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("weights, message", [
    ({"offline": 1, "online": 1, "replay": 1}, r"weights: unknown source\(s\) \['replay'\], missing source\(s\) \[\]"),
    ({"offline": 1}, r"weights: unknown source\(s\) \[\], missing source\(s\) \['online'\]"),
    ({"offline": 0, "online": 0.0}, r"weights must add up to a positive total, got \{'offline': 0.0, 'online': 0.0\}"),
    ({"offline": -1, "online": 2}, r"weights\['offline'\] must be a finite number >= 0, got -1"),
    ({"offline": float("nan"), "online": 2}, r"weights\['offline'\] must be a finite number >= 0, got nan"),
])
def test_bad_weights(pair, weights, message):
    with pytest.raises(ValueError, match=message):
        dr.Mixture(dict(zip(("offline", "online"), pair)), weights=weights)


def test_bad_sources_and_fields(pair, tmp_path):
    offline, online = pair
    with pytest.raises(ValueError, match=r"fields: unknown source\(s\) \['replay'\]"):
        dr.Mixture({"offline": offline}, fields={"replay": {"obs": "o"}})
    with pytest.raises(dr.SchemaError, match=r"fields\['online'\]: maps 'obs' to 'observation', which is not a "
                                             r"field of source 'online'"):
        dr.Mixture({"offline": offline, "online": online}, fields={"online": {"obs": "observation"}})
    wide = dr.ReplayBuffer.create(tmp_path / "wide", {**FIELDS, "obs": dr.Field((4,), "float32")})
    with pytest.raises(dr.SchemaError, match=r"field 'obs': source 'wide' stores shape \(4,\) float32, an earlier "
                                             r"source \(e.g. 'offline'\) shape \(3,\) float32"):
        dr.Mixture({"offline": offline, "wide": wide})
    named = dr.ReplayBuffer.create(tmp_path / "named", {"source": dr.Field((), "int64")})
    with pytest.raises(dr.SchemaError, match=r"a field named 'source' collides with the mixture's source column"):
        dr.Mixture({"named": named})
    with pytest.raises(ValueError, match=r"sources: expected str -> ReplayBuffer, got 'x' -> str"):
        dr.Mixture({"x": "buffer"})  # type: ignore[dict-item]
    empty = dr.ReplayBuffer.create(tmp_path / "empty", FIELDS)
    with pytest.raises(dr.EmptyBufferError, match=r"source 'empty' of the mixture: cannot sample from an empty"):
        dr.Mixture({"offline": offline, "empty": empty}).sample(4)
    for buf in (wide, named, empty):
        buf.close()


class Tagged(dr.Uniform):
    """A sampler of one's own that adds an array to its batches."""

    def sample(self, rng, batch_size, lo, hi, recent_rows=None):
        draw = super().sample(rng, batch_size, lo, hi, recent_rows)
        return dr.Draw(draw.lane, draw.step, extra={"tag": np.ones(batch_size)})


def test_sources_whose_batches_differ_are_refused(pair, tmp_path):
    tagged = make(tmp_path / "tagged", 20, 0.0, sampler=Tagged())
    with pytest.raises(ValueError, match=r"the sources' batches differ: source 'offline' gave \['action', 'done', "
                                         r"'index', 'obs', 'reward'\], source 'tagged' \['action', 'done', 'index', "
                                         r"'obs', 'reward', 'tag'\]"):
        dr.Mixture({"offline": pair[0], "tagged": tagged}).sample(4)
    assert sorted(dr.Mixture({"tagged": tagged}).sample(4)) == ["action", "done", "index", "obs", "reward",
                                                                "source", "tag"]
    tagged.close()


# ---- remote, sharded and live sources ---------------------------------------------------------

def test_s3_offline_and_a_live_sharded_online_source(tmp_path, s3):
    so = s3.storage_options()
    url = s3.new_url("offline")
    with dr.ReplayBuffer.create(url, FIELDS, chunk_rows=16, storage_options=so) as writer:
        writer.extend(steps(64, 0.0))
    online_url = str(tmp_path / "online")
    dr.ReplayBuffer.create(online_url, FIELDS, capacity=64, shards=2, chunk_rows=16).close()
    actors = [dr.ReplayBuffer.open_shard(online_url, shard) for shard in range(2)]
    actors[0].extend(steps(20, 1000.0))
    actors[0].flush()
    offline = dr.ReplayBuffer.open(url, "r", storage_options=so)
    learner = dr.ReplayBuffer.open(online_url, "r", seed=0, sampler=dr.Prioritized())  # the learner's own
    mix = dr.Mixture({"offline": offline, "online": learner}, seed=0)
    batch = mix.sample(40)
    online_rows = batch["reward"][batch["source"] == 1]
    assert len(online_rows) == 20 and (online_rows < 1020).all()
    actors[1].extend(steps(20, 2000.0))
    actors[1].flush()
    assert mix.sample(400)["reward"].max() < 2000  # not adopted yet
    assert mix.refresh() is True and mix.refresh() is False
    assert (mix.sample(400)["reward"] >= 2000).any()
    pytest.importorskip("torch")  # each reader opens the sources: S3 with their storage options, the learner's sampler
    dataset = mix.as_dataset(8, seed=0, sampler={"online": dr.Prioritized()})
    batch = next(iter(dataset))
    expected = mix.sample(8, rng=np.random.default_rng([0, 0, 0]))
    for name, value in expected.items():
        np.testing.assert_array_equal(batch[name].numpy(), value, err_msg=name)
    for buf in [*actors, offline, learner]:
        buf.close()


def test_a_writer_source_is_sampled_as_rows_are_added(pair):
    offline, online = pair
    mix = dr.Mixture({"offline": offline, "online": online}, seed=0)
    online.extend(steps(120, 3000.0))  # not flushed: the writer samples its staged rows
    assert (mix.sample(64)["reward"][32:] >= 3000).all()  # the ring holds only these now


# ---- torch --------------------------------------------------------------------------------------

def test_dataset_over_a_mixture_matches_the_mixture_with_two_workers(pair):
    torch = pytest.importorskip("torch")
    mix = dr.Mixture(dict(zip(("offline", "online"), pair)), weights={"offline": 1, "online": 2}, seed=0)
    dataset = mix.as_dataset(12, seed=4, sample_options={"beta": 0.5})
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    got = [batch for _, batch in zip(range(6), loader)]
    for b, batch in enumerate(got):
        expected = mix.sample(12, rng=np.random.default_rng([4, 0, b]), beta=0.5)
        assert sorted(batch) == sorted(expected)
        for name, value in expected.items():
            np.testing.assert_array_equal(batch[name].numpy(), value, err_msg=f"batch {b} {name}")
    dataset.load_state_dict({"mode": "sample", "seed": 4, "batch": 3, "rank": 0, "world_size": 1,
                             "worker": 0, "num_workers": 1})
    resumed = next(iter(dataset))
    np.testing.assert_array_equal(resumed["index"].numpy(), got[3]["index"].numpy())
    assert resumed["source"].dtype == torch.uint8

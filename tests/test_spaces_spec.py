"""Fields from gymnasium spaces and envs, `BufferSpec` (dict / JSON / YAML) and ``diskreplay create``."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

import diskreplay as dr
from diskreplay import cli

gym = pytest.importorskip("gymnasium")
spaces = gym.spaces
ROOT = Path(__file__).resolve().parents[1]


def step_fields(obs, action, next_obs, reward, terminated, truncated) -> dict:
    """One env step as the fields `fields_from_spaces` names (Dict values flattened)."""
    return {**dr.flatten_fields("obs", obs), **dr.flatten_fields("next_obs", next_obs),
            **dr.flatten_fields("action", action), "reward": reward, "terminated": terminated,
            "truncated": truncated}


def run_steps(env, buf, steps: int, seed: int = 0) -> list[dict]:
    """``steps`` random steps of ``env`` added to ``buf``; returns what was added."""
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    added = []
    for _ in range(steps):
        action = env.action_space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        step = step_fields(obs, action, next_obs, reward, terminated, truncated)
        buf.add(**step)
        added.append(step)
        obs = next_obs
        if np.any(terminated) or np.any(truncated):
            obs, _ = env.reset()
    return added


# ---- fields from spaces and envs ---------------------------------------------------------------


def test_cartpole_fields_and_a_real_step(tmp_path):
    env = gym.make("CartPole-v1")
    fields = dr.fields_from_env(env)
    assert fields == {"obs": dr.Field((4,), "float32"), "next_obs": dr.Field((4,), "float32"),
                      "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
                      "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
    with dr.ReplayBuffer.create(tmp_path / "b", dr.fields_from_env(env), capacity=64) as buf:
        added = run_steps(env, buf, 30)
        rows = buf.rows(np.arange(30))
    assert rows["obs"].dtype == np.float32 and rows["action"].dtype == np.int64
    np.testing.assert_array_equal(rows["obs"], np.stack([a["obs"] for a in added]))
    np.testing.assert_array_equal(rows["action"], [a["action"] for a in added])
    np.testing.assert_array_equal(rows["terminated"], [a["terminated"] for a in added])


def test_pendulum_fields_and_a_real_step(tmp_path):
    env = gym.make("Pendulum-v1")
    fields = dr.fields_from_env(env, next_obs=False)
    assert fields == {"obs": dr.Field((3,), "float32"), "action": dr.Field((1,), "float32"),
                      "reward": dr.Field((), "float32"), "terminated": dr.Field((), "bool"),
                      "truncated": dr.Field((), "bool")}
    with dr.ReplayBuffer.create(tmp_path / "b", **dr.spec_from_env(env, 100, derive_next=())) as buf:
        obs, _ = env.reset(seed=1)
        action = env.action_space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        buf.add(**step_fields(obs, action, next_obs, reward, terminated, truncated))
        row = buf.rows(np.array([0]))
    assert row["reward"].dtype == np.float32 and row["reward"][0] == np.float32(reward)
    np.testing.assert_array_equal(row["action"][0], action)


class DictEnv(gym.Env):
    """A tiny env with Dict observation and action spaces (nested, with every supported leaf)."""

    def __init__(self):
        self.observation_space = spaces.Dict({
            "pos": spaces.Box(-1.0, 1.0, (2,), np.float32),
            "goal": spaces.Dict({"xy": spaces.Box(-1.0, 1.0, (2,), np.float64)}),
            "flags": spaces.MultiBinary(3),
            "mode": spaces.Discrete(4),
            "frame": spaces.Box(0, 255, (4, 5, 3), np.uint8),
        })
        self.action_space = spaces.Dict({"move": spaces.MultiDiscrete([3, 3]), "grip": spaces.Discrete(2)})
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        return self.observation_space.sample(), 1.0, self.t % 5 == 0, False, {}


def test_dict_spaces_flattened_as_the_importers_name_them(tmp_path):
    env = DictEnv()
    fields = dr.fields_from_env(env)
    expected_obs = {"pos": dr.Field((2,), "float32"), "goal_xy": dr.Field((2,), "float64"),
                    "flags": dr.Field((3,), "int8"), "mode": dr.Field((), "int64"),
                    "frame": dr.Field((4, 5, 3), "uint8")}
    assert fields == {**{f"obs_{k}": f for k, f in expected_obs.items()},
                      **{f"next_obs_{k}": f for k, f in expected_obs.items()},
                      "action_move": dr.Field((2,), "int64"), "action_grip": dr.Field((), "int64"),
                      "reward": dr.Field((), "float32"), "terminated": dr.Field((), "bool"),
                      "truncated": dr.Field((), "bool")}
    with dr.ReplayBuffer.create(tmp_path / "b", fields, capacity=32) as buf:
        added = run_steps(env, buf, 12)
        rows = buf.rows(np.arange(12))
        assert int(buf.episodes().complete.sum()) == 2  # terminated every 5 steps
    np.testing.assert_array_equal(rows["obs_frame"], np.stack([a["obs_frame"] for a in added]))
    np.testing.assert_array_equal(rows["next_obs_goal_xy"], np.stack([a["next_obs_goal_xy"] for a in added]))
    assert rows["obs_flags"].dtype == np.int8 and rows["action_move"].shape == (12, 2)


def test_dict_keys_use_the_importers_naming_rule():
    space = spaces.Dict({"my-key": spaces.Discrete(2), "2d": spaces.Discrete(2)})
    fields = dr.fields_from_spaces(space, spaces.Discrete(2), next_obs=False)
    assert {"obs_my_key", "obs_f_2d"} <= set(fields)  # as the Minari importer: "obs_" + field_name(key)
    assert set(dr.flatten_fields("obs", {"my-key": 1, "2d": 0})) == {"obs_my_key", "obs_f_2d"}
    assert dr.flatten_fields("action", np.int64(3)) == {"action": 3}


def test_importing_diskreplay_imports_no_integrated_library():
    """The integrations (diskreplay.integrations: gymnasium spaces, SB3, TorchRL) load their
    library when used, never at ``import diskreplay``."""
    code = ("import sys, diskreplay; loaded = {'gymnasium', 'stable_baselines3', 'torchrl', 'tensordict', 'torch'}"
            " & set(sys.modules); assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vector_env_one_line_create(tmp_path):
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(3)])
    assert dr.fields_from_env(envs) == dr.fields_from_env(gym.make("CartPole-v1"))
    spec = dr.spec_from_env(envs, capacity=300)
    assert spec.num_envs == 3 and spec.capacity == 300
    with dr.ReplayBuffer.create(tmp_path / "b", **spec) as buf:
        obs, _ = envs.reset(seed=0)
        for _ in range(7):
            action = envs.action_space.sample()
            next_obs, reward, terminated, truncated, _ = envs.step(action)
            buf.add(obs=obs, next_obs=next_obs, action=action, reward=reward, terminated=terminated,
                    truncated=truncated)
            obs = next_obs
        assert buf.num_envs == 3 and len(buf) == 21
        assert buf.sample(8)["obs"].shape == (8, 4)
    with pytest.raises(ValueError, match="capacity must be a multiple of num_envs=3"):
        dr.spec_from_env(envs, capacity=100)


@pytest.mark.parametrize("space, name", [
    (spaces.Tuple((spaces.Discrete(2), spaces.Discrete(3))), "Tuple"),
    (spaces.Text(5), "Text"),
    (spaces.Graph(spaces.Box(0, 1, (2,)), None), "Graph"),
    (spaces.Sequence(spaces.Discrete(2)), "Sequence"),
])
def test_unsupported_spaces_named(space, name):
    with pytest.raises(ValueError, match=rf"observation_space: {name} spaces are not supported"):
        dr.fields_from_spaces(space, spaces.Discrete(2))
    nested = spaces.Dict({"inner": spaces.Dict({"bad": space})})
    with pytest.raises(ValueError, match=rf"action_space\['inner'\]\['bad'\]: {name} spaces"):
        dr.fields_from_spaces(spaces.Discrete(2), nested)


def test_unstorable_dtype_and_non_env_refused():
    if np.dtype(np.longdouble).itemsize > 8:  # float128 / float96: a Box dtype no buffer stores
        with pytest.raises(ValueError, match=r"observation_space: Box.*cannot be stored \(Field dtype must be"):
            dr.fields_from_spaces(spaces.Box(0, 1, (2,), np.longdouble), spaces.Discrete(2))
    with pytest.raises(ValueError, match="expected a gymnasium Env or VectorEnv"):
        dr.fields_from_env(object())
    with pytest.raises(ValueError, match="spec_from_env: .*capacty"):
        dr.spec_from_env(gym.make("CartPole-v1"), capacty=10)


# ---- BufferSpec --------------------------------------------------------------------------------

FIELDS = {"obs": dr.Field((17,), "float32"), "next_obs": dr.Field((17,), "float32"),
          "action": dr.Field((6,), "float32"), "reward": dr.Field((), "float32"),
          "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}


def full_spec() -> dr.BufferSpec:
    return dr.BufferSpec(FIELDS, capacity=4096, num_envs=4, chunk_rows=256, compression="lz4", compression_level=5,
                         episode_end=("terminated", "truncated"), derive_next=("obs",),
                         episodic_return=dr.EpisodicReturn(0.9, clip=(-1.0, 1.0)), row_shards=True)


@pytest.mark.parametrize("spec", [full_spec(), dr.BufferSpec(FIELDS), dr.BufferSpec(FIELDS, compression=None,
                                                                                      episode_end=None, shards=2)])
def test_round_trips(spec, tmp_path):
    data = spec.to_dict()
    assert json.loads(json.dumps(data)) == data  # JSON-ready
    assert data["fields"]["obs"] == {"shape": [17], "dtype": "float32"}
    assert dr.BufferSpec.from_dict(data) == spec
    assert dr.BufferSpec.from_json(spec.to_json()) == spec
    assert dr.BufferSpec.from_yaml(spec.to_yaml()) == spec
    for suffix in (".json", ".yaml", ".yml"):
        spec.to_file(tmp_path / f"s{suffix}")
        assert dr.BufferSpec.from_file(tmp_path / f"s{suffix}") == spec
    assert hash(dr.BufferSpec.from_dict(data)) == hash(spec)
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_round_trip_keeps_every_value():
    spec = dr.BufferSpec.from_yaml(full_spec().to_yaml())
    assert spec.fields == FIELDS and spec.capacity == 4096 and spec.num_envs == 4 and spec.chunk_rows == 256
    assert (spec.compression, spec.compression_level) == ("lz4", 5)
    assert spec.episode_end == ("terminated", "truncated") and spec.derive_next == ("obs",) and spec.row_shards
    assert spec.episodic_return is not None and spec.episodic_return.to_json() == {
        "gamma": 0.9, "reward": "reward", "name": "return", "default_return": 0.0, "clip": [-1.0, 1.0]}
    assert spec != dr.BufferSpec(FIELDS) and spec != spec.to_dict()


def test_compression_level_none_is_the_codecs_default(tmp_path):
    """A level left out is resolved when the spec is made: 6 for lz4hc, 3 for the others, as the
    buffer it creates records it."""
    for compression, level in (("zstd", 3), ("lz4", 3), ("lz4hc", 6), (None, 3)):
        spec = dr.BufferSpec(FIELDS, compression=compression)
        assert spec.compression_level == level and spec.to_dict()["compression_level"] == level
        with dr.ReplayBuffer.create(tmp_path / str(compression), **spec) as buf:
            assert buf.storage.config.level == dr.BufferSpec.from_buffer(buf).compression_level == level
    assert dr.BufferSpec(FIELDS, compression="lz4hc", compression_level=9).compression_level == 9


def test_spec_is_a_mapping_of_create_arguments(tmp_path):
    spec = full_spec()
    assert isinstance(spec, Mapping)
    assert list(spec) == list(spec.keys()) == list(dr.buffer.spec.KEYS)
    assert dict(spec) == spec.create_kwargs() and spec["capacity"] == 4096
    with pytest.raises(KeyError):
        spec["overwrite"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.capacity = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.fields["x"] = dr.Field((), "bool")  # type: ignore[index]
    with dr.ReplayBuffer.create(tmp_path / "b", **spec) as buf:
        config = buf.storage.config
        assert buf.capacity == 4096 and buf.num_envs == 4 and config.chunk_rows == 256
        assert (config.compression, config.level, config.derive_next) == ("lz4", 5, ("obs",))
        assert config.episodic_return == spec.episodic_return.to_json()
    with dr.ReplayBuffer.create(tmp_path / "b", **spec, overwrite=True) as buf:
        assert buf.capacity == 4096
    with dr.ReplayBuffer.open(tmp_path / "b") as buf:
        assert dr.BufferSpec.from_buffer(buf) == spec


def test_spec_from_a_sharded_buffer(tmp_path):
    spec = dr.BufferSpec(FIELDS, capacity=64, num_envs=2, chunk_rows=16, episode_end=None, shards=3)
    with dr.ReplayBuffer.create(tmp_path / "b", **spec) as buf:
        assert buf.shards == 3 and buf.num_envs == 6
        assert dr.BufferSpec.from_buffer(buf) == spec
    with dr.ReplayBuffer.open_shard(tmp_path / "b", 1) as shard:
        assert dr.BufferSpec.from_buffer(shard) == dataclasses.replace(spec, shards=None)


def test_yaml_conveniences():
    text = """
fields:
  obs: {shape: [3], dtype: float32}
  reward: {dtype: float32}
  done: {dtype: bool}
capacity: 1_000
compression: none
episode_end: done
"""
    spec = dr.BufferSpec.from_yaml(text)
    assert spec.fields["reward"] == dr.Field((), "float32") and spec.capacity == 1000
    assert spec.compression is None and spec.episode_end == ("done",)


@pytest.mark.parametrize("change, needle", [
    ({"capacity": 0}, "capacity: expected an int >= 1"),
    ({"capacity": "1e6"}, "capacity: expected an int"),
    ({"capacity": 1.5e6}, "capacity: expected an int"),
    ({"capacity": True}, "capacity: expected an int"),
    ({"num_envs": 0}, "num_envs: expected an int >= 1"),
    ({"capacity": 10, "num_envs": 3}, "capacity must be a multiple of num_envs=3"),
    ({"chunk_rows": -1}, "chunk_rows: expected an int >= 1"),
    ({"compression": "gzip"}, "compression: expected one of"),
    ({"compression_level": 99}, "compression_level for zstd must be an int in [0, 22]"),
    ({"compression": "lz4", "compression_level": 12}, "compression_level for lz4 must be an int in [0, 9], got 12"),
    ({"episode_end": ["obs"]}, "episode_end: expected scalar bool fields, got 'obs'"),
    ({"episode_end": 3}, "episode_end: expected a list of field names"),
    ({"derive_next": ["action"]}, "derive_next: expected fields 'action' and 'next_action'"),
    ({"derive_next": "obs"}, "derive_next: expected a list of field names"),
    ({"shards": 0}, "shards must be None or an int"),
    ({"episodic_return": {"gamma": 2.0}}, "episodic_return: EpisodicReturn gamma must be in [0, 1]"),
    ({"episodic_return": {"gama": 0.9}}, "episodic_return: unknown key 'gama' (did you mean 'gamma'?)"),
    ({"episodic_return": {"clip": [1]}}, "episodic_return.clip: expected [low, high]"),
    ({"episodic_return": {"reward": "obs"}}, "episodic_return: expected a scalar reward field 'obs'"),
    ({"episodic_return": 0.9}, "episodic_return: expected a mapping"),
    ({"capacty": 10}, "buffer spec: unknown key 'capacty' (did you mean 'capacity'?)"),
    ({"row_shards": "yes"}, "row_shards: expected True or False, got 'yes'"),
    ({"fields": {}}, "fields: expected a non-empty mapping"),
    ({"fields": ["obs"]}, "fields: expected a non-empty mapping"),
    ({"fields": {"obs": [3]}}, "fields.obs: expected a mapping with 'shape' and 'dtype'"),
    ({"fields": {"obs": {"shape": [3]}}}, "fields.obs.dtype: expected a dtype name"),
    ({"fields": {"obs": {"shape": [3], "dtype": "float33"}}}, "fields.obs.dtype: unknown dtype 'float33'"),
    ({"fields": {"obs": {"shape": [3], "dtype": "complex64"}}}, "fields.obs: Field dtype must be one of"),
    ({"fields": {"obs": {"shape": [-3], "dtype": "float32"}}}, "fields.obs.shape: expected a list of non-negative"),
    ({"fields": {"obs": {"shape": 3, "dtype": "float32"}}}, "fields.obs.shape: expected a list"),
    ({"fields": {"obs": {"shape": [3], "dtype": "float32", "dtyp": "x"}}}, "fields.obs: unknown key 'dtyp'"),
    ({"fields": {"index": {"shape": [], "dtype": "float32"}}}, "field name 'index' is reserved"),
])
def test_bad_specs_name_the_key(change, needle):
    data = {**dr.BufferSpec(FIELDS).to_dict(), **change}
    with pytest.raises(ValueError) as info:
        dr.BufferSpec.from_dict(data)
    assert needle in str(info.value)


def test_bad_documents():
    with pytest.raises(ValueError, match="fields: missing"):
        dr.BufferSpec.from_dict({"capacity": 10})
    with pytest.raises(ValueError, match="must be a mapping"):
        dr.BufferSpec.from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not valid JSON"):
        dr.BufferSpec.from_json("{fields")
    with pytest.raises(ValueError, match="not valid YAML"):
        dr.BufferSpec.from_yaml("fields: [unclosed")
    with pytest.raises(ValueError, match="must end in .json, .yaml or .yml"):
        dr.BufferSpec.from_file("spec.toml")
    with pytest.raises(ValueError, match="fields.obs: expected a dr.Field"):
        dr.BufferSpec({"obs": (3,)})  # type: ignore[dict-item]


def test_yaml_missing_names_pyyaml(monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ImportError, match="pip install pyyaml"):
        dr.BufferSpec(FIELDS).to_yaml()
    with pytest.raises(ImportError, match="'pyyaml' package"):
        dr.BufferSpec.from_yaml("fields: {}")
    assert dr.BufferSpec.from_json(dr.BufferSpec(FIELDS).to_json()) == dr.BufferSpec(FIELDS)


# ---- diskreplay create ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_cli_create_from_a_spec_file(suffix, tmp_path, capsys):
    spec = dr.spec_from_env(gym.make("CartPole-v1"), capacity=1000, chunk_rows=100, derive_next=("obs",))
    spec.to_file(tmp_path / f"spec{suffix}")
    url = str(tmp_path / "buf")
    assert cli.main(["create", "--config", str(tmp_path / f"spec{suffix}"), url]) == 0
    assert capsys.readouterr().out.startswith(f"created {url}: capacity 1,000 rows, 1 lane: obs (4,) float32")
    with dr.ReplayBuffer.open(url) as buf:
        assert buf.fields == spec.fields and buf.capacity == 1000 and buf.num_envs == 1
        assert buf.storage.config.chunk_rows == 100 and buf.storage.config.derive_next == ("obs",)
        assert buf.storage.config.episode_end == ("terminated", "truncated")
        assert dr.BufferSpec.from_buffer(buf) == dataclasses.replace(spec, episode_end=("terminated", "truncated"))
    assert cli.main(["create", "--config", str(tmp_path / f"spec{suffix}"), url]) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert cli.main(["create", "--config", str(tmp_path / f"spec{suffix}"), url, "--overwrite"]) == 0


def test_cli_create_errors_are_one_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("fields: {obs: {shape: [4], dtype: float32}}\ncapacity: -5\n")
    (tmp_path / "bad.json").write_text('{"fields": {"obs": {"shape": [4], "dtype": "float32"}}, "shards": 0}')
    for name, needle in (("bad.yaml", "capacity: expected an int >= 1"), ("bad.json", "shards must be None"),
                         ("missing.yaml", "No such file"), ("bad.txt", "must end in .json, .yaml or .yml")):
        proc = subprocess.run([sys.executable, "-m", "diskreplay.cli", "create", "--config",
                               str(tmp_path / name), str(tmp_path / "b")],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        errors = proc.stderr.strip().splitlines()
        assert len(errors) == 1 and errors[0].startswith("diskreplay: error:") and needle in errors[0], errors
    assert not (tmp_path / "b").exists()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["create", str(tmp_path / "b")])  # no --config
    assert exit_info.value.code == 2


def test_cli_create_help_and_import_stays_light(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["create", "--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage: diskreplay create")
    code = "import sys, diskreplay; print('gymnasium' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr

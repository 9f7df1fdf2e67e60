"""Stable-Baselines3 drop-in (`diskreplay.sb3`): SB3's own ``learn`` with the disk buffers, row-for-row
agreement with SB3's in-RAM ``ReplayBuffer``, HER relabelling, pickling without rows, kill and resume."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

sb3 = pytest.importorskip("stable_baselines3", reason="stable-baselines3 is not installed: pip install diskreplay[sb3]")
gym = pytest.importorskip("gymnasium")

import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3 import DQN, SAC, TD3  # noqa: E402
from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer  # noqa: E402
from stable_baselines3.common.envs import BitFlippingEnv  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize  # noqa: E402

import diskreplay as dr  # noqa: E402


def tiny() -> dict:
    """Small nets (a new dict each time: SAC writes ``use_sde`` into the one it is given)."""
    return dict(net_arch=[16])


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny nets train faster on one thread (and the suite shares its cores)."""
    threads = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(threads)


def dqn(env, url, **kwargs):
    options = dict(learning_starts=100, train_freq=4, batch_size=32, buffer_size=1000, policy_kwargs=tiny(), seed=0)
    options.update(kwargs)
    return DQN("MlpPolicy" if "policy" not in options else options.pop("policy"), env,
               replay_buffer_class=dr.sb3.DiskReplayBuffer, replay_buffer_kwargs={"url": url}, **options)


def stored(buf) -> dict[str, np.ndarray]:
    """Every row of a one-lane disk buffer, oldest first."""
    return buf.disk.rows(buf.disk.row_ids())


# ---- SB3's learn -------------------------------------------------------------------------------


def test_dqn_learns_on_cartpole_with_the_disk_buffer(tmp_path):
    model = dqn(gym.make("CartPole-v1"), str(tmp_path / "dqn"), train_freq=8)
    model.learn(1600)  # 200 rollouts of 8 steps
    buf = model.replay_buffer
    assert isinstance(buf, dr.sb3.DiskReplayBuffer)
    assert (buf.size(), buf.full, buf.pos, len(buf.disk)) == (1000, True, 600, 1000)
    rows = stored(buf)
    assert rows["obs"].dtype == np.float32 and rows["action"].shape == (1000, 1) and rows["action"].dtype == np.int64
    going = ~rows["done"][:-1]  # within an episode, the next observation is the next row's observation
    np.testing.assert_array_equal(rows["next_obs"][:-1][going], rows["obs"][1:][going])
    assert rows["done"].sum() >= 5 and not rows["timeout"].any()  # CartPole-v1's limit is 500 steps
    assert not np.array_equal(rows["next_obs"][:-1][~going], rows["obs"][1:][~going])  # resets
    batch = buf.sample(32)
    assert batch.observations.shape == (32, 4) and batch.rewards.shape == (32, 1) and batch.dones.shape == (32, 1)
    buf.close()


def test_vector_envs_write_one_lane_each(tmp_path):
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.save_util import load_from_zip_file

    model = dqn(make_vec_env("CartPole-v1", n_envs=2, seed=0), str(tmp_path / "lanes"), learning_starts=50)
    model.learn(400)  # 200 steps of 2 envs
    buf = model.replay_buffer
    assert (buf.disk.num_envs, buf.size(), buf.pos, len(buf.disk)) == (2, 200, 200, 400)
    rows = buf.disk.rows(np.arange(400))
    for lane in (0, 1):  # each lane is its own stream: next_obs is the lane's next obs within an episode
        obs, nxt, done = rows["obs"][lane::2], rows["next_obs"][lane::2], rows["done"][lane::2]
        np.testing.assert_array_equal(nxt[:-1][~done[:-1]], obs[1:][~done[:-1]])
    buf.close()


@pytest.mark.parametrize("algorithm", [SAC, TD3])
def test_sac_td3_on_pendulum_store_timeouts_and_bootstrap_them(tmp_path, algorithm):
    model = algorithm("MlpPolicy", gym.make("Pendulum-v1"), learning_starts=100, train_freq=8, batch_size=32,
                buffer_size=1000, policy_kwargs=tiny(), seed=0, replay_buffer_class=dr.sb3.DiskReplayBuffer,
                replay_buffer_kwargs={"url": str(tmp_path / "sac"), "flush_every": 100})
    model.learn(600)
    buf = model.replay_buffer
    rows = stored(buf)
    np.testing.assert_array_equal(np.flatnonzero(rows["done"]), [199, 399, 599])  # Pendulum's 200-step limit
    np.testing.assert_array_equal(np.flatnonzero(rows["timeout"]), [199, 399, 599])
    assert rows["action"].dtype == np.float32 and rows["action"].shape == (600, 1)
    ends = buf.samples_at(np.array([199, 399, 599, 5]), np.zeros(4, np.int64))
    np.testing.assert_array_equal(ends.dones.numpy(), np.zeros((4, 1), np.float32))  # a timeout bootstraps
    with dr.ReplayBuffer.open(buf.url) as reader:
        assert len(reader) == 600  # every 100 adds committed
    buf.close()


def test_dict_observations_learn_with_dict_replay_buffer_semantics(tmp_path):
    env = BitFlippingEnv(n_bits=4, continuous=False, max_steps=4)
    model = dqn(env, str(tmp_path / "dict"), policy="MultiInputPolicy", learning_starts=50)
    model.learn(400)
    buf = model.replay_buffer
    assert set(buf.disk.fields) >= {"obs_observation", "obs_achieved_goal", "obs_desired_goal",
                                    "next_obs_observation", "next_obs_desired_goal"}
    batch = buf.sample(16)
    assert set(batch.observations) == {"observation", "achieved_goal", "desired_goal"}
    assert batch.observations["observation"].shape == (16, 4)
    assert batch.observations["observation"].dtype == th.int8  # the space's dtype, as SB3 stores it
    rows = stored(buf)
    np.testing.assert_array_equal(np.flatnonzero(rows["timeout"]), np.flatnonzero(rows["done"] & (rows["reward"] < 0)))
    buf.close()


# ---- row for row against SB3's in-RAM buffer ------------------------------------------------------


def feed(buffers, obs_space, act_space, n_envs, steps, seed):
    """Identical ``add`` calls into every buffer: random rows, dones, and timeouts on some dones."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        def draw():
            if isinstance(obs_space, spaces.Dict):
                return {k: np.stack([s.sample() for _ in range(n_envs)]) for k, s in obs_space.spaces.items()}
            return np.stack([obs_space.sample() for _ in range(n_envs)])
        obs, next_obs = draw(), draw()
        action = np.stack([act_space.sample() for _ in range(n_envs)])
        reward = rng.normal(size=n_envs).astype(np.float32)
        done = rng.random(n_envs) < 0.3
        infos = [{"TimeLimit.truncated": bool(d and rng.random() < 0.5)} for d in done]
        for buf in buffers:
            buf.add(obs, next_obs, action, reward, done, infos)


def assert_same(ref, got):
    for name in ("actions", "dones", "rewards"):
        a, b = getattr(ref, name), getattr(got, name)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for name in ("observations", "next_observations"):
        a, b = getattr(ref, name), getattr(got, name)
        pairs = [(a[k], b[k]) for k in a] if isinstance(a, dict) else [(a, b)]
        assert not isinstance(a, dict) or set(a) == set(b)
        for x, y in pairs:
            assert (x.dtype, x.shape) == (y.dtype, y.shape), name
            np.testing.assert_array_equal(x.numpy(), y.numpy())


SPACES = {
    "box": (spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-1, 1, (2,), np.float64)),
    "discrete": (spaces.Discrete(7), spaces.Discrete(3)),
    "image": (spaces.Box(0, 255, (4, 4, 1), np.uint8), spaces.MultiDiscrete([3, 2])),
    "dict": (spaces.Dict({"pos": spaces.Box(-1, 1, (2,), np.float32), "bits": spaces.MultiBinary(3)}),
             spaces.Box(-1, 1, (1,), np.float32)),
}


@pytest.mark.parametrize("kind", sorted(SPACES))
@pytest.mark.parametrize("handle_timeout", [True, False])
def test_rows_match_sb3_replay_buffer(tmp_path, kind, handle_timeout):
    obs_space, act_space = SPACES[kind]
    cls = DictReplayBuffer if kind == "dict" else ReplayBuffer
    ref = cls(20, obs_space, act_space, device="cpu", n_envs=2, handle_timeout_termination=handle_timeout)
    got = dr.sb3.DiskReplayBuffer(20, obs_space, act_space, device="cpu", n_envs=2,
                                  handle_timeout_termination=handle_timeout, url=str(tmp_path / "b"), chunk_rows=4)
    feed([ref, got], obs_space, act_space, 2, 27, seed=1)  # 27 steps into 10 slots per env: wrapped twice
    assert (got.pos, got.full, got.size()) == (ref.pos, ref.full, ref.size()) == (7, True, 10)
    slots = np.repeat(np.arange(10), 3)
    for seed in range(3):  # SB3's hook draws the envs with numpy's global generator: the same ones
        np.random.seed(seed)
        expected = ref._get_samples(slots)
        np.random.seed(seed)
        assert_same(expected, got._get_samples(slots))
    dones = got.samples_at(np.arange(10), np.zeros(10, np.int64)).dones.numpy()[:, 0]
    np.testing.assert_array_equal(dones, ref.dones[:, 0] * (1 - ref.timeouts[:, 0]))
    batch, expected = got.sample(64), ref.sample(64)  # other draws: same shapes and dtypes
    for name in ("actions", "dones", "rewards"):
        a, b = getattr(expected, name), getattr(batch, name)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
    got.close()


def test_vec_normalize_hooks_match_sb3(tmp_path):
    obs_space, act_space = SPACES["box"]
    venv = VecNormalize(DummyVecEnv([lambda: gym.make("Pendulum-v1")]), gamma=0.9)
    venv.obs_rms.mean, venv.obs_rms.var = np.array([0.5, -0.5, 0.1]), np.array([4.0, 0.25, 1.0])
    venv.ret_rms.var = np.array(9.0)
    ref = ReplayBuffer(8, obs_space, act_space, device="cpu")
    got = dr.sb3.DiskReplayBuffer(8, obs_space, act_space, device="cpu", url=str(tmp_path / "n"))
    feed([ref, got], obs_space, act_space, 1, 8, seed=2)
    slots = np.arange(8)
    np.random.seed(0)
    expected = ref._get_samples(slots, env=venv)
    np.random.seed(0)
    result = got._get_samples(slots, env=venv)
    assert_same(expected, result)
    assert not np.array_equal(result.observations.numpy(), got.samples_at(slots, slots * 0).observations.numpy())
    got.close()


def test_bad_arguments_are_refused(tmp_path):
    obs_space, act_space = SPACES["box"]
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        dr.sb3.DiskReplayBuffer(8, obs_space, act_space, optimize_memory_usage=True, url=str(tmp_path / "a"))
    dr.sb3.DiskReplayBuffer(8, obs_space, act_space, url=str(tmp_path / "b")).close()
    with pytest.raises(ValueError, match="buffer_size and n_envs"):
        dr.sb3.DiskReplayBuffer(16, obs_space, act_space, url=str(tmp_path / "b"))
    dr.sb3.DiskReplayBuffer(16, obs_space, act_space, url=str(tmp_path / "b"), overwrite=True).close()


# ---- HER ----------------------------------------------------------------------------------------


def her_model(tmp_path, strategy, **kwargs):
    env = BitFlippingEnv(n_bits=4, continuous=False, max_steps=4)
    return DQN("MultiInputPolicy", env, learning_starts=40, train_freq=4, batch_size=40, buffer_size=1000,
               policy_kwargs=tiny(), seed=0, replay_buffer_class=dr.sb3.DiskHerReplayBuffer,
               replay_buffer_kwargs={"url": str(tmp_path / strategy), "n_sampled_goal": 4,
                                     "goal_selection_strategy": strategy, **kwargs})


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
def test_her_relabels_goals_from_the_same_episode(tmp_path, strategy):
    model = her_model(tmp_path, strategy)
    model.learn(300)
    buf = model.replay_buffer
    rows = stored(buf)
    ends = np.flatnonzero(rows["done"])
    starts = np.concatenate([[0], ends[:-1] + 1])
    np.random.seed(0)
    batch = buf._draw(200)
    assert batch["relabelled"].sum() == 160  # 4 of every 5
    achieved = rows["next_obs_achieved_goal"]
    for i in np.flatnonzero(batch["relabelled"]):
        t = int(batch["index"][i])
        first, last = starts[starts <= t][-1], ends[ends >= t][0] if (ends >= t).any() else len(rows) - 1
        allowed = {"future": range(t, last + 1), "final": [last], "episode": range(first, last + 1)}[strategy]
        goal = batch["obs_desired_goal"][i]
        assert any(np.array_equal(goal, achieved[s]) for s in allowed)
        np.testing.assert_array_equal(batch["next_obs_desired_goal"][i], goal)
    expected = model.env.env_method("compute_reward", batch["next_obs_achieved_goal"], batch["obs_desired_goal"],
                                    [{}] * 200, indices=[0])[0]
    np.testing.assert_array_equal(batch["reward"], expected.astype(np.float32))
    samples = buf.sample(40)
    assert samples.rewards.shape == (40, 1) and set(samples.observations) == {"observation", "achieved_goal",
                                                                              "desired_goal"}
    buf.close()


def test_her_buffer_pickles_without_env_or_rows(tmp_path):
    model = her_model(tmp_path, "future")
    model.learn(100)
    path = tmp_path / "her.pkl"
    model.save_replay_buffer(path)
    model.replay_buffer.close()
    assert path.stat().st_size < 20_000
    again = her_model(tmp_path / "other", "future")
    again.replay_buffer.close()
    again.load_replay_buffer(path)
    assert again.replay_buffer.env is again.env and again.replay_buffer.size() == 100
    again.learn(60, reset_num_timesteps=False)
    assert again.replay_buffer.size() == 160
    again.replay_buffer.close()


# ---- pickling and resuming -----------------------------------------------------------------------


def test_save_replay_buffer_pickles_the_url_not_the_rows(tmp_path):
    model = dqn(gym.make("CartPole-v1"), str(tmp_path / "rows"), learning_starts=50)
    model.learn(300)
    before = stored(model.replay_buffer)
    path = tmp_path / "buffer.pkl"
    model.save_replay_buffer(path)
    assert path.stat().st_size < 20_000 and before["obs"].tobytes() not in path.read_bytes()
    model.replay_buffer.close()  # the writer lock goes with it
    other = dqn(gym.make("CartPole-v1"), str(tmp_path / "unused"), learning_starts=50)
    other.replay_buffer.close()
    other.load_replay_buffer(path)
    buf = other.replay_buffer
    assert (buf.url, buf.size(), buf.pos) == (str(tmp_path / "rows"), 300, 300)
    after = stored(buf)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    other.learn(100, reset_num_timesteps=False)
    assert buf.size() == 400
    buf.close()
    copy = pickle.loads(pickle.dumps(buf))  # reopens the url when first used
    assert copy.size() == 400
    copy.close()


def test_buffers_pickled_under_the_former_sb3_paths_load(tmp_path):
    """Replay buffers (and models) saved before SB3's buffers moved to diskreplay.integrations.sb3
    name their classes by the former paths (diskreplay.sb3.buffer, .fields, .her): they still load,
    as the same classes."""
    model = dqn(gym.make("CartPole-v1"), str(tmp_path / "rows"), learning_starts=50)
    model.learn(60)
    old = pickle.dumps(model.replay_buffer, protocol=0).replace(b"diskreplay.integrations.sb3.", b"diskreplay.sb3.")
    assert b"cdiskreplay.sb3.buffer\nDiskReplayBuffer\n" in old and b"cdiskreplay.sb3.fields\nLayout\n" in old
    model.replay_buffer.close()
    copy = pickle.loads(old)
    assert type(copy) is dr.sb3.DiskReplayBuffer and type(copy.layout) is dr.sb3.Layout and copy.size() == 60
    copy.close()
    assert pickle.loads(b"cdiskreplay.sb3.her\nDiskHerReplayBuffer\n.") is dr.sb3.DiskHerReplayBuffer
    from diskreplay.sb3 import CheckpointCallback, DiskReplayBuffer
    assert (DiskReplayBuffer, CheckpointCallback) == (dr.sb3.DiskReplayBuffer, dr.sb3.CheckpointCallback)


def test_load_replay_buffer_whose_url_moved_raises_naming_the_url(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    model = dqn(gym.make("CartPole-v1"), str(old), learning_starts=50)
    model.learn(120)
    path = tmp_path / "buffer.pkl"
    model.save_replay_buffer(path)
    model.replay_buffer.close()
    old.rename(new)  # copied to another machine, or moved
    other = dqn(gym.make("CartPole-v1"), str(tmp_path / "unused"), learning_starts=50)
    other.replay_buffer.close()
    with pytest.raises(dr.NotABufferError, match=f"{str(old)!r} holds no buffer.*moved_buffers"):
        other.load_replay_buffer(path)
    assert not old.exists()  # no new, empty buffer at the old url
    with dr.sb3.moved_buffers({str(old): str(new)}):
        other.load_replay_buffer(path)
    buf = other.replay_buffer
    assert (buf.url, buf.size(), buf.pos) == (str(new), 120, 120)
    other.learn(40, reset_num_timesteps=False)
    assert buf.size() == 160 and not old.exists()
    buf.close()


def test_a_closed_buffer_whose_rows_were_deleted_never_reopens_empty(tmp_path):
    import shutil
    obs_space, act_space = spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2)
    buf = dr.sb3.DiskReplayBuffer(8, obs_space, act_space, device="cpu", url=str(tmp_path / "b"))
    buf.close()
    shutil.rmtree(tmp_path / "b")
    with pytest.raises(dr.NotABufferError, match=f"{str(tmp_path / 'b')!r} holds no buffer"):
        buf.size()
    assert not (tmp_path / "b").exists()
    with pytest.raises(dr.NotABufferError, match=f"{str(tmp_path / 'b')!r} holds no buffer"):
        pickle.loads(pickle.dumps(buf))


CHILD = textwrap.dedent("""
    import sys, time
    import diskreplay as dr
    assert "stable_baselines3" not in sys.modules  # import diskreplay stays light: dr.sb3 loads SB3
    import gymnasium as gym
    import numpy as np
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback

    class AfterFirstFlush(BaseCallback):
        def _on_step(self):
            buf = self.model.replay_buffer
            if buf.size() > 200:  # the 200th add committed 200 rows; this one is only staged
                np.save(sys.argv[2], buf.disk.rows(np.arange(200))["obs"])
                print("FLUSHED", flush=True)
                time.sleep(120)
            return True

    model = DQN("MlpPolicy", gym.make("CartPole-v1"), learning_starts=50, train_freq=4, buffer_size=1000,
                policy_kwargs=dict(net_arch=[16]), seed=0, replay_buffer_class=dr.sb3.DiskReplayBuffer,
                replay_buffer_kwargs={"url": sys.argv[1], "flush_every": 200})
    model.learn(10_000, callback=AfterFirstFlush())
""")


def test_training_resumes_from_the_disk_after_sigkill(tmp_path, caplog):
    url, saved = str(tmp_path / "resume"), str(tmp_path / "obs.npy")
    child = subprocess.Popen([sys.executable, "-c", CHILD, url, saved], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "FLUSHED"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    model = dqn(gym.make("CartPole-v1"), url, learning_starts=0)
    assert "took over the writer lock" in caplog.text  # the dead writer's
    buf = model.replay_buffer
    assert (buf.size(), buf.pos) == (200, 200)
    np.testing.assert_array_equal(buf.disk.rows(np.arange(200))["obs"], np.load(saved))
    model.learn(160)
    assert buf.size() == 360
    episodes = buf.disk.episodes()
    assert len(episodes) >= 2
    buf.close()


# ---- checkpoints: the buffer commits with the model ---------------------------------------------


def committed_rows(url: str) -> int:
    """Rows of the last commit, as a process opening the buffer after a kill sees them."""
    with dr.ReplayBuffer.open(url, "r") as reader:
        return len(reader)


@pytest.mark.parametrize("n_envs", [1, 2])
def test_checkpoint_callback_commits_the_buffer_with_each_model_save(tmp_path, n_envs):
    """The buffer is never ahead of the last checkpoint: it commits with each model save (the
    step the callback runs in is stored after callbacks run, so the commit holds the steps
    before it) and not between saves (its default flush_every would commit every 1000 adds)."""
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.save_util import load_from_zip_file

    url = str(tmp_path / "ckpt")
    model = dqn(make_vec_env("CartPole-v1", n_envs=n_envs, seed=0), url, train_freq=4, buffer_size=5000)
    assert model.replay_buffer.flush_every == 1000
    callback = dr.sb3.CheckpointCallback(save_freq=100, save_path=str(tmp_path / "models"))
    model.learn(240 * n_envs, callback=callback)
    assert model.replay_buffer.flush_every is None  # commits with the checkpoints only
    data, _, _ = load_from_zip_file(str(tmp_path / "models" / f"rl_model_{200 * n_envs}_steps.zip"))
    assert data is not None and data["num_timesteps"] == 200 * n_envs
    assert committed_rows(url) == 199 * n_envs  # steps 1..199 of every env; the kill would lose the rest
    model.replay_buffer.close()
    assert committed_rows(url) == 240 * n_envs


def test_model_save_alone_does_not_commit_save_replay_buffer_does(tmp_path):
    url = str(tmp_path / "plain")
    model = dqn(gym.make("CartPole-v1"), url)
    model.learn(152)
    model.save(str(tmp_path / "model.zip"))  # SB3 leaves the replay buffer out of model.save
    assert committed_rows(url) == 0
    model.save_replay_buffer(str(tmp_path / "buffer.pkl"))
    assert committed_rows(url) == 152
    model.replay_buffer.close()

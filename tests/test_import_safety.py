"""Hostile import sources: nothing is read outside the source, nothing is allocated because a header
claims it, and a refused import leaves the destination as it was (absent, or the old buffer intact)."""

from __future__ import annotations

import io
import os
import tracemalloc
import zipfile

import numpy as np
import pytest
from conftest import dir_snapshot

import diskreplay as dr
from diskreplay import offline as importers
from diskreplay.offline import ImportFormatError, import_dataset

h5py = pytest.importorskip("h5py")

SECRET = 7777.25  # what every target outside the source holds: an import must never produce it
N = 10


def secret_h5(tmp_path) -> str:
    """Another HDF5 file, shaped like the data it stands in for."""
    path = str(tmp_path / "secret.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.full((N + 1, 3), SECRET, np.float32)
        f["r"] = np.full(N, SECRET)
        f["episode_0/observations/pos"] = f["x"][:]
        f["episode_0/actions"] = np.full((N, 2), SECRET, np.float32)
        f["episode_0/rewards"] = f["r"][:]
        f["episode_0/terminations"] = np.zeros(N, bool)
        f["episode_0/truncations"] = np.zeros(N, bool)
    return path


def secret_virtual(f, name: str, tmp_path, rows: int = N) -> None:
    layout = h5py.VirtualLayout(shape=(rows, 3), dtype=np.float32)
    layout[:] = h5py.VirtualSource(secret_h5(tmp_path), "x", shape=(N + 1, 3))[:rows]
    f.create_virtual_dataset(name, layout)


def secret_external(f, name: str, tmp_path, rows: int = N) -> None:
    raw = tmp_path / "secret.bin"
    np.full((rows, 3), SECRET, np.float32).tofile(raw)
    f.create_dataset(name, (rows, 3), np.float32, external=[(str(raw), 0, h5py.h5f.UNLIMITED)])


# ---- D4RL -------------------------------------------------------------------------------------


def d4rl(tmp_path, hostile) -> tuple[str, str]:
    path = tmp_path / "d.hdf5"
    with h5py.File(path, "w") as f:
        f["actions"] = np.zeros((N, 2), np.float32)
        f["rewards"] = np.zeros(N, np.float32)
        f["terminals"] = np.zeros(N, bool)
        f["timeouts"] = np.zeros(N, bool)
        pattern = hostile(f, tmp_path)
    return str(path), pattern


def d4rl_external_storage(f, tmp_path) -> str:
    secret_external(f, "observations", tmp_path)
    return r"dataset '/observations' keeps its data in external file.*secret\.bin"


def d4rl_virtual(f, tmp_path) -> str:
    secret_virtual(f, "observations", tmp_path)
    return r"dataset '/observations' is a virtual dataset.*secret\.h5"


def d4rl_external_link(f, tmp_path) -> str:
    f["observations"] = h5py.ExternalLink(secret_h5(tmp_path), "/x")
    return r"link '/observations' is an external link to .*secret\.h5"


def d4rl_nested_external_link(f, tmp_path) -> str:
    f["observations"] = np.zeros((N, 3), np.float32)
    f["infos/qpos"] = h5py.ExternalLink(secret_h5(tmp_path), "/r")
    return r"link '/infos/qpos' is an external link to .*secret\.h5"


# ---- Minari -----------------------------------------------------------------------------------


def minari(tmp_path, hostile, episodes: int = 2) -> tuple[str, str]:
    root = tmp_path / "ds"
    os.makedirs(root / "data")
    with h5py.File(root / "data" / "main_data.hdf5", "w") as f:
        for i in range(episodes):
            g = f.create_group(f"episode_{i}")
            g["observations/pos"] = np.zeros((N + 1, 3), np.float32)
            g["actions"] = np.zeros((N, 2), np.float32)
            g["rewards"] = np.zeros(N)
            g["terminations"] = np.arange(N) == N - 1
            g["truncations"] = np.zeros(N, bool)
        pattern = hostile(f, tmp_path)
    return str(root), pattern


def minari_episode_link(f, tmp_path) -> str:
    del f["episode_1"]
    f["episode_1"] = h5py.ExternalLink(secret_h5(tmp_path), "/episode_0")
    return r"link '/episode_1' is an external link to .*secret\.h5"


def minari_member_link(f, tmp_path) -> str:
    del f["episode_1/rewards"]
    f["episode_1/rewards"] = h5py.ExternalLink(secret_h5(tmp_path), "/r")
    return r"link '/episode_1/rewards' is an external link to .*secret\.h5"


def minari_nested_link(f, tmp_path) -> str:
    del f["episode_1/observations/pos"]
    f["episode_1/observations/pos"] = h5py.ExternalLink(secret_h5(tmp_path), "/x")
    return r"link '/episode_1/observations/pos' is an external link to .*secret\.h5"


def minari_soft_link_through_external(f, tmp_path) -> str:
    f["elsewhere"] = h5py.ExternalLink(secret_h5(tmp_path), "/")  # never used by the importer itself
    del f["episode_1/observations/pos"]
    f["episode_1/observations/pos"] = h5py.SoftLink("/elsewhere/x")
    return r"link '/episode_1/observations/pos' is a soft link to '/elsewhere/x'"


def minari_external_storage(f, tmp_path) -> str:
    del f["episode_1/observations/pos"]
    secret_external(f, "episode_1/observations/pos", tmp_path, rows=N + 1)
    return r"dataset '/episode_1/observations/pos' keeps its data in external file.*secret\.bin"


def minari_virtual(f, tmp_path) -> str:
    del f["episode_1/observations/pos"]
    secret_virtual(f, "episode_1/observations/pos", tmp_path, rows=N + 1)
    return r"dataset '/episode_1/observations/pos' is a virtual dataset.*secret\.h5"


# ---- .npz / .npy ------------------------------------------------------------------------------


def npy_bytes(shape: tuple[int, ...], dtype: str, data: bytes, fortran: bool = False) -> bytes:
    """A .npy stream whose header says ``shape`` whatever ``data`` holds."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": dtype, "fortran_order": fortran, "shape": shape})
    return out.getvalue() + data


def huge_npz(tmp_path) -> tuple[str, str]:
    path = str(tmp_path / "huge.npz")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("obs.npy", npy_bytes((10**15, 17), "<f8", b"\x00" * 64))  # 136 PB claimed, 64 B held
    return path, r"huge\.npz': obs\.npy: the header claims shape \(1000000000000000, 17\) of float64"


def truncated_npz(tmp_path) -> tuple[str, str]:
    path = str(tmp_path / "short.npz")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("obs.npy", npy_bytes((100, 2), "<f8", np.zeros((50, 2)).tobytes()))
        zf.writestr("reward.npy", npy_bytes((100,), "<f4", np.zeros(100, np.float32).tobytes()))
    return path, r"obs\.npy: the header claims shape \(100, 2\) of float64 \(1600 bytes\).*800 bytes"


def fortran_npz(tmp_path) -> tuple[str, str]:
    """A 24 MB Fortran-ordered member (above FORTRAN_WHOLE_BYTES), deflated to a few KB of zeros."""
    path = str(tmp_path / "f.npz")
    shape = (3000, 20, 50)
    assert np.prod(shape) * 8 > importers.FORTRAN_WHOLE_BYTES
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("img.npy", "w") as member:
            member.write(npy_bytes(shape, "<f8", b"", fortran=True))
            for _ in range(3000 // 100):
                member.write(bytes(100 * 20 * 50 * 8))
        zf.writestr("reward.npy", npy_bytes((3000,), "<f8", bytes(3000 * 8)))
    return path, r"f\.npz': img\.npy: Fortran-ordered array of shape \(3000, 20, 50\).*np\.ascontiguousarray"


def object_npz(tmp_path) -> tuple[str, str]:
    path = str(tmp_path / "o.npz")
    np.savez(path, obj=np.array([{}, 1], dtype=object), reward=np.zeros(2))
    return path, r"obj\.npy: object arrays cannot be imported"


def truncated_npy(tmp_path) -> tuple[str, str]:
    folder = tmp_path / "npy"
    os.makedirs(folder)
    np.save(folder / "reward.npy", np.zeros(1000, np.float32))
    (folder / "obs.npy").write_bytes(npy_bytes((1000, 4), "<f4", np.zeros((10, 4), np.float32).tobytes()))
    return str(folder), r"obs\.npy: the header claims shape \(1000, 4\) of float32 \(16000 bytes\).*160 bytes"


def object_npy(tmp_path) -> tuple[str, str]:
    folder = tmp_path / "npy"
    os.makedirs(folder)
    np.save(folder / "reward.npy", np.zeros(2))
    np.save(folder / "obj.npy", np.array([{}, 1], dtype=object), allow_pickle=True)
    return str(folder), r"obj\.npy: object arrays cannot be imported"


HDF5_CASES = {
    "d4rl-external-storage": lambda p: d4rl(p, d4rl_external_storage),
    "d4rl-virtual": lambda p: d4rl(p, d4rl_virtual),
    "d4rl-external-link": lambda p: d4rl(p, d4rl_external_link),
    "d4rl-nested-external-link": lambda p: d4rl(p, d4rl_nested_external_link),
    "minari-episode-link": lambda p: minari(p, minari_episode_link),
    "minari-member-link": lambda p: minari(p, minari_member_link),
    "minari-nested-link": lambda p: minari(p, minari_nested_link),
    "minari-soft-link-through-external": lambda p: minari(p, minari_soft_link_through_external),
    "minari-external-storage": lambda p: minari(p, minari_external_storage),
    "minari-virtual": lambda p: minari(p, minari_virtual),
}
ARRAY_CASES = {
    "npz-huge-header": huge_npz,
    "npz-truncated": truncated_npz,
    "npz-fortran": fortran_npz,
    "npz-object": object_npz,
    "npy-truncated": truncated_npy,
    "npy-object": object_npy,
}
CASES = {**HDF5_CASES, **ARRAY_CASES}


def old_buffer(path) -> dict[str, bytes]:
    buf = dr.ReplayBuffer.create(path, {"x": dr.Field((2,), "int16")}, chunk_rows=4)
    buf.extend({"x": np.arange(22).reshape(11, 2)})
    buf.close()
    return dir_snapshot(str(path))


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_touching_destination(tmp_path, case):
    """Refused with the object named and why; no dest is created, an old buffer is left byte for byte."""
    src, pattern = CASES[case](tmp_path)
    dest = tmp_path / "dest"
    with pytest.raises(ImportFormatError, match=pattern):
        import_dataset(src, dest, batch_rows=8, progress=False)
    assert not dest.exists()
    old = tmp_path / "old"
    before = old_buffer(old)
    with pytest.raises(ImportFormatError, match=pattern):
        import_dataset(src, old, batch_rows=8, progress=False, overwrite=True)
    assert dir_snapshot(str(old)) == before
    np.testing.assert_array_equal(dr.ReplayBuffer.open(old)[np.arange(11)]["x"], np.arange(22).reshape(11, 2))


@pytest.mark.parametrize("case", list(HDF5_CASES))
def test_hdf5_outside_data_is_never_read(tmp_path, case, monkeypatch):
    """No dataset read happens at all before the refusal (so the secret values cannot be produced)."""
    src, pattern = HDF5_CASES[case](tmp_path)
    reads = []
    original = h5py.Dataset.__getitem__

    def recording(self, key, *args, **kwargs):
        reads.append(self.name)
        return original(self, key, *args, **kwargs)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", recording)
    with pytest.raises(ImportFormatError, match=pattern):
        import_dataset(src, tmp_path / "dest", progress=False)
    assert reads == []


def record_zip_reads(monkeypatch) -> list[int]:
    sizes: list[int] = []
    original = zipfile.ZipExtFile.read

    def read(self, n=-1):
        sizes.append(n)
        return original(self, n)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", read)
    return sizes


def test_npz_huge_header_allocates_nothing(tmp_path, monkeypatch):
    src, pattern = huge_npz(tmp_path)
    assert os.path.getsize(src) < 3 * 2**20
    sizes = record_zip_reads(monkeypatch)
    tracemalloc.start()
    try:
        with pytest.raises(ImportFormatError, match=pattern):
            import_dataset(src, tmp_path / "dest", progress=False)  # default batch_rows: 65536 rows of 136 B
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sizes and all(0 <= n < 2**16 for n in sizes), sizes  # header reads only, never "the rest"
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    assert not (tmp_path / "dest").exists()


def test_npz_fortran_member_is_not_read_whole(tmp_path, monkeypatch):
    src, pattern = fortran_npz(tmp_path)
    sizes = record_zip_reads(monkeypatch)
    with pytest.raises(ImportFormatError, match=pattern):
        import_dataset(src, tmp_path / "dest", batch_rows=64, progress=False)
    assert sizes and all(0 <= n < 4096 for n in sizes), sizes  # the 24 MB of data never requested


def test_refusal_while_streaming_leaves_no_destination(tmp_path):
    """A Minari episode found inconsistent only while rows stream: dest (already half written) is removed."""
    def drop_truncations(f, _):
        del f["episode_2/truncations"]
        return "fields"

    src, _ = minari(tmp_path, drop_truncations, episodes=3)
    with pytest.raises(ImportFormatError, match=r"episode_2.*differ from the first episode"):
        import_dataset(src, tmp_path / "dest", batch_rows=4, chunk_rows=4, progress=False)
    assert not (tmp_path / "dest").exists()

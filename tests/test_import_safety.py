"""Hostile import sources: nothing is read outside the source, nothing is allocated because a header
claims it, and a refused import leaves the destination as it was (absent, or the old buffer intact)."""

from __future__ import annotations

import io
import json
import os
import tracemalloc
import zipfile

import numpy as np
import pytest
from conftest import dir_snapshot

import diskreplay as dr
from diskreplay import offline as importers
from diskreplay.format.keys import MAX_METADATA_BYTES
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
    assert sorted(os.listdir(tmp_path)) == ["ds"]


# ---- failures after the plan was checked: dest as it was, nothing else left -----------------------


def failing_npz(tmp_path) -> tuple[str, str]:
    """A valid-looking .npz whose observations member is damaged past its header (bad CRC)."""
    path = tmp_path / "bad.npz"
    np.savez(path, observations=np.arange(4000, dtype=np.float32).reshape(1000, 4), rewards=np.zeros(1000))
    blob = bytearray(path.read_bytes())
    at = blob.index(np.arange(4000, dtype=np.float32).tobytes()[8000:8016])
    blob[at] ^= 0xFF
    path.write_bytes(bytes(blob))
    return str(path), r"bad\.npz': observations\.npy: corrupt data \(Bad CRC-32"


def failing_minari(tmp_path) -> tuple[str, str]:
    def drop_truncations(f, _):
        del f["episode_2/truncations"]
        return "fields"

    return minari(tmp_path, drop_truncations, episodes=3)[0], r"episode_2.*differ from the first episode"


FAILING = {"npz-bad-crc": failing_npz, "minari-inconsistent-episode": failing_minari}


@pytest.mark.parametrize("case", list(FAILING))
@pytest.mark.parametrize("overwrite", [False, True])
def test_import_failing_while_streaming_leaves_dest_as_it_was(tmp_path, case, overwrite):
    """Found only after rows were written: with overwrite the old buffer is byte for byte intact,
    without it no dest; nothing else is left beside it, and a retry (of a good source) works."""
    src, pattern = FAILING[case](tmp_path)
    dest = tmp_path / "dest"
    before = old_buffer(dest) if overwrite else {}
    listing = sorted(os.listdir(tmp_path))
    with pytest.raises(ImportFormatError, match=pattern):
        import_dataset(src, dest, batch_rows=4, chunk_rows=4, progress=False, overwrite=overwrite)
    assert dir_snapshot(str(dest)) == before and dest.exists() == overwrite
    assert sorted(os.listdir(tmp_path)) == listing
    np.savez(tmp_path / "good.npz", observations=np.ones((5, 2)))
    assert len(import_dataset(tmp_path / "good.npz", dest, progress=False, overwrite=overwrite)) == 5


def test_import_failing_to_create_its_buffer_leaves_nothing(tmp_path, monkeypatch):
    """The new buffer's staging cannot be allocated: what create wrote is removed, dest is as it was."""
    from diskreplay.storage import cache

    def no_memory(*args, **kwargs):
        raise MemoryError("no room for staging")

    np.savez(tmp_path / "a.npz", observations=np.ones((5, 2)))
    before = old_buffer(tmp_path / "old")
    monkeypatch.setattr(cache.ChunkCache, "__init__", no_memory)
    for dest, overwrite in ((tmp_path / "new", False), (tmp_path / "old", True)):
        with pytest.raises(MemoryError, match="no room for staging"):
            import_dataset(tmp_path / "a.npz", dest, progress=False, overwrite=overwrite)
    assert sorted(os.listdir(tmp_path)) == ["a.npz", "old"]
    assert dir_snapshot(str(tmp_path / "old")) == before
    monkeypatch.undo()
    assert len(import_dataset(tmp_path / "a.npz", tmp_path / "new", progress=False)) == 5


# ---- hostile sources: one ImportFormatError naming the file and the field, nothing left ------------


def patched(path, old: bytes, new: bytes) -> None:
    """Replaces every ``old`` in the file by ``new`` (same length)."""
    blob = path.read_bytes()
    assert len(old) == len(new) and old in blob
    path.write_bytes(blob.replace(old, new))


def npz_of(tmp_path, members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> str:
    path = tmp_path / "h.npz"
    with zipfile.ZipFile(path, "w", method) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return str(path)


def good_npy(rows: int = 1000) -> bytes:
    return npy_bytes((rows, 4), "<f4", np.arange(rows * 4, dtype=np.float32).tobytes())


def npz_cut_in_half(tmp_path):
    src = npz_of(tmp_path, {"observations.npy": good_npy()})
    blob = open(src, "rb").read()
    open(src, "wb").write(blob[:len(blob) // 2])
    return src, r"h\.npz' is not an \.npz file \(not a zip archive\)"


def npz_corrupt_deflate(tmp_path):
    rng = np.random.default_rng(0)
    data = npy_bytes((4000, 4), "<f4", rng.integers(0, 16, (4000, 4)).astype(np.float32).tobytes())
    src = npz_of(tmp_path, {"observations.npy": data}, zipfile.ZIP_DEFLATED)
    blob = bytearray(open(src, "rb").read())
    blob[len(blob) // 2:len(blob) // 2 + 64] = bytes(range(64))
    open(src, "wb").write(bytes(blob))
    return src, r"h\.npz': observations\.npy: corrupt data \("


def npz_non_utf8_name(tmp_path):
    src = npz_of(tmp_path, {"obs\u00e9.npy": good_npy()})  # a UTF-8 name (flag 0x800 set)...
    patched(tmp_path / "h.npz", "obs\u00e9".encode(), b"obs\xff\xfe")  # ...that is not UTF-8
    return src, r"h\.npz' is not an \.npz file \(not a zip archive\).*utf-8"


def npz_encrypted(tmp_path):
    src = npz_of(tmp_path, {"observations.npy": good_npy()})
    blob = bytearray(open(src, "rb").read())
    blob[6] |= 1  # local header: general purpose flags, bit 0 (encrypted)
    central = blob.index(b"PK\x01\x02")
    blob[central + 8] |= 1
    open(src, "wb").write(bytes(blob))
    return src, r"h\.npz': observations\.npy: cannot be read \(.*encrypted"


def npz_unknown_compression(tmp_path):
    src = npz_of(tmp_path, {"observations.npy": good_npy()})
    blob = bytearray(open(src, "rb").read())
    blob[8] = 99  # local header: compression method
    blob[blob.index(b"PK\x01\x02") + 10] = 99
    open(src, "wb").write(bytes(blob))
    return src, r"h\.npz': observations\.npy: cannot be read \(.*compression method"


def npz_not_npy(tmp_path):
    return (npz_of(tmp_path, {"observations.npy": b"hello, world" * 10}),
            r"h\.npz': observations\.npy: not a valid \.npy header \(.*magic")


def npz_header_text(shape_text: str, pattern: str):
    def case(tmp_path):
        header = good_npy()[:128].replace(b"(1000, 4)", shape_text.encode().ljust(9))
        return npz_of(tmp_path, {"observations.npy": header + good_npy()[128:]}), pattern
    return case


def npz_bad_descr(tmp_path):
    header = good_npy()[:128].replace(b"'<f4'", b"'<x9'")
    return npz_of(tmp_path, {"observations.npy": header + good_npy()[128:]}), \
        r"h\.npz': observations\.npy: not a valid \.npy header"


def npz_only_empty_rows(tmp_path):
    return (npz_of(tmp_path, {"observations.npy": npy_bytes((10**15, 0), "<f4", b"")}),
            r"h\.npz': no field to import")


def npy_folder(tmp_path, data: bytes, size: int | None = None) -> str:
    folder = tmp_path / "npy"
    os.makedirs(folder)
    with open(folder / "observations.npy", "wb") as f:
        f.write(data)
        if size is not None:
            f.truncate(size)  # sparse: no disk used
    return str(folder)


def npy_garbage(tmp_path):
    return npy_folder(tmp_path, b"\x93NUMPY\x01\x00garbage"), r"observations\.npy: not a valid \.npy header"


def npy_negative_shape(tmp_path):
    return (npy_folder(tmp_path, npy_bytes((-5, 4), "<f4", b"\x00" * 80)),
            r"observations\.npy: the header's shape \(-5, 4\) has a negative size")


def npy_huge_row(tmp_path):
    header = npy_bytes((1, 2**27), "<f8", b"")
    return (npy_folder(tmp_path, header, len(header) + 2**30),
            r"array 'observations': rows of shape \(134217728,\) of float64 hold 1,073,741,824 bytes, "
            r"expected at most 67,108,864")


def parquet_huge_list(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    schema = pa.schema([("episode_index", pa.int64()), ("observation.state", pa.list_(pa.float32(), 2**28))])
    pq.write_table(schema.empty_table(), tmp_path / "h.parquet")
    return (str(tmp_path / "h.parquet"), r"h\.parquet': column 'observation\.state': rows of shape \(268435456,\) "
            r"of float32 hold 1,073,741,824 bytes, expected at most 67,108,864")


def minari_arrow(tmp_path, metadata: bytes | None = None, space: object = None, episodes=("0", "1"),
                 changed_type: bool = False) -> str:
    """A Minari dataset in the arrow data format: episodes of 3 steps of 4 observations."""
    pa = pytest.importorskip("pyarrow")
    data = tmp_path / "ds" / "data"
    os.makedirs(data)
    if metadata is None:
        meta = {"data_format": "arrow"}
        if space is not None:
            meta["observation_space"] = space if isinstance(space, str) else json.dumps(space)
        metadata = json.dumps(meta).encode()
    (data / "metadata.json").write_bytes(metadata)
    for i, episode in enumerate(episodes):
        os.makedirs(data / episode)
        obs = (pa.array(np.zeros(4)) if changed_type and i == 1
               else pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(16, np.float32)), 4))
        table = pa.table({"observations": obs, "rewards": pa.array(np.zeros(4)),
                          "terminations": pa.array(np.zeros(4, bool)), "truncations": pa.array(np.zeros(4, bool))})
        with pa.ipc.new_file(str(data / episode / "part-0.arrow"), table.schema) as writer:
            writer.write_table(table)
    return str(tmp_path / "ds")


def minari_metadata(metadata: bytes, pattern: str):
    return lambda tmp_path: (minari_arrow(tmp_path, metadata=metadata), pattern)


def minari_space_shape(shape: list, pattern: str):
    return lambda tmp_path: (minari_arrow(tmp_path, space={"type": "Box", "shape": shape}), pattern)


def minari_metadata_too_large(tmp_path):
    src = minari_arrow(tmp_path)
    with open(os.path.join(src, "data", "metadata.json"), "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: no disk used
    return src, rf"data/metadata\.json' has {MAX_METADATA_BYTES + 1:,} bytes, expected a JSON document of at most"


def minari_superscript_episode(tmp_path):
    return (minari_arrow(tmp_path, episodes=("0", "\u00b2")),
            r"data': episode folder '\u00b2' is not an episode id, expected 1 to 18 ASCII digits")


def minari_changed_type(tmp_path):
    return (minari_arrow(tmp_path, changed_type=True),
            r"data/1/part-0\.arrow': column 'observations' has rows of another type than")


def minari_h5_rewards(value):
    def damage(f, _):
        del f["episode_1/rewards"]
        if value is None:
            f.create_group("episode_1/rewards")
        else:
            f["episode_1/rewards"] = value
        return ""

    def case(tmp_path):
        got = "a group" if value is None else r"\(\)"
        return minari(tmp_path, damage)[0], rf"episode '/episode_1': 'rewards' is {got}, expected a dataset"
    return case


def zarr_group(tmp_path, shape_text: str | None = None, corrupt: bool = False, big_metadata: bool = False) -> str:
    """A plain Zarr group of one observations array (100 x 3 float32, chunks of 10 rows)."""
    zarr = pytest.importorskip("zarr")
    group = zarr.open_group(str(tmp_path / "z"), mode="w")
    group.create_array("observations", shape=(100, 3), chunks=(10, 3), dtype="f4")[:] = np.ones((100, 3))
    if corrupt:
        (tmp_path / "z" / "observations" / "c" / "3" / "0").write_bytes(b"garbage")
    if big_metadata:
        with open(tmp_path / "z" / "observations" / "zarr.json", "r+b") as f:
            f.truncate(MAX_METADATA_BYTES + 1)  # sparse: no disk used
    if shape_text is not None:
        meta = tmp_path / "z" / "observations" / "zarr.json"
        meta.write_text(meta.read_text().replace('"shape": [\n    100,\n    3\n  ]', f'"shape": {shape_text}'))
    return str(tmp_path / "z")


HOSTILE = {
    "npz-cut-in-half": npz_cut_in_half,
    "npz-bad-crc": failing_npz,
    "npz-corrupt-deflate": npz_corrupt_deflate,
    "npz-non-utf8-member-name": npz_non_utf8_name,
    "npz-encrypted-member": npz_encrypted,
    "npz-unknown-compression": npz_unknown_compression,
    "npz-member-not-npy": npz_not_npy,
    "npz-shape-1e999": npz_header_text("(1e999,4)", r"observations\.npy: not a valid \.npy header"),
    "npz-shape-negative": npz_header_text("(-5, 4)", r"observations\.npy: the header's shape \(-5, 4\) has a "
                                                     r"negative size"),
    "npz-shape-text": npz_header_text("('²', 4)", r"observations\.npy: not a valid \.npy header"),
    "npz-bad-dtype": npz_bad_descr,
    "npz-only-empty-rows": npz_only_empty_rows,
    "npy-garbage": npy_garbage,
    "npy-shape-negative": npy_negative_shape,
    "npy-row-of-1-gib": npy_huge_row,
    "parquet-fixed-list-of-2**28": parquet_huge_list,
    "minari-metadata-not-utf8": minari_metadata(b'{"data_format": "arrow", "x": "\xff"}',
                                                r"data': metadata\.json is not valid JSON \(.*utf-8"),
    "minari-metadata-not-json": minari_metadata(b'{"data_format": ', r"data': metadata\.json is not valid JSON"),
    "minari-metadata-deep": minari_metadata(b"[" * 100_000, r"data': metadata\.json is not valid JSON"),
    "minari-metadata-list": minari_metadata(b"[1, 2]", r"data': metadata\.json is not a JSON object, got list"),
    "minari-metadata-too-large": minari_metadata_too_large,
    "minari-shape-1e999": minari_space_shape([1e999], r"metadata\.json': observation_space has shape \[inf\], "
                                                      r"expected a list of ints >= 0"),
    "minari-shape-superscript": minari_space_shape(["\u00b2"], r"observation_space has shape \['\u00b2'\]"),
    "minari-shape-negative": minari_space_shape([-2, -2], r"observation_space has shape \[-2, -2\]"),
    "minari-episode-folder-superscript": minari_superscript_episode,
    "minari-episode-changes-type": minari_changed_type,
    "minari-h5-scalar-rewards": minari_h5_rewards(1.0),
    "minari-h5-rewards-group": minari_h5_rewards(None),
    "zarr-corrupt-chunk": lambda p: (zarr_group(p, corrupt=True),
                                     r"z': array 'observations': rows from 0 do not decode \(.*Zstd"),
    "zarr-metadata-too-large": lambda p: (zarr_group(p, big_metadata=True),
                                          rf"z': observations/zarr\.json has {MAX_METADATA_BYTES + 1:,} bytes"),
    "zarr-shape-1e999": lambda p: (zarr_group(p, "[1e999, 3]"), r"z' is neither a diskreplay buffer nor a Zarr group"),
    "zarr-row-of-4-tib": lambda p: (zarr_group(p, "[100, 1099511627776]"),
                                    r"z': array 'observations': rows of shape \(1099511627776,\) of float32 hold "
                                    r"4,398,046,511,104 bytes"),
}


@pytest.mark.filterwarnings("ignore:.*skipped")
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_source_is_one_import_format_error(tmp_path, case):
    """One ImportFormatError naming the file and the field; no dest, nothing else left behind."""
    src, pattern = HOSTILE[case](tmp_path)
    listing = sorted(os.listdir(tmp_path))
    with pytest.raises(ImportFormatError, match=pattern):
        import_dataset(src, tmp_path / "dest", progress=False)
    assert sorted(os.listdir(tmp_path)) == listing


def test_metadata_over_the_limit_is_refused_without_reading_it(tmp_path):
    """A 64 MiB metadata.json (a 3 GiB one took 6.2 GB): refused from its size, with bounded memory."""
    src = minari_arrow(tmp_path)
    with open(os.path.join(src, "data", "metadata.json"), "r+b") as f:
        f.truncate(64 * 2**20)  # sparse: no disk used
    tracemalloc.start()
    try:
        with pytest.raises(ImportFormatError, match=r"metadata\.json' has 67,108,864 bytes"):
            import_dataset(src, tmp_path / "dest", progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    assert sorted(os.listdir(tmp_path)) == ["ds"]


def test_remote_dest_is_replaced_only_by_a_finished_import(tmp_path):
    """memory://: a failing import leaves the old buffer's objects as they were, a finished one
    replaces them; the partial location is gone either way."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = f"/{tmp_path.name}"
    dest = f"memory://{root}/b"

    def objects() -> dict[str, bytes]:
        return {path: fs.cat(path) for path in fs.find(root)}

    buf = dr.ReplayBuffer.create(dest, {"x": dr.Field((2,), "int16")}, chunk_rows=4)
    buf.extend({"x": np.arange(22).reshape(11, 2)})
    buf.close()
    before = objects()
    src, pattern = failing_npz(tmp_path)
    with pytest.raises(ImportFormatError, match=pattern):
        import_dataset(src, dest, batch_rows=4, chunk_rows=4, progress=False, overwrite=True)
    assert objects() == before
    np.savez(tmp_path / "good.npz", observations=np.arange(10.0).reshape(5, 2))
    new = import_dataset(tmp_path / "good.npz", dest, progress=False, overwrite=True)
    np.testing.assert_array_equal(new[np.arange(5)]["obs"], np.arange(10.0).reshape(5, 2))
    assert fs.ls(root, detail=False) == [f"{root}/b"]
    fs.rm(root, recursive=True)


def test_damaged_buffer_source_is_one_corrupt_buffer_error(tmp_path):
    """A diskreplay buffer as the source: a damaged chunk is its CorruptBufferError; nothing left behind."""
    buf = dr.ReplayBuffer.create(tmp_path / "src", {"x": dr.Field((3,), "float32")}, chunk_rows=8)
    buf.extend({"x": np.ones((40, 3))})
    buf.close()
    (tmp_path / "src" / "x" / "c.0.1.0").write_bytes(b"garbage")
    with pytest.raises(dr.CorruptBufferError, match=r"src': chunk 'x/c\.0\.1\.0' does not decode"):
        import_dataset(tmp_path / "src", tmp_path / "dest", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize("marker", [b'{"source": "a.h5", "started": 1e999, "pid": 7}', b'{"started": "x"}', b"[1]",
                                    b" " * (MAX_METADATA_BYTES + 1)])
def test_damaged_interrupted_import_marker_is_still_refused_clearly(tmp_path, marker):
    """An interrupted import's marker is read with a size cap and never trusted for its values."""
    from diskreplay.audit import INCOMPLETE_KEY

    dest = tmp_path / "dest"
    os.makedirs(dest)
    (dest / "zarr.json").write_text("{}")
    (dest / INCOMPLETE_KEY).write_bytes(marker)
    np.savez(tmp_path / "a.npz", observations=np.ones((5, 2)))
    with pytest.raises(dr.BufferExistsError, match=r"dest' holds an interrupted import \(from .*, started \?"):
        import_dataset(tmp_path / "a.npz", dest, progress=False)
    assert len(import_dataset(tmp_path / "a.npz", dest, progress=False, overwrite=True)) == 5


def test_cli_import_overwrite_of_a_failing_source_keeps_the_buffer(tmp_path):
    """`diskreplay import --overwrite` of a source damaged past its header: one error line, the
    existing buffer byte for byte, nothing else left."""
    import subprocess
    import sys

    src, _ = failing_npz(tmp_path)
    before = old_buffer(tmp_path / "old")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("DISKREPLAY_TRACEBACK", None)
    proc = subprocess.run([sys.executable, "-m", "diskreplay", "import", "--overwrite", "--no-progress",
                           "--batch-rows", "4", src, str(tmp_path / "old")], capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "bad.npz': observations.npy: corrupt data (Bad CRC-32" in proc.stderr
    assert dir_snapshot(str(tmp_path / "old")) == before
    assert sorted(os.listdir(tmp_path)) == ["bad.npz", "old"]


def test_other_datasets_metadata_json_does_not_stop_detection(tmp_path):
    """A metadata.json beside .npy files (not Minari's data/metadata.json) that is no JSON object."""
    folder = tmp_path / "npy"
    os.makedirs(folder)
    np.save(folder / "observations.npy", np.ones((5, 2)))
    (folder / "metadata.json").write_text("[1, 2]")
    assert len(import_dataset(folder, tmp_path / "dest", progress=False)) == 5


@pytest.mark.parametrize("kwargs, pattern", [
    ({"mode": "w"}, r"mode must be 'r' or 'r\+', got 'w'"),
    ({"mode": "a"}, r"mode must be 'r' or 'r\+', got 'a'"),
    ({"cache_bytes": -5}, r"cache_bytes must be an int >= 0, got -5"),
    ({"cache_bytes": "x"}, r"cache_bytes must be an int >= 0, got 'x'"),
    ({"batch_rows": 0}, r"batch_rows must be an int >= 1, got 0"),
    ({"chunk_rows": 0}, r"chunk_rows must be an int in \[1, 16777216\], got 0"),
    ({"compression": "bogus"}, r"compression must be one of"),
])
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, kwargs, pattern):
    """Also the returned buffer's mode and cache_bytes, which the import itself only uses at the end."""
    np.savez(tmp_path / "a.npz", observations=np.ones((5, 2)))
    with pytest.raises(ValueError, match=pattern):
        import_dataset(tmp_path / "a.npz", tmp_path / "dest", progress=False, **kwargs)
    assert sorted(os.listdir(tmp_path)) == ["a.npz"]

"""`check_int`, the one check of int arguments (counts, sizes, levels) every layer uses."""

import re

import numpy as np
import pytest

import diskreplay as dr
from diskreplay.checks import check_int


@pytest.mark.parametrize("value", [1, 7, np.int32(5), np.int64(1 << 40)])
def test_ints_in_range_pass_as_ints(value):
    got = check_int(value, "n", 1)
    assert got == int(value) and type(got) is int


@pytest.mark.parametrize("value", [0, -3, True, np.bool_(True), 1.0, "1", None, np.float64(2.0)])
def test_anything_else_is_named_with_what_was_expected(value):
    with pytest.raises(ValueError, match=rf"^seq_len must be an int >= 1, got {re.escape(repr(value))}$"):
        check_int(value, "seq_len", 1)


def test_a_closed_range():
    assert check_int(22, "compression_level", 0, 22) == 22
    with pytest.raises(ValueError, match=r"^compression_level must be an int in \[0, 22\], got 23$"):
        check_int(23, "compression_level", 0, 22)


@pytest.mark.parametrize("call, name", [
    (lambda buf: buf.sample(True), "batch_size"),
    (lambda buf: buf.sample(4, seq_len=True), "seq_len"),
    (lambda buf: buf.sample(4, n_step=True), "n_step"),
    (lambda buf: buf.sample(4, stack=True), "stack"),
    (lambda buf: buf.latest(True), "n"),
    (lambda buf: buf.sample_batches(4, True), "count"),
])
def test_a_bool_is_no_count_anywhere(tmp_path, call, name):
    fields = {"obs": dr.Field((2,), "float32"), "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}
    with dr.ReplayBuffer.create(str(tmp_path / "b"), fields, chunk_rows=8, episode_end="done") as buf:
        buf.extend({"obs": np.zeros((40, 2), np.float32), "reward": np.zeros(40, np.float32),
                    "done": np.arange(40) % 10 == 9})
        with pytest.raises(ValueError, match=rf"^{name} must be an int >= \d+, got True$"):
            call(buf)

"""add_screenshot: a trajectory stores each distinct screenshot once; steps reference them by index."""

from actors.episode import add_screenshot


def test_identical_bytes_reuse_the_earlier_index():
    shots: list[bytes] = []
    indices = [add_screenshot(shots, s) for s in (b"A", b"B", b"A", b"B", b"C", b"C")]
    assert indices == [0, 1, 0, 1, 2, 2]
    assert shots == [b"A", b"B", b"C"]


def test_every_index_points_at_the_bytes_that_were_added():
    shots: list[bytes] = []
    seen = [b"x" * 10, b"y" * 10, b"x" * 10, b"x" * 11]
    indices = [add_screenshot(shots, s) for s in seen]
    assert [shots[i] for i in indices] == seen
    assert len(shots) == 3

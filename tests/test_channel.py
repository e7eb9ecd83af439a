"""The parent-worker channel: JSON messages, and file descriptors only where the receiver asks."""

from __future__ import annotations

import array
import os
import socket
import threading

import pytest

from kbv import channel


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_message_with_descriptors_arrives_with_working_copies_of_them(pair) -> None:
    """How a dropped GPU worker hands device memory over: the descriptor travels beside the reply."""
    sender, receiver = pair
    read_end, write_end = os.pipe()
    channel.send(sender, {"ok": True, "outputs": {"fd_index": 0}}, fds=[read_end])
    os.close(read_end)  # the receiver holds its own copy now
    os.write(write_end, b"bytes")
    os.close(write_end)
    fds: list[int] = []
    assert channel.receive(receiver, fds=fds) == {"ok": True, "outputs": {"fd_index": 0}}
    assert len(fds) == 1 and os.read(fds[0], 16) == b"bytes"
    os.close(fds[0])


def test_descriptors_nobody_asked_for_are_closed_at_once(pair) -> None:
    """A hostile worker cannot fill the parent's descriptor table by sending them with any message."""
    sender, receiver = pair
    before = _open_fds()
    for _ in range(20):
        read_end, write_end = os.pipe()
        channel.send(sender, {"op": "hello"}, fds=[read_end, write_end])
        os.close(read_end)
        os.close(write_end)
        assert channel.receive(receiver) == {"op": "hello"}
    assert _open_fds() == before


def test_a_message_without_descriptors_and_a_large_one_still_arrive(pair) -> None:
    sender, receiver = pair
    channel.send(sender, {"n": 1})
    fds: list[int] = []
    assert channel.receive(receiver, fds=fds) == {"n": 1} and fds == []
    big = {"x": "y" * (3 << 20)}  # several reads, the descriptor on the first
    read_end, write_end = os.pipe()
    writer = threading.Thread(target=channel.send, args=(sender, big), kwargs={"fds": [read_end]})
    writer.start()
    assert channel.receive(receiver, fds=fds) == big
    writer.join()
    assert len(fds) == 1
    for fd in (read_end, write_end, *fds):
        os.close(fd)


def test_a_message_keeps_at_most_its_share_of_descriptors_however_it_is_cut(pair) -> None:
    """A hostile worker that sends descriptors with every piece of one long message leaves the
    parent at most ``MAX_FDS`` of them; the rest are closed as they arrive."""
    sender, receiver = pair
    before = _open_fds()
    read_end, write_end = os.pipe()
    payload = b'{"x": "' + b"y" * 64 + b'"}'
    sender.sendall(channel._HEADER.pack(len(payload)))
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [read_end] * 4).tobytes())]
    for i in range(0, len(payload), 8):  # eight-byte pieces, four descriptors with each
        sender.sendmsg([payload[i : i + 8]], rights)
    os.close(read_end)
    os.close(write_end)
    fds: list[int] = []
    assert channel.receive(receiver, fds=fds) == {"x": "y" * 64}
    assert len(fds) <= channel.MAX_FDS
    for fd in fds:
        os.close(fd)
    assert _open_fds() == before


def test_more_descriptors_than_a_message_may_carry_are_refused(pair) -> None:
    sender, _ = pair
    with pytest.raises(ValueError, match="descriptors"):
        channel.send(sender, {}, fds=[0] * (channel.MAX_FDS + 1))

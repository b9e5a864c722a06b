"""The simulator's processes' pipes (sim/parallel.py): pickled messages behind their length, each read in one
system call where it fits one read (a multiprocessing Connection reads a message's length and its body apart,
each through more Python, and two processes exchange a few messages a simulated request)."""

from __future__ import annotations

import os
import pickle
import select
import struct

_LEN = struct.Struct("<Q")  # a message's length, before it on the pipe
_READ = 1 << 16  # bytes one read asks for: a meeting's message whole


class Pipe:
    """One process's end of two pipes to another process (pair(): both ends, before the fork). A read may take
    the next message's start too (a peer can send two before one is read): kept for the next recv(), and
    readable() counts it."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd, self.write_fd = read_fd, write_fd
        self._rest = b""  # what a read took past its message

    @classmethod
    def pair(cls) -> tuple:
        a_read, b_write = os.pipe()
        b_read, a_write = os.pipe()
        return cls(a_read, a_write), cls(b_read, b_write)

    def send(self, obj) -> None:
        body = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        view = memoryview(_LEN.pack(len(body)) + body)
        while view:
            view = view[os.write(self.write_fd, view):]

    def recv(self):
        data = self._rest or self._read(_READ)
        while len(data) < _LEN.size:
            data += self._read(_READ)
        end = _LEN.size + _LEN.unpack_from(data)[0]
        if len(data) < end:
            data = bytearray(data)
            while len(data) < end:
                data += self._read(max(end - len(data), _READ))
        self._rest = bytes(data[end:])
        return pickle.loads(memoryview(data)[_LEN.size:end])

    def _read(self, n: int) -> bytes:
        data = os.read(self.read_fd, n)
        if not data:
            raise EOFError
        return data

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


def readable(pipes: list):
    """A check that a message waits on every one of `pipes`, read or not (Connection.poll builds a selector at
    every call, ~10 us; one poll object, asked with no timeout, is ~1 us)."""
    poller = select.poll()
    for p in pipes:
        poller.register(p.read_fd, select.POLLIN)

    def ready() -> bool:
        if any(p._rest for p in pipes):
            ready_fds = {fd for fd, _ in poller.poll(0)}
            return all(p._rest or p.read_fd in ready_fds for p in pipes)
        return len(poller.poll(0)) == len(pipes)
    return ready

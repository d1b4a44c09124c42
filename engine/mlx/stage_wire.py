"""The wire between MLX pipeline ranks (`mlx.stages`): joining MLX's ring, and messages around it.

`mlx.core.distributed`'s `ring` backend (TCP, any OS MLX runs on) connects each rank to its two
neighbours, so the pipeline is a ring: rank 0 -> 1 -> ... -> N-1 -> 0. Every message goes to the
next rank and comes from the previous one. The ring reads its peers from a hostfile, MLX's own
format: a JSON list with one entry per rank, each a list of "ip:port" strings (the addresses that
rank listens on), e.g. `[["192.168.1.10:35141"], ["192.168.1.11:35141"]]`.

A message is three sends: int64 sizes [header bytes, payload bytes], the JSON header as uint8, and
the payload as uint8 (an array's raw bytes; its dtype and shape in the header), so hidden states
and logits arrive with their exact bits (bfloat16 too). JSON headers: a peer can send data, never code.
`recv` has no timeout; a peer that exits makes it raise within about a second.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from agentfold.engine.stage_common import StageSetupError, first_line, parse_master

CONNECT_TIMEOUT_S = 600.0  # every rank loads the model before it joins: allow for a slow load
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def read_hostfile(path: str | Path, stages: int) -> list[list[str]]:
    """An MLX ring hostfile naming `stages` ranks (StageSetupError, one line, when it does not)."""
    try:
        hosts = json.loads(Path(path).expanduser().read_text())
    except OSError as error:
        raise StageSetupError(f"cannot read the hostfile {path}: {error.strerror or error}") from None
    except ValueError as error:
        raise StageSetupError(f"the hostfile {path} is not JSON ({error})") from None
    if not isinstance(hosts, list) or not all(isinstance(h, list) and h and all(isinstance(a, str) for a in h)
                                              for h in hosts):
        raise StageSetupError(f"the hostfile {path} must be a JSON list with one list of \"ip:port\" strings per "
                              'rank, e.g. [["10.0.0.1:35141"], ["10.0.0.2:35141"]]')
    if len(hosts) != stages:
        raise StageSetupError(f"the hostfile {path} names {len(hosts)} rank(s), --stages says {stages}")
    for addresses in hosts:
        for address in addresses:
            parse_master(address)
    return hosts


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` now (held open together, so they differ)."""
    probes = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for probe in probes:
            probe.bind((host, 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def write_local_hostfile(path: str | Path, stages: int) -> Path:
    """A hostfile for `stages` ranks on this machine (127.0.0.1, free ports)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(stages)]) + "\n")
    return path


def join_ring(rank: int, stages: int, hostfile: str | Path, timeout: float = CONNECT_TIMEOUT_S) -> Any:
    """This process's ring group as rank `rank` of `stages` (all ranks must call it; it blocks until
    the ring forms, at most `timeout` seconds). MLX's ring starts once per process."""
    read_hostfile(hostfile, stages)
    os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(rank), str(Path(hostfile).expanduser())
    done: dict[str, Any] = {}

    def init() -> None:
        try:
            done["group"] = mx.distributed.init(backend="ring", strict=True)
        except Exception as error:  # noqa: BLE001  (reported below as one line)
            done["error"] = error

    thread = threading.Thread(target=init, name="agentfold-ring-init", daemon=True)
    thread.start()
    thread.join(timeout)
    if "group" in done and done["group"].size() == stages:
        return done["group"]
    if "error" in done:
        detail = first_line(done["error"])
    elif "group" in done:
        detail = f"MLX formed a ring of {done['group'].size()}"
    else:
        detail = f"not every rank joined within {timeout:.0f}s"
    if rank == 0:
        raise StageSetupError(f"the MLX ring of {stages} ranks in {hostfile} did not form ({detail}); start the "
                              f"other ranks with `agentfold stage --backend mlx --rank N --stages {stages} "
                              "--hostfile FILE`")
    raise StageSetupError(f"rank {rank}: cannot join the MLX ring in {hostfile} ({detail})")


class RingWire:
    """Messages to the next rank and from the previous one: sizes, a JSON header, an array's bytes."""

    def __init__(self, group: Any) -> None:
        self.group = group
        rank, size = group.rank(), group.size()
        self.next, self.prev = (rank + 1) % size, (rank - 1) % size

    def send(self, header: dict[str, Any], array: mx.array | None = None) -> int:
        """Send one message to the next rank; returns the bytes sent."""
        payload = None
        if array is not None:
            header = {**header, "tensor": {"dtype": str(array.dtype).removeprefix("mlx.core."),
                                           "shape": list(array.shape)}}
            payload = mx.contiguous(array).reshape(-1).view(mx.uint8)
        data = json.dumps(header).encode()
        body = 0 if payload is None else payload.size
        sends = [mx.array(np.array([len(data), body], dtype=np.int64)), mx.array(np.frombuffer(data, dtype=np.uint8))]
        if body:
            sends.append(payload)
        for part in sends:
            mx.eval(mx.distributed.send(part, self.next, group=self.group))
        return 16 + len(data) + body

    def recv(self) -> tuple[dict[str, Any], mx.array | None, int]:
        """(header, array or None, bytes received) from the previous rank; RuntimeError when it is gone."""
        sizes = self._recv((2,), mx.int64)
        head, body = (int(n) for n in np.array(sizes))
        header = json.loads(bytes(np.array(self._recv((head,), mx.uint8))).decode())
        spec, array = header.pop("tensor", None), None
        if spec is not None:
            dtype = _DTYPES.get(spec["dtype"])
            if dtype is None:
                raise RuntimeError(f"rank {self.prev} sent a {spec['dtype']} array")
            raw = self._recv((body,), mx.uint8) if body else mx.zeros((0,), dtype=mx.uint8)
            array = raw.view(dtype).reshape(spec["shape"])
        return header, array, 16 + head + body

    def _recv(self, shape: tuple[int, ...], dtype: Any) -> mx.array:
        out = mx.distributed.recv(shape, dtype, self.prev, group=self.group)
        mx.eval(out)
        return out

"""The wire between pipeline ranks (`torch.stages`): joining the process group, and messages.

A message is three point-to-point sends on a process group made here (not the global default
group, so one process can hold several pipelines): sizes [header bytes, payload bytes], a JSON
header, and the optional tensor's raw bytes (its dtype and shape in the header), so hidden states
and logits arrive with their exact bits. JSON headers: a peer can send data, never code.
gloo (CPU tensors) is the tested transport; `nccl` (CUDA tensors) is written but has not run.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agentfold.engine.stage_common import StageError, StageSetupError, parse_master

__all__ = ["CONNECT_TIMEOUT_S", "IDLE_TIMEOUT", "REPLY_TIMEOUT", "TRANSPORTS", "StageError", "StageSetupError", "Wire",
           "connect", "parse_master"]

TRANSPORTS = ("gloo", "nccl")
CONNECT_TIMEOUT_S = 600.0  # every rank loads the model before it connects: allow for a slow load
REPLY_TIMEOUT = timedelta(hours=2)  # one exchange (a long prefill chunk on a slow stage)
IDLE_TIMEOUT = timedelta(days=3650)  # how long a stage waits for rank 0's next command
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _wait_for_port(host: str, port: int, timeout: float) -> None:
    """Block until rank 0 listens on host:port (a plain socket: no C++ retry log on stderr)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise StageSetupError(f"rank 0 did not listen on {host}:{port} within {timeout:.0f}s ({error}); "
                                      "start `agentfold serve --stages N` there first, or check the address") from None
            time.sleep(0.25)


def connect(rank: int, world: int, master: str, transport: str = "gloo",
            timeout: float = CONNECT_TIMEOUT_S) -> tuple[Any, Any]:
    """This rank's (store, process group) of the pipeline; rank 0 hosts the store at `master`."""
    if transport not in TRANSPORTS:
        raise StageSetupError(f"the stage transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
    host, port = parse_master(master)
    if _is_loopback(host) and "GLOO_SOCKET_IFNAME" not in os.environ:  # this machine only: stay on loopback
        names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
        if names:
            os.environ["GLOO_SOCKET_IFNAME"] = names[0]
    if rank > 0:
        _wait_for_port(host, port, timeout)
    limit = timedelta(seconds=timeout)
    try:
        store = dist.TCPStore(host, port, world, rank == 0, timeout=limit)
        if transport == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = limit
            group = dist.ProcessGroupNCCL(store, rank, world, options)
        else:
            group = dist.ProcessGroupGloo(store, rank, world, limit)
    except (RuntimeError, ValueError) as error:
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        if rank == 0:
            raise StageSetupError(f"the pipeline's {world - 1} other rank(s) did not all connect to {master} within "
                                  f"{timeout:.0f}s ({detail}); start them with `agentfold stage --rank N "
                                  f"--stages {world} --master ADDR:{port}`") from None
        raise StageSetupError(f"rank {rank}: cannot join the pipeline at {master} ({detail})") from None
    return store, group


class Wire:
    """Messages to and from one peer: sizes [header, payload], a JSON header, a tensor's raw bytes."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group, self.device = group, device  # device: where the transport wants tensors

    def send(self, peer: int, header: dict[str, Any], tensor: torch.Tensor | None = None) -> int:
        payload = None
        if tensor is not None:
            tensor = tensor.detach().contiguous()
            header = {**header, "tensor": {"dtype": str(tensor.dtype).removeprefix("torch."),
                                           "shape": list(tensor.shape)}}
            payload = tensor.reshape(-1).view(torch.uint8).to(self.device)
        data = json.dumps(header).encode()
        sizes = torch.tensor([len(data), 0 if payload is None else payload.numel()], dtype=torch.int64)
        self.group.send([sizes.to(self.device)], peer, 0).wait(REPLY_TIMEOUT)
        self.group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)], peer, 0).wait(
            REPLY_TIMEOUT)
        if payload is not None and payload.numel():
            self.group.send([payload], peer, 0).wait(REPLY_TIMEOUT)
        return 16 + len(data) + (0 if payload is None else payload.numel())

    def recv(self, peer: int, timeout: timedelta) -> tuple[dict[str, Any], torch.Tensor | None, int]:
        """(header, tensor or None, bytes received); RuntimeError when the peer is gone."""
        sizes = torch.empty(2, dtype=torch.int64, device=self.device)
        self.group.recv([sizes], peer, 0).wait(timeout)
        head, body = (int(n) for n in sizes.cpu())
        data = torch.empty(head, dtype=torch.uint8, device=self.device)
        self.group.recv([data], peer, 0).wait(REPLY_TIMEOUT)
        header = json.loads(bytes(data.cpu().numpy()).decode())
        spec, tensor = header.pop("tensor", None), None
        if spec is not None:
            dtype = _DTYPES.get(spec["dtype"])
            if dtype is None:
                raise RuntimeError(f"peer {peer} sent a {spec['dtype']} tensor")
            raw = torch.empty(body, dtype=torch.uint8, device=self.device)
            if body:
                self.group.recv([raw], peer, 0).wait(REPLY_TIMEOUT)
            tensor = raw.view(dtype).reshape(spec["shape"])
        return header, tensor, 16 + head + body

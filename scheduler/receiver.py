"""Rank 0 drains the front end's ZMQ socket; every rank gets the same list by gloo broadcast.

With pipeline parallelism the broadcast covers stage 0's TP group; the stages pass the list on
(scheduler/pipeline.py)."""

from __future__ import annotations

from typing import Any

import zmq

from model_executor.distributed.communicator import Communicator


class RequestReceiver:
    def __init__(self, world: Communicator, endpoint: str | None) -> None:
        """`world`: the ranks that get the list (rank 0 first). `endpoint` is bound on world rank 0
        only (the input rank); other ranks pass None."""
        self.world = world
        self.socket: zmq.Socket | None = None
        if endpoint is not None:
            self.context = zmq.Context(1)
            self.socket = self.context.socket(zmq.PULL)
            self.socket.bind(endpoint)

    def recv(self, wait_ms: int) -> list[Any]:
        """Messages that arrived since the last call, identical on every rank.

        wait_ms > 0 (idle) blocks rank 0 on its socket up to that long, so an idle server costs a
        few small broadcasts per second instead of a spinning loop. A list received is a batch of
        messages (the offline Engine's call), handed over in one step.
        """
        messages: list[Any] = []
        if self.socket is not None:
            if wait_ms > 0:
                self.socket.poll(wait_ms)
            while True:
                try:
                    message = self.socket.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if isinstance(message, list):
                    messages += message
                else:
                    messages.append(message)
        result = self.world.broadcast_pyobj(messages)
        assert isinstance(result, list)
        return result

"""The front end's half of SGLang's RL rollout protocol: weight updates from disk, the weights'
version, pause and continue (the ranks' half: scheduler/weight_registry.py; the routes:
srt/weights_api.py).

- An update is checked here first (a safetensors folder of the running model's config:
  srt/weight_checkpoint.py, a 400 naming `model_path`), then sent to every rank, which agree before
  the new weights serve. Updates run one at a time: a second waits for the first's reply.
- The version every reply's meta_info reports moves when the update's reply arrives, in order with
  the outputs (the ranks send every request's unsent tokens first), so an output computed after
  the swap reports it, and a finished request's `weight_versions` says which version produced
  which of its tokens (SGLang's spans).
- While paused, new requests wait here (as SGLang's TokenizerManager holds them); `abort` aborts
  every request in flight, `in_place` and `retract` stop the ranks' steps.
- A successful change is recorded for a restart (srt/frontend_recovery.py replays it).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from srt.generate_parse import RequestError
from srt.io_struct import (
    ContinueGenerationReq,
    ControlReply,
    PauseGenerationReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightVersionReq,
)
from srt.request_state import ServiceUnavailableError
from srt.weight_checkpoint import check_checkpoint

if TYPE_CHECKING:
    from srt.tokenizer_manager import TokenizerManager

PAUSE_MODES = ("abort", "retract", "in_place")


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _text(body: dict[str, Any], name: str, required: bool) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name} must be a non-empty string, got {value!r}", name)
    return value


class WeightUpdates:
    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm
        self.version = "default"  # SGLang's weight_version before any update names one
        self.paused = False
        self._unpaused: asyncio.Event | None = None  # made on the loop's first use
        self._lock: asyncio.Lock | None = None

    def _event(self) -> asyncio.Event:
        if self._unpaused is None:
            self._unpaused = asyncio.Event()
            self._unpaused.set()
        return self._unpaused

    async def until_unpaused(self) -> None:
        """Holds a new request back while generation is paused (ServiceUnavailableError once the
        server fails or shuts down meanwhile)."""
        event = self._event()
        while not event.is_set():
            if self.tm.refusal is not None:
                raise ServiceUnavailableError(self.tm.refusal)
            try:
                await asyncio.wait_for(event.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def replied(self, reply: ControlReply) -> None:
        """A rank's reply passing by: a weights' change carries the version it serves under. Every
        token a request in flight has now came before the change (the ranks sent them first), so
        each records the old version's end there (meta_info's weight_versions)."""
        version = reply.payload.get("weight_version") if reply.success else None
        if not isinstance(version, str):
            return
        for state in self.tm.rid_to_state.values():
            if state.finish_reason is None and state.output_ids:
                state.version_changes.append((self.version, len(state.output_ids)))
        self.version = version

    async def update_from_disk(self, body: dict[str, Any]) -> tuple[bool, str, int]:
        """SGLang's UpdateWeightFromDiskReqInput: (success, message, num_paused_requests);
        RequestError for what the front end refuses alone."""
        path = _text(body, "model_path", required=True)
        assert path is not None
        load_format = _text(body, "load_format", required=False)
        version = _text(body, "weight_version", required=False)
        abort_all = _flag(body, "abort_all_requests", False)
        if self.tm.server_args.quantization == "gguf":  # its linears are the file's blocks, not a folder's
            raise RequestError(
                "update_weights_from_disk needs a server without --quantization gguf", "model_path"
            )
        try:
            check_checkpoint(path, self.tm.model_info["model_path"], load_format)
        except ValueError as error:
            raise RequestError(str(error), "model_path") from None
        async with self._update_lock():
            if abort_all:
                self.tm.abort_all("aborted by /update_weights_from_disk (abort_all_requests)")
            reply = await self.tm.control(lambda rid: UpdateWeightsFromDiskReq(rid, path, version))
            if reply.success:
                self.tm.model_info["model_path"] = path
                self.tm.recovery.record_weights(path, self.version)
        return (
            reply.success,
            str(reply.payload.get("message")),
            int(reply.payload.get("num_paused_requests", 0)),
        )

    async def update_version(self, body: dict[str, Any]) -> str:
        """SGLang's UpdateWeightVersionReqInput; the new version."""
        version = _text(body, "new_version", required=True)
        assert version is not None
        abort_all = _flag(body, "abort_all_requests", True)
        async with self._update_lock():
            if abort_all:
                self.tm.abort_all("aborted by /update_weight_version (abort_all_requests)")
            reply = await self.tm.control(lambda rid: UpdateWeightVersionReq(rid, version))
            if not reply.success:
                raise RequestError(str(reply.payload.get("message")), "new_version")
            self.tm.recovery.record_weights(None, version)
        return version

    async def pause(self, body: dict[str, Any]) -> None:
        """SGLang's PauseGenerationReqInput: `abort` (the default) aborts every request in flight,
        `in_place` keeps them with their KV, `retract` puts them back in the queue with their
        tokens; in every mode new requests wait until continue."""
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", "mode")
        self.paused = True
        self._event().clear()
        if mode == "abort":
            self.tm.abort_all("aborted by /pause_generation")
        else:
            await self.tm.control(lambda rid: PauseGenerationReq(rid, mode))
            self.tm.recovery.paused = True  # a restart holds the new engine's steps too

    async def resume(self) -> None:
        """SGLang's /continue_generation: steps run again, held requests go (harmless unpaused)."""
        await self.tm.control(ContinueGenerationReq)
        self.paused = self.tm.recovery.paused = False
        self._event().set()

    def _update_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

"""Detokenizer process: token ids from the output rank -> text pieces for the TokenizerManager.

Decoding is incremental per request (SGLang style). Each step decodes only a window of ids:

    output ids:  |---- already decoded ----|-- surrounding --|-- new --|
                                            ^prefix_offset   ^read_offset

and emits decode(surrounding + new) minus decode(surrounding). A piece that ends in U+FFFD is an
incomplete UTF-8 character: it is held back until more ids arrive, so no streamed piece ever
carries a broken character. While a request streams, the tail of its text that could still grow
into one of its stop strings is held back too, so a stop string the scheduler matches later has
never been emitted; when the request finishes on a stop string the text is cut before it.

A request replayed after an engine restart arrives with what its client already has
(ResumeState): the state is rebuilt from those ids, minus an incomplete character at their end,
and only the text past the characters delivered is emitted, so nothing is sent twice.
"""

from __future__ import annotations

import logging
import os
import re
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from srt.io_struct import BatchStrOut, BatchTokenIDOut, DecodeSpec, FinishReason, ResumeState
from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger("srt.detokenizer")

REPLACEMENT_CHAR = "\ufffd"
RESUME_SURROUNDING = 5  # ids of context kept before a resumed request's new ones (as SGLang's first window)


@dataclass
class DecodeState:
    output_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # decoded text confirmed so far (complete characters only until finished)
    sent_len: int = 0  # characters of `text` already emitted
    spec: DecodeSpec = field(default_factory=DecodeSpec)


def stop_holdback_start(text: str, start: int, stop_strings: list[str]) -> int:
    """Where the emittable part of `text[start:]` ends: before the first full stop string, or
    before the longest tail that is a proper prefix of a stop string (it may still become one)."""
    end = len(text)
    for stop in stop_strings:
        found = text.find(stop, start)
        if found != -1:
            end = min(end, found)
        for k in range(min(len(stop) - 1, len(text) - start), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return end


class DetokenizerManager:
    """Turns BatchTokenIDOut into BatchStrOut. Pure apart from the tokenizer; keeps per-rid state
    until the rid finishes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def _decode(self, ids_batch: list[list[int]], specs: list[DecodeSpec]) -> list[str]:
        """One batch_decode per distinct set of the requests' text options."""
        texts = [""] * len(ids_batch)
        groups: dict[tuple[bool, bool], list[int]] = {}
        for i, spec in enumerate(specs):
            groups.setdefault((spec.skip_special_tokens, spec.spaces_between_special_tokens), []).append(i)
        for (skip, spaces), rows in groups.items():
            decoded = self.tokenizer.batch_decode(
                [ids_batch[i] for i in rows], skip_special_tokens=skip, spaces_between_special_tokens=spaces
            )
            for i, text in zip(rows, decoded):
                texts[i] = str(text)
        return texts

    def handle_batch_token_id_out(self, out: BatchTokenIDOut) -> BatchStrOut:
        states = []
        for i, (rid, new_ids) in enumerate(zip(out.rids, out.new_token_ids)):
            spec = out.decode_specs[i] if i < len(out.decode_specs) else None
            state = self.states.get(rid)
            if state is None:
                resume = out.resumes[i] if i < len(out.resumes) else None
                spec = spec or DecodeSpec()
                state = self.states[rid] = (
                    self._resumed(resume, spec) if resume is not None else DecodeState(spec=spec)
                )
            elif spec is not None:
                state.spec = spec
            finished = out.finished_reasons[i]
            if _trims_stop_token(finished, state.spec, new_ids):
                new_ids = new_ids[:-1]  # as SGLang: the stop token's text is not part of the output
            state.output_ids.extend(new_ids)
            states.append(state)
        specs = [s.spec for s in states]
        surrounding = self._decode([s.output_ids[s.prefix_offset : s.read_offset] for s in states], specs)
        window = self._decode([s.output_ids[s.prefix_offset :] for s in states], specs)

        texts = []
        for i, state in enumerate(states):
            finished = out.finished_reasons[i]
            piece = window[i][len(surrounding[i]) :]
            if finished is not None or (piece and not piece.endswith(REPLACEMENT_CHAR)):
                state.text += piece
                state.prefix_offset = state.read_offset
                state.read_offset = len(state.output_ids)
            texts.append(self._emit(state, finished))
            if finished is not None:
                del self.states[out.rids[i]]
        return BatchStrOut(
            rids=list(out.rids),
            texts=texts,
            new_token_ids=[list(ids) for ids in out.new_token_ids],
            finished_reasons=list(out.finished_reasons),
            prompt_tokens=list(out.prompt_tokens),
            completion_tokens=list(out.completion_tokens),
            cached_tokens=list(out.cached_tokens),
            output_logprobs=out.output_logprobs,
            input_logprobs=out.input_logprobs,
            routed_experts=out.routed_experts,
            embeddings=out.embeddings,
        )

    def _resumed(self, resume: ResumeState, spec: DecodeSpec) -> DecodeState:
        """The state a request would have after its delivered ids: their text (without an
        incomplete character at the end, which stays in the window), of which text_len
        characters were sent."""
        ids = list(resume.output_ids)
        read_offset = len(ids)
        text = self._decode([ids], [spec])[0]
        while read_offset > 0 and text.endswith(REPLACEMENT_CHAR) and len(ids) - read_offset < 4:
            read_offset -= 1  # a UTF-8 character spans at most 4 byte tokens
            text = self._decode([ids[:read_offset]], [spec])[0]
        return DecodeState(
            output_ids=ids,
            prefix_offset=max(read_offset - RESUME_SURROUNDING, 0),
            read_offset=read_offset,
            text=text,
            sent_len=min(resume.text_len, len(text)),
            spec=spec,
        )

    @staticmethod
    def _emit(state: DecodeState, finished: FinishReason | None) -> str:
        spec = state.spec
        end = len(state.text)
        if finished is None:
            end = stop_holdback_start(state.text, state.sent_len, list(spec.stop_strings))
        elif finished.type == "stop" and isinstance(finished.matched, str):
            # the text ends before the stop string (or regex match), or, with no_stop_trim, after it
            if finished.regex:
                match = re.search(finished.matched, state.text)
                span = match.span() if match else None
            else:
                found = state.text.find(finished.matched, state.sent_len)
                span = (found, found + len(finished.matched)) if found != -1 else None
            if span is not None:
                end = span[1] if spec.no_stop_trim else span[0]
        end = max(end, state.sent_len)
        piece = state.text[state.sent_len : end]
        state.sent_len = end
        return piece


def _trims_stop_token(finished: FinishReason | None, spec: DecodeSpec, new_ids: list[int]) -> bool:
    return (
        finished is not None
        and finished.type == "stop"
        and isinstance(finished.matched, int)
        and not spec.no_stop_trim
        and bool(new_ids)
        and new_ids[-1] == finished.matched
    )


def run_detokenizer_process(
    server_args: ServerArgs, port_args: PortArgs, tokenizer_path: str, ready_conn: Connection
) -> None:
    """Process entry (the launcher sets the title, logging and parent-death wiring). Reports
    ("ready", {}) or ("error", traceback) on `ready_conn`, then serves until killed or until its
    parent (the main process) is gone."""
    parent_pid = os.getppid()
    try:
        from srt.tokenizer_loader import load_tokenizer

        manager = DetokenizerManager(load_tokenizer(tokenizer_path))
        context = zmq.Context(2)
        recv_sock = context.socket(zmq.PULL)
        recv_sock.bind(port_args.detokenizer_ipc)
        send_sock = context.socket(zmq.PUSH)
        send_sock.setsockopt(zmq.SNDHWM, 0)
        send_sock.connect(port_args.tokenizer_manager_ipc)
    except Exception:
        ready_conn.send(("error", traceback.format_exc()))
        ready_conn.close()
        raise SystemExit(1) from None
    ready_conn.send(("ready", {}))
    ready_conn.close()

    while True:
        if not recv_sock.poll(timeout=1000):
            if os.getppid() != parent_pid:
                logger.error("the main process is gone; exiting")
                raise SystemExit(1)
            continue
        msg = recv_sock.recv_pyobj()
        if isinstance(msg, BatchTokenIDOut):
            msg = manager.handle_batch_token_id_out(msg)
        send_sock.send_pyobj(msg)

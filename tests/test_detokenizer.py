"""Incremental detokenization: streamed pieces never split a character, add up to the full decode,
and never leak any part of a stop string."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import zmq
from transformers import AutoTokenizer

from srt.detokenizer import DetokenizerManager, run_detokenizer_process, stop_holdback_start
from srt.io_struct import BatchStrOut, BatchTokenIDOut, ControlReply, DecodeSpec, FinishReason, ResumeState
from srt.server_args import PortArgs, ServerArgs

MULTIBYTE = "Hello 😀👍🏽 世界，你好！ naïve café — ∑ 🇫🇷 done."


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def step(
    rid: str,
    ids: list[int],
    finished: FinishReason | None = None,
    stop: list[str] | None = None,
    done: int = 0,
) -> BatchTokenIDOut:
    return BatchTokenIDOut(
        rids=[rid],
        new_token_ids=[ids],
        finished_reasons=[finished],
        prompt_tokens=[5],
        completion_tokens=[done + len(ids)],
        cached_tokens=[0],
        decode_specs=[DecodeSpec(tuple(stop or ()))],
    )


def stream(
    manager: DetokenizerManager,
    rid: str,
    ids: list[int],
    chunk: int = 1,
    last: FinishReason | None = None,
    stop: list[str] | None = None,
) -> list[str]:
    pieces = []
    for start in range(0, len(ids), chunk):
        finished = (last or FinishReason("length")) if start + chunk >= len(ids) else None
        out = manager.handle_batch_token_id_out(step(rid, ids[start : start + chunk], finished, stop, start))
        assert out.rids == [rid] and out.new_token_ids == [ids[start : start + chunk]]
        pieces.append(out.texts[0])
    return pieces


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_stream_is_whole_characters_and_adds_up(tokenizer, chunk: int) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    # The emoji and CJK characters really are split across tokens in this vocabulary.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    manager = DetokenizerManager(tokenizer)
    pieces = stream(manager, "r", ids, chunk)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == MULTIBYTE
    assert manager.states == {}  # forgotten once finished


def test_special_tokens_are_skipped(tokenizer) -> None:
    ids = tokenizer.encode("Hi there")
    manager = DetokenizerManager(tokenizer)
    pieces = stream(manager, "r", [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id])
    assert "".join(pieces) == "Hi there"


def test_interleaved_requests_keep_separate_state(tokenizer) -> None:
    a, b = tokenizer.encode("世界 😀 abc"), tokenizer.encode("Bonjour, ça va ?")
    manager = DetokenizerManager(tokenizer)
    texts: dict[str, str] = {"a": "", "b": ""}
    for i in range(max(len(a), len(b))):
        rids, new, fin = [], [], []
        for rid, ids in (("a", a), ("b", b)):
            if i < len(ids):
                rids.append(rid)
                new.append([ids[i]])
                fin.append(FinishReason("length") if i == len(ids) - 1 else None)
        out = manager.handle_batch_token_id_out(
            BatchTokenIDOut(rids, new, fin, [1] * len(rids), [i + 1] * len(rids), [0] * len(rids))
        )
        for rid, text in zip(out.rids, out.texts):
            assert "\ufffd" not in text
            texts[rid] += text
    assert texts == {"a": "世界 😀 abc", "b": "Bonjour, ça va ?"}
    assert manager.states == {}


def scheduler_run(tokenizer, ids: list[int], stop: str) -> tuple[list[int], FinishReason]:
    """What the scheduler sends: ids up to (including) the token that completes `stop`."""
    for n in range(1, len(ids) + 1):
        if stop in tokenizer.decode(ids[:n], skip_special_tokens=True):
            return ids[:n], FinishReason("stop", matched=stop)
    raise AssertionError(f"{stop!r} never appears")


@pytest.mark.parametrize(
    "text, stop",
    [
        ("The answer is forty-two, my friend.", "forty-two"),  # spans several tokens
        ("The answer is forty-two, my friend.", "swer is fo"),  # starts and ends inside tokens
        ("Count: 世界😀 end", "界😀"),  # multi-byte stop string split across byte tokens
        ("Hello world order, then world peace.", "world peace"),  # an earlier partial match is released
    ],
)
def test_stop_string_is_never_streamed(tokenizer, text: str, stop: str) -> None:
    ids, reason = scheduler_run(tokenizer, tokenizer.encode(text), stop)
    expected = text[: text.index(stop)]
    for chunk in (1, 2):
        manager = DetokenizerManager(tokenizer)
        pieces = stream(manager, "r", ids, chunk, last=reason, stop=[stop, "never-seen"])
        emitted = ""
        for piece in pieces:
            emitted += piece
            assert expected.startswith(emitted), f"streamed {emitted!r} beyond {expected!r}"
        assert emitted == expected


def test_partial_stop_tail_is_released_when_not_stopped(tokenizer) -> None:
    ids = tokenizer.encode("Hello world order")
    pieces = stream(
        DetokenizerManager(tokenizer), "r", ids, last=FinishReason("length"), stop=["world peace"]
    )
    assert "".join(pieces) == "Hello world order"


def test_stop_holdback_start() -> None:
    assert stop_holdback_start("abc wor", 0, ["world"]) == 4
    assert stop_holdback_start("abc world!", 0, ["world"]) == 4
    assert stop_holdback_start("abc wx", 0, ["world"]) == 6
    assert stop_holdback_start("abc wor", 6, ["world"]) == 7  # only the unsent tail "r" counts
    assert stop_holdback_start("ab wo", 3, ["xy", "world"]) == 3
    assert stop_holdback_start("aaa", 0, []) == 3


@pytest.mark.parametrize(("text", "stop"), [(MULTIBYTE, None), ("Count: 世界😀 then the end.", "the end")])
def test_a_restarted_detokenizer_continues_a_resumed_text(tokenizer, text: str, stop: str | None) -> None:
    """After an engine restart, a fresh detokenizer seeded with what the client has emits the rest
    of the text exactly once, whatever token the old one died after (mid-character, mid-stop)."""
    ids, reason = (
        scheduler_run(tokenizer, tokenizer.encode(text), stop) if stop else (tokenizer.encode(text), None)
    )
    stops = [stop] if stop else []
    expected = "".join(stream(DetokenizerManager(tokenizer), "r", ids, last=reason, stop=stops))
    for cut in range(1, len(ids)):
        old = DetokenizerManager(tokenizer)
        sent = "".join(
            old.handle_batch_token_id_out(step("r", [i], None, stops, k)).texts[0]
            for k, i in enumerate(ids[:cut])
        )
        new = DetokenizerManager(tokenizer)
        rest = ""
        for k in range(cut, len(ids)):
            msg = step(
                "r", [ids[k]], (reason or FinishReason("length")) if k == len(ids) - 1 else None, stops, k
            )
            if k == cut:
                msg.resumes = [ResumeState(ids[:cut], len(sent))]
            rest += new.handle_batch_token_id_out(msg).texts[0]
        assert "\ufffd" not in rest and sent + rest == expected, cut


def test_abort_of_unknown_rid_is_an_empty_final_piece(tokenizer) -> None:
    manager = DetokenizerManager(tokenizer)
    out = manager.handle_batch_token_id_out(step("gone", [], FinishReason("abort", message="client left")))
    assert out.texts == [""] and out.finished_reasons == [FinishReason("abort", message="client left")]
    assert manager.states == {}


def test_process_translates_and_forwards(tmp_path: Path, smollm2_dir: Path, tokenizer) -> None:
    port_args = PortArgs(
        tokenizer_ipc=f"ipc://{tmp_path}/t",
        detokenizer_ipc=f"ipc://{tmp_path}/d",
        tokenizer_manager_ipc=f"ipc://{tmp_path}/tm",
        dist_init_method="tcp://127.0.0.1:1",
    )
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(port_args.tokenizer_manager_ipc)
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=run_detokenizer_process,
        args=(ServerArgs(), port_args, str(smollm2_dir), child_conn),
        daemon=True,
    )
    proc.start()
    try:
        assert parent_conn.poll(120), "detokenizer did not report"
        assert parent_conn.recv() == ("ready", {})
        push = context.socket(zmq.PUSH)
        push.connect(port_args.detokenizer_ipc)
        ids = tokenizer.encode("😀 ok")
        push.send_pyobj(step("r", ids, FinishReason("length")))
        push.send_pyobj(ControlReply("c1", True, {"x": 1}))
        assert pull.poll(30_000)
        out = pull.recv_pyobj()
        assert isinstance(out, BatchStrOut) and out.texts == ["😀 ok"]
        assert pull.poll(30_000)
        assert pull.recv_pyobj() == ControlReply("c1", True, {"x": 1})
    finally:
        proc.kill()
        proc.join()
        context.destroy(linger=0)


def test_process_reports_a_bad_tokenizer_path(tmp_path: Path) -> None:
    port_args = PortArgs.create("tcp://127.0.0.1:1")
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=run_detokenizer_process,
        args=(ServerArgs(), port_args, str(tmp_path / "missing"), child_conn),
        daemon=True,
    )
    proc.start()
    assert parent_conn.poll(120)
    kind, detail = parent_conn.recv()
    proc.join(30)
    assert kind == "error" and "missing" in detail and proc.exitcode == 1

"""The radix cache's tier on disk (mem_cache/disk_tier.py): its files, and a scheduler that
restores a prefix from another's files with the outputs of recomputation."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import requests
import torch
from scheduler_harness import Harness
from server_fixture import Server

from mem_cache import disk_tier
from mem_cache.disk_tier import DiskTier
from mem_cache.kv_pool import PagedKVPool
from mem_cache.radix_cache import BASE, Namespace
from srt.io_struct import ControlReply, FlushCacheReq
from srt.sampling_params import SamplingParams
from srt.server_args import ServerArgs

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
PROMPT = [(7 * i + 3) % 200 + 1 for i in range(150)]  # two whole blocks of 64 and a tail


def _pool(page_size: int = 4, dtype: torch.dtype = torch.bfloat16) -> PagedKVPool:
    return PagedKVPool(64, page_size, num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype)


def _tier(directory: Path, identity: object = "m", **kwargs: object) -> DiskTier:
    pool = kwargs.pop("pool", None) or _pool()
    return DiskTier(directory, {"model": identity}, pool, **kwargs)  # type: ignore[arg-type]


def _fill(tier: DiskTier, tokens: int) -> torch.Tensor:
    """Random KV in the pool's first `tokens` slots; returns the slots."""
    slots = torch.arange(tokens)
    for layer in range(tier.pool.num_layers):
        k = torch.randn(tokens, tier.pool.num_kv_heads, tier.pool.head_dim)
        tier.pool.set_kv_buffer(layer, slots, k, -k)
    return slots


def test_blocks_round_trip_and_keys_name_the_whole_prefix(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    t = tier.block_tokens
    ids = list(range(1, 2 * t + 1))
    names = tier.block_names(BASE, ids, 2)
    slots = _fill(tier, 2 * t)
    tier.submit(names, slots)
    tier.flush()
    assert sorted(os.listdir(tmp_path)) == sorted(names)
    blocks = tier.read(names)
    k, v = tier.pool.get_kv_buffer(1)
    assert torch.equal(blocks[1][1, 0], k[t : 2 * t]) and torch.equal(blocks[1][1, 1], v[t : 2 * t])
    # a block's name covers every token before it, and the namespace
    other = tier.block_names(BASE, [9, *ids[1:]], 2)
    assert other[0] != names[0] and other[1] != names[1]
    assert tier.block_names(Namespace(adapter=1), ids, 2)[0] != names[0]
    assert tier.block_names(BASE, ids, 1) == names[:1]


def test_another_identity_never_reads_the_files(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    names = tier.block_names(BASE, list(range(tier.block_tokens)), 1)
    tier.submit(names, _fill(tier, tier.block_tokens))
    tier.flush()
    for other in (_tier(tmp_path, "m2"), _tier(tmp_path, pool=_pool(page_size=8))):
        theirs = other.block_names(BASE, list(range(tier.block_tokens)), 1)
        assert theirs != names and other.read(theirs) == []
        assert other.bytes_on_disk() == 0  # nor are they counted as its files
    # a foreign file under the name this tier asks for: a miss, and deleted
    (tmp_path / "x").write_bytes((tmp_path / names[0]).read_bytes())
    foreign = _tier(tmp_path, "m2")
    theirs = foreign.block_names(BASE, list(range(tier.block_tokens)), 1)
    os.replace(tmp_path / "x", tmp_path / theirs[0])
    assert foreign.read(theirs) == [] and not (tmp_path / theirs[0]).exists()
    assert foreign.stats.bad_blocks == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_file_is_a_miss_and_deleted(tmp_path: Path, damage: str) -> None:
    tier = _tier(tmp_path)
    t = tier.block_tokens
    names = tier.block_names(BASE, list(range(3 * t)), 3)
    tier.submit(names, _fill(tier, 3 * t))
    tier.flush()
    path = tmp_path / names[1]
    data = path.read_bytes()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data = data[:-100] + bytes([data[-100] ^ 1]) + data[-99:]
    else:
        data = b""
    path.write_bytes(data)
    fresh = _tier(tmp_path)  # as after a restart
    assert len(fresh.read(names)) == 1  # the blocks before it only
    assert not path.exists() and fresh.stats.bad_blocks == 1


def test_least_recently_used_files_go_past_the_bound(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    t = tier.block_tokens
    names = tier.block_names(BASE, list(range(4 * t)), 4)
    slots = _fill(tier, 4 * t)
    tier.submit(names[:2], slots[: 2 * t])
    tier.flush()
    size = (tmp_path / names[0]).stat().st_size
    bounded = _tier(tmp_path, max_bytes=3 * size)
    assert bounded.read(names[:1])  # the first block is now the most recently used
    bounded.submit(names, slots)
    bounded.flush()
    assert sorted(os.listdir(tmp_path)) == sorted([names[0], names[2], names[3]])
    assert bounded.bytes_on_disk() == 3 * size and bounded.stats.evicted_blocks == 1


def test_two_writers_of_one_block_leave_one_whole_file(tmp_path: Path) -> None:
    """Two servers (replicas) on one directory write the same block: each write is atomic, the
    file is whole, and either server reads it."""
    tiers = [_tier(tmp_path), _tier(tmp_path)]
    names = tiers[0].block_names(BASE, list(range(tiers[0].block_tokens)), 1)
    for tier in tiers:
        tier.submit(names, _fill(tier, tier.block_tokens))
    for tier in tiers:
        tier.flush()
    assert os.listdir(tmp_path) == names
    assert all(len(tier.read(names)) == 1 for tier in tiers)


def test_a_write_past_the_queues_bytes_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies waiting for the writer are bounded in bytes: past it a write is dropped (a miss
    later), the step never waits and the host's memory never grows with a slow disk."""
    tier = _tier(tmp_path)
    t = tier.block_tokens
    names = tier.block_names(BASE, list(range(2 * t)), 2)
    monkeypatch.setattr(disk_tier, "WRITE_QUEUE_BYTES", tier._block_shape().numel() * 2)  # one block
    tier.submit(names, _fill(tier, 2 * t))
    tier.submit(names[:1], _fill(tier, t))
    tier.flush()
    assert tier.stats.dropped_writes == 1 and os.listdir(tmp_path) == names[:1]


def test_a_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that fails mid-file leaves no file under the block's name and no temporary file."""
    tier = _tier(tmp_path)
    names = tier.block_names(BASE, list(range(tier.block_tokens)), 1)

    def fail(self: Path, data: bytes) -> int:
        Path.open(self, "wb").write(data[:10])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_bytes", fail)
    tier.submit(names, _fill(tier, tier.block_tokens))
    tier.flush()
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert tier.read(names) == []


def test_only_the_file_backend_with_the_radix_cache() -> None:
    with pytest.raises(ValueError, match="needs --hicache-storage-backend file"):
        ServerArgs(enable_hierarchical_cache=True)
    with pytest.raises(ValueError, match="--hicache-storage-backend mooncake is not implemented"):
        ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="mooncake")
    with pytest.raises(ValueError, match="--hicache-write-policy write_back is not supported"):
        ServerArgs(
            enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_write_policy="write_back"
        )
    with pytest.raises(ValueError, match="not with --enable-return-routed-experts"):
        ServerArgs(
            enable_hierarchical_cache=True, hicache_storage_backend="file", enable_return_routed_experts=True
        )
    with pytest.raises(ValueError, match="not with --disable-radix-cache"):
        ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="file", disable_radix_cache=True)
    args = ServerArgs(
        enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_max_size="2Gi"
    )
    assert args.hicache_max_bytes == 2 * 2**30


def _serve(
    model_dir: Path, directory: Path | None, rid: str, prompt: list[int] = PROMPT, **kwargs: object
) -> Harness:
    hicache = (
        {}
        if directory is None
        else {
            "enable_hierarchical_cache": True,
            "hicache_storage_backend": "file",
            "hicache_storage_dir": str(directory),
        }
    )
    h = Harness(model_dir, dtype="bfloat16", max_total_tokens=1024, **hicache, **kwargs)  # type: ignore[arg-type]
    h.submit(rid, prompt, GREEDY)
    h.run_until_idle()
    assert h.integrity_error() is None
    return h


@pytest.mark.parametrize(("page_size", "block", "restored"), [(4, 64, 128), (48, 96, 96)])
def test_blocks_are_whole_pages(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, page_size: int, block: int, restored: int
) -> None:
    """A block is 64 tokens rounded up to whole pages (96 with pages of 48): restored whole, the
    outputs those of the cold server at the same page size."""
    cold = _serve(tiny_model_dirs["llama"], tmp_path, "cold", page_size=page_size)
    disk = cold.scheduler.kv.disk
    assert disk is not None and disk.block_tokens == block
    disk.flush()
    warm = _serve(tiny_model_dirs["llama"], tmp_path, "warm", page_size=page_size)
    assert warm.meta["warm"]["cached_tokens"] == restored and warm.tokens["warm"] == cold.tokens["cold"]


def test_a_prefix_partly_in_the_tree_and_not_on_disk_is_computed(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The tree holds the first 40 tokens (inside the first block) and the disk nothing past them:
    the rest is computed, the outputs those of a server without the cache."""
    plain = _serve(tiny_model_dirs["llama"], None, "plain")
    h = _serve(tiny_model_dirs["llama"], tmp_path, "short", prompt=PROMPT[:40])
    h.submit("long", PROMPT, GREEDY)
    h.run_until_idle()
    assert h.meta["long"]["cached_tokens"] == 40 and h.tokens["long"] == plain.tokens["plain"]
    assert h.integrity_error() is None


def test_a_new_scheduler_restores_the_prefix_with_recomputations_outputs(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    model = tiny_model_dirs["llama"]
    plain = _serve(model, None, "plain")
    first = _serve(model, tmp_path, "first")
    assert first.meta["first"]["cached_tokens"] == 0
    assert first.scheduler.kv.disk is not None
    first.scheduler.kv.disk.flush()
    second = _serve(model, tmp_path, "second")  # a restart: an empty radix cache, the same directory
    assert second.meta["second"]["cached_tokens"] == 128  # two whole blocks of the 150-token prompt
    assert second.tokens["second"] == first.tokens["first"] == plain.tokens["plain"]
    # one block corrupted: the prefix before it is restored, the rest recomputed, the same outputs
    disk = second.scheduler.kv.disk
    assert disk is not None
    names = disk.block_names(BASE, PROMPT, 2)
    path = tmp_path / names[1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    third = _serve(model, tmp_path, "third")
    assert third.meta["third"]["cached_tokens"] == 64
    assert third.tokens["third"] == plain.tokens["plain"]
    assert third.scheduler.internal_state()["disk_tier"]["bad_blocks"] == 1
    third_disk = third.scheduler.kv.disk
    assert third_disk is not None
    third_disk.flush()  # the corrupt file was deleted, and the block written again from the recomputed KV
    assert path.read_bytes() != bytes(data) and len(third_disk.read(names)) == 2
    # a prefix partly in the tree already: the blocks from disk fill in past it
    fifth = _serve(model, tmp_path, "short", prompt=PROMPT[:40])
    fifth.submit("fifth", PROMPT, GREEDY)
    fifth.run_until_idle()
    assert fifth.meta["fifth"]["cached_tokens"] == 128 and fifth.tokens["fifth"] == plain.tokens["plain"]
    assert fifth.scheduler.internal_state()["disk_tier"]["hit_tokens"] == 128 - 40
    # another page size is another identity: none of these files is read
    fourth = _serve(model, tmp_path, "fourth", page_size=4)
    assert fourth.meta["fourth"]["cached_tokens"] == 0


def test_a_prompt_reaches_the_disk_before_its_request_ends(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    hicache = {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}
    h = Harness(
        tiny_model_dirs["llama"],
        dtype="bfloat16",
        max_total_tokens=1024,
        enable_hierarchical_cache=True,
        **hicache,
    )
    h.submit("long", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=64))
    for _ in range(3):  # the prefill and two decode steps
        h.scheduler.step()
    disk = h.scheduler.kv.disk
    assert disk is not None
    disk.flush()
    assert h.scheduler.has_work() and len(list(tmp_path.glob("*.kv"))) == 2


def test_prefixes_under_updated_weights_stay_off_the_disk(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The files name the weights the server started with: after a weight update (epoch 1) no
    prefix is written or read, so another server's life never serves its KV."""
    h = _serve(tiny_model_dirs["llama"], tmp_path, "base")
    disk = h.scheduler.kv.disk
    assert disk is not None
    disk.flush()
    written = sorted(os.listdir(tmp_path))
    h.scheduler.weights.epoch = 1  # as a successful /update_weights_from_disk leaves it
    h.send(FlushCacheReq("flush"))
    h.submit("updated", PROMPT[::-1], GREEDY)
    h.submit("same", PROMPT, GREEDY)
    h.run_until_idle()
    disk.flush()
    assert h.meta["same"]["cached_tokens"] == 0 and disk.stats.read_blocks == 0
    assert sorted(os.listdir(tmp_path)) == written


def test_flush_cache_keeps_the_files_and_clearing_the_storage_backend_deletes_them(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    h = _serve(tiny_model_dirs["llama"], tmp_path, "r")
    disk = h.scheduler.kv.disk
    assert disk is not None
    disk.flush()
    outputs: list[object] = []
    send = h.scheduler.send_output
    assert send is not None
    h.scheduler.send_output = lambda out: (outputs.append(out), send(out))[1]
    h.send(FlushCacheReq("flush"))  # the radix cache only, as SGLang's /flush_cache
    h.submit("again", PROMPT, GREEDY)
    h.run_until_idle()
    assert h.meta["again"]["cached_tokens"] == 128 and disk.stats.hit_tokens == 128
    h.send(FlushCacheReq("clear", storage=True))  # SGLang's /hicache/storage-backend/clear
    h.run_until_idle()
    replies = [(out.request_id, out.success, out.payload) for out in outputs if isinstance(out, ControlReply)]
    assert replies == [("flush", True, {}), ("clear", True, {"deleted_files": 2})]
    assert list(tmp_path.glob("*.kv")) == []


def _wait_for_files(directory: Path, count: int, timeout: float = 30.0) -> None:
    """Blocks reach the disk in the background after the request ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = os.listdir(directory)
        if sum(n.endswith(".kv") for n in names) >= count and not any(n.endswith(".tmp") for n in names):
            return
        time.sleep(0.1)
    raise AssertionError(f"{count} block files not written to {directory}: {os.listdir(directory)}")


@pytest.mark.slow
def test_a_restarted_tp2_server_serves_what_every_rank_has_from_disk(
    tiny_model_dirs: dict[str, Path], smollm2_dir: Path, tmp_path: Path
) -> None:
    """A server (TP=2, the tiny Llama, bf16 by default) answers two prompts cold (the
    recomputation) and is stopped; one rank's blocks of the second prompt are lost. A new server on
    the directory (SGLang's environment variable) restores the first prompt's 192 tokens and
    recomputes the second on both ranks (the hit is the MIN over the world): the same outputs."""
    model = (
        "--model-path",
        str(tiny_model_dirs["llama"]),
        "--tokenizer-path",
        str(smollm2_dir),
        "--tp-size",
        "2",
    )
    flags = (*model, "--enable-hierarchical-cache", "--hicache-storage-backend", "file")
    prompts = [PROMPT + PROMPT[:50], [1] + PROMPT[::-1] + PROMPT[:49]]
    payloads = [
        {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 16}} for p in prompts
    ]
    with Server(*flags, "--hicache-storage-dir", str(tmp_path)) as server:
        cold = [server.generate(payloads[0]).json()]
        _wait_for_files(tmp_path, 6)  # three blocks on each rank
        first = set(os.listdir(tmp_path))
        cold.append(server.generate(payloads[1]).json())
        _wait_for_files(tmp_path, 12)
    assert [c["meta_info"]["cached_tokens"] for c in cold] == [0, 0]
    second = sorted(set(os.listdir(tmp_path)) - first)
    lost = [name for name in second if name.split("-")[0] == second[0].split("-")[0]]
    assert len(lost) == 3
    for name in lost:  # one rank's blocks of the second prompt
        (tmp_path / name).unlink()
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)}
    with Server(*flags, "--enable-metrics", env=env) as server:
        warm = [server.generate(p).json() for p in payloads]
        assert server.internal_state()["disk_tier"]["hit_tokens"] == 192
        metrics = requests.get(server.url + "/metrics", timeout=30).text
        assert "srt:disk_hit_tokens 192.0" in metrics
        cleared = requests.post(server.url + "/hicache/storage-backend/clear", timeout=60)
        assert cleared.status_code == 200 and list(tmp_path.glob("*.kv")) == []
    assert [w["meta_info"]["cached_tokens"] for w in warm] == [192, 0]
    assert [w["output_ids"] for w in warm] == [c["output_ids"] for c in cold]
    assert [w["text"] for w in warm] == [c["text"] for c in cold]

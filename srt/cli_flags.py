"""launch_server's flags: one table grouped by topic (CLI_FLAGS), each flag's argparse names and
options. Every flag has a help text; a flag whose default is None says in its help what None
means. srt/cli_args.py builds the parser from this table, scripts/gen_server_args_doc.py the flag
reference (docs/server_args.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from srt.server_args import (
    ATTENTION_BACKENDS,
    DEFAULT_HICACHE_STORAGE_DIR,
    DEVICES,
    DTYPES,
    GRAMMAR_BACKENDS,
    HICACHE_FIXED,
    LOG_LEVELS,
    QUANTIZATIONS,
    REASONING_PARSERS,
    ROUTER_POLICIES,
    SCHEDULE_POLICIES,
    SPECULATIVE_FIXED,
    TOOL_CALL_PARSERS,
    ServerArgs,
)


@dataclass(frozen=True)
class Flag:
    """One launch_server flag: argparse's names and keyword arguments (`help` among them: the line
    `--help` and docs/server_args.md print)."""

    names: tuple[str, ...]
    options: dict[str, Any]


@dataclass(frozen=True)
class FlagGroup:
    title: str
    pages: tuple[str, ...]  # the docs/ pages that explain these flags
    flags: tuple[Flag, ...]


def _flag(*names: str, **options: Any) -> Flag:
    return Flag(names, options)


def _default(name: str) -> Any:
    return ServerArgs.__dataclass_fields__[name].default


CLI_FLAGS: tuple[FlagGroup, ...] = (
    FlagGroup(
        "Model and weights",
        ("quantization.md", "usage.md"),
        (
            _flag(
                "--model-path",
                "--model",
                default=None,
                help="the path of the model weights: a Hugging Face safetensors directory or a .gguf file "
                "(default: the bundled SmolLM2-135M-Instruct)",
            ),
            _flag(
                "--tokenizer-path",
                default=None,
                help="the path of the tokenizer (default: --model-path)",
            ),
            _flag(
                "--dtype",
                default=_default("dtype"),
                choices=DTYPES,
                help="the data type of the model weights and activations: auto is bfloat16, and --quantization "
                "needs auto or bfloat16",
            ),
            _flag(
                "--device",
                default=_default("device"),
                choices=DEVICES,
                help="the device to use: cpu runs srt's C kernels where they apply, cuda runs on one GPU per rank",
            ),
            _flag(
                "--quantization",
                default=None,
                choices=QUANTIZATIONS,
                help="the quantization method (default: none, the weights run in --dtype). w8a8_int8: int8 weights (a scale per output channel) and activations (a scale per token) "
                "on AMX or AVX-512 VNNI, the LM head bf16; gguf: a GGUF model's own blocks (Q4_0, Q4_1, Q4_K, "
                "Q5_0, Q5_K, Q6_K, Q8_0, its LM head too) on AVX-512 BF16 or AVX2 kernels, batch-invariant on "
                "AVX-512 BF16 without AMX (docs/quantization.md); CPU only",
            ),
        ),
    ),
    FlagGroup(
        "HTTP server",
        ("usage.md",),
        (
            _flag(
                "--host",
                default=_default("host"),
                help="the host of the HTTP server: the address it listens on, 0.0.0.0 for every interface",
            ),
            _flag(
                "--port",
                type=int,
                default=_default("port"),
                help="the port of the HTTP server (with --dp-size > 1, the router's)",
            ),
        ),
    ),
    FlagGroup(
        "Parallelism and CPU threads",
        ("deploy.md", "cpu.md"),
        (
            _flag(
                "--tp-size",
                "--tp",
                dest="tp_size",
                type=int,
                default=1,
                help="the tensor parallelism size: ranks that split each layer (SmolLM2 has 9 attention heads: 1, 3 or 9)",
            ),
            _flag(
                "--pp-size",
                "--pp",
                dest="pp_size",
                type=int,
                default=1,
                help="the pipeline parallelism size: stages, each a contiguous range of layers (SRT_PP_LAYER_PARTITION=16,14 "
                "overrides the split); T x P ranks with --tp-size T",
            ),
            _flag(
                "--dp-size",
                "--dp",
                dest="dp_size",
                type=int,
                default=1,
                help="the data parallelism size: independent replicas of the TP x PP group on this node, the cores divided between them, "
                "behind SGLang's router on --port (needs the router extra: pip install -e '.[router]')",
            ),
            _flag(
                "--router-policy",
                default=_default("router_policy"),
                choices=ROUTER_POLICIES,
                help="the policy by which sglang-router picks a replica with --dp-size > 1",
            ),
            _flag(
                "--pp-micro-batches",
                type=int,
                default=None,
                help="micro-batches in flight with --pp-size > 1 (default: --pp-size; 1: the stages take turns)",
            ),
            _flag(
                "--cpu-threads",
                type=int,
                default=None,
                help="torch intra-op threads per rank (default: the usable CPUs divided by this node's ranks, or "
                "with SGLANG_CPU_OMP_THREADS_BIND=0-1|2-3 the size of each rank's CPU range, which pins it)",
            ),
            _flag(
                "--disable-adaptive-cpu-threads",
                action="store_true",
                help="keep every rank at its --cpu-threads even while other processes load its CPUs "
                "(by default a rank gives up one thread per core others keep busy, and takes it back after)",
            ),
        ),
    ),
    FlagGroup(
        "Multi-node",
        ("deploy.md",),
        (
            _flag(
                "--nnodes",
                type=int,
                default=1,
                help="the number of nodes (machines) the TP x PP ranks span, an equal share on each; node 0 serves HTTP",
            ),
            _flag(
                "--node-rank",
                type=int,
                default=0,
                help="the node rank: this machine's index, 0 to --nnodes - 1",
            ),
            _flag(
                "--dist-init-addr",
                default=None,
                help="HOST:PORT of node 0's rendezvous for the distributed backend, or env:// (default: none; "
                "needed with --nnodes > 1)",
            ),
            _flag(
                "--dist-timeout",
                type=float,
                default=_default("dist_timeout"),
                help="timeout in seconds for the distributed initialization: how long the nodes wait for each other "
                "at the rendezvous (an unreachable address fails after it)",
            ),
        ),
    ),
    FlagGroup(
        "CUDA graphs",
        ("architecture.md",),
        (
            _flag(
                "--cuda-graph-max-bs",
                type=int,
                default=None,
                help="the largest decode batch replayed from a CUDA graph (default: --max-running-requests, at "
                "most 256); the sizes captured are SGLang's 1, 2, 4, 8, 12, then steps of 8 to 256, of 16 "
                "to 512, of 32 after; --device cuda only",
            ),
            _flag(
                "--cuda-graph-bs",
                type=int,
                nargs="+",
                default=None,
                help="the decode batch sizes to capture (default: those of --cuda-graph-max-bs); --device cuda only",
            ),
            _flag(
                "--disable-cuda-graph",
                action="store_true",
                help="decode op by op on CUDA (accepted on the CPU, where there are no graphs)",
            ),
        ),
    ),
    FlagGroup(
        "Memory",
        ("cpu.md",),
        (
            _flag(
                "--mem-fraction-static",
                type=float,
                default=None,
                help="the fraction of the device's memory for static allocation, weights and KV cache (default: 0.8 on "
                "CUDA); on CPU, given "
                "alone, sizes the KV cache by host RAM instead of --cpu-kvcache-space",
            ),
            _flag(
                "--max-total-tokens",
                type=int,
                default=None,
                help="the KV cache size in tokens (default: what --mem-fraction-static leaves on CUDA, "
                "--cpu-kvcache-space on CPU); on CPU, given alone, replaces --cpu-kvcache-space",
            ),
            _flag(
                "--cpu-kvcache-space",
                type=float,
                default=None,
                help="GiB of KV cache on --device cpu, for this server's ranks on the host together (default: 4, "
                "or VLLM_CPU_KVCACHE_SPACE; never more than --max-running-requests x context length)",
            ),
            _flag(
                "--swa-full-tokens-ratio",
                type=float,
                default=_default("swa_full_tokens_ratio"),
                help="sliding-window layers keep their K/V in window pages, this many per full page (0 to 1]; "
                "each request holds only its window's",
            ),
            _flag(
                "--disable-hybrid-swa-memory",
                action="store_true",
                help="sliding-window layers keep every token's K/V, as global layers do",
            ),
            _flag(
                "--min-available-memory",
                type=float,
                default=_default("min_available_memory"),
                help="GiB: while the host has less RAM available, new requests get 503 and the prefix cache is "
                "evicted and given back to the OS (0: off)",
            ),
        ),
    ),
    FlagGroup(
        "Scheduling",
        ("architecture.md",),
        (
            _flag(
                "--max-running-requests",
                type=int,
                default=_default("max_running_requests"),
                help="the maximum number of running requests: those in the running batch at once (the request slots)",
            ),
            _flag(
                "--max-prefill-tokens",
                type=int,
                default=_default("max_prefill_tokens"),
                help="the maximum number of new prompt tokens in a prefill step, all requests together",
            ),
            _flag(
                "--chunked-prefill-size",
                type=int,
                default=_default("chunked_prefill_size"),
                help="the maximum number of new prompt tokens of one request in a step; a longer prompt is "
                "prefilled in chunks",
            ),
            _flag(
                "--page-size",
                type=int,
                default=_default("page_size"),
                help="the number of tokens in a KV cache page",
            ),
            _flag(
                "--schedule-policy",
                default=_default("schedule_policy"),
                choices=SCHEDULE_POLICIES,
                help="the scheduling policy of the waiting requests: fcfs, arrival order; lpm, longest cached prefix first",
            ),
            _flag(
                "--enable-priority-scheduling",
                action="store_true",
                help="order the waiting queue by each request's `priority` (larger first; requests without one "
                "last), then by --schedule-policy; without it a request that sets priority gets a 400",
            ),
            _flag(
                "--is-embedding",
                action="store_true",
                help="serve the model's embeddings (SGLang's flag): /v1/embeddings and /encode pool each input's "
                "final hidden states as its sentence-transformers files say (else the last token, normalized); "
                "the generation routes answer 400. Every prompt runs whole, without the prefix cache; --pp-size 1",
            ),
            _flag(
                "--enable-return-routed-experts",
                action="store_true",
                help="keep the experts every token was routed to (a mixture-of-experts model, --pp-size 1), so a "
                "request with return_routed_experts gets them in meta_info.routed_experts; without it such a "
                "request gets a 400",
            ),
            _flag(
                "--schedule-low-priority-values-first",
                action="store_true",
                help="with --enable-priority-scheduling: smaller priority values go first",
            ),
            _flag(
                "--disable-radix-cache",
                action="store_true",
                help="disable the radix (prefix) cache: every prompt is prefilled whole",
            ),
        ),
    ),
    FlagGroup(
        "Requests, streaming and logs",
        ("usage.md",),
        (
            _flag(
                "--random-seed",
                type=int,
                default=_default("random_seed"),
                help="the random seed: with the requests' order, it gives the seed of each request that sets none",
            ),
            _flag(
                "--context-length",
                type=int,
                default=None,
                help="the model's maximum context length, prompt plus output (default and most: the model's "
                "max_position_embeddings)",
            ),
            _flag(
                "--served-model-name",
                default=None,
                help="the model name the OpenAI routes return (default: --model-path as given, else "
                "SmolLM2-135M-Instruct)",
            ),
            _flag(
                "--log-level",
                default=_default("log_level"),
                choices=LOG_LEVELS,
                help="the logging level: the lowest level of log line printed",
            ),
            _flag(
                "--stream-interval",
                type=int,
                default=_default("stream_interval"),
                help="the streaming interval in tokens: a stream sends a chunk every this many new tokens",
            ),
            _flag(
                "--incremental-streaming-output",
                action="store_true",
                help="each streamed /generate chunk carries only the text, output_ids and output logprobs new "
                "since the previous chunk (default: everything so far)",
            ),
        ),
    ),
    FlagGroup(
        "Attention, grammars, tool calls and reasoning",
        ("usage.md",),
        (
            _flag(
                "--attention-backend",
                default=_default("attention_backend"),
                choices=ATTENTION_BACKENDS,
                help="the kernels for attention layers (auto: cpu_kernels on the CPU; on CUDA flashinfer where it "
                "imports, else triton, else torch_native)",
            ),
            _flag(
                "--grammar-backend",
                default=_default("grammar_backend"),
                choices=GRAMMAR_BACKENDS,
                help="the backend for grammar-guided decoding: compiles the json_schema, regex, ebnf and structural_tag sampling params (none: refuse them)",
            ),
            _flag(
                "--chat-template",
                default=None,
                help="a Jinja chat template file for the chat, Responses and Anthropic APIs, in place of the "
                "tokenizer's (a base model has none; default: the tokenizer's)",
            ),
            _flag(
                "--tool-call-parser",
                default=None,
                choices=TOOL_CALL_PARSERS,
                help="the model's tool-call format, parsed into tool_calls for tool_choice auto (default: chosen from "
                "the chat template; generic where it renders no tools, srt then writes the tools prompt)",
            ),
            _flag(
                "--reasoning-parser",
                default=None,
                choices=REASONING_PARSERS,
                help="the parser for reasoning models' <think> format: chat replies carry it as reasoning_content, "
                "apart from content (default: none, the reasoning stays in content)",
            ),
            _flag(
                "--constrained-json-disable-any-whitespace",
                action="store_true",
                help="JSON-constrained outputs take the compact form (no whitespace between tokens)",
            ),
            _flag(
                "--constrained-json-max-whitespace-cnt",
                type=int,
                default=12,
                help="at most this many consecutive whitespace characters in JSON-constrained outputs: bounded, "
                "so that a model that keeps emitting newlines between tokens still closes a bounded schema "
                "(SGLang leaves it unbounded; a large value comes close)",
            ),
        ),
    ),
    FlagGroup(
        "Guards against ranks that disagree or hang",
        ("deploy.md", "architecture.md"),
        (
            _flag(
                "--watchdog-timeout",
                type=float,
                default=_default("watchdog_timeout"),
                help="the watchdog timeout: seconds without a forward step while work is pending before a rank "
                "logs its stacks and exits (code 75), which takes the server down",
            ),
            _flag(
                "--soft-watchdog-timeout",
                type=float,
                default=None,
                help="the soft watchdog timeout: seconds without a forward step while work is pending before a "
                "rank logs its stacks and goes on serving (default: off)",
            ),
            _flag(
                "--sync-token-ids-across-tp",
                action="store_true",
                default=None,
                help="TP ranks MIN-all-reduce every step's sampled ids (constrained requests' always; default: "
                "off, or SYNC_TOKEN_IDS_ACROSS_TP)",
            ),
            _flag(
                "--enable-rank-consensus-checker",
                action="store_true",
                default=None,
                help="each rank digests its decisions; a thread compares them every second, names the first "
                "divergence and exits 70 (default: off, or SRT_ENABLE_RANK_CONSENSUS_CHECKER)",
            ),
            _flag(
                "--shutdown-timeout",
                type=float,
                default=_default("shutdown_timeout"),
                help="seconds a SIGTERM lets the requests in flight finish before they get 503",
            ),
        ),
    ),
    FlagGroup(
        "Monitoring",
        ("usage.md",),
        (
            _flag("--enable-metrics", action="store_true", help="serve Prometheus metrics on GET /metrics"),
            _flag(
                "--decode-log-interval",
                type=int,
                default=_default("decode_log_interval"),
                help="the decode log interval: log a decode stats line every this many decode steps",
            ),
        ),
    ),
    FlagGroup(
        "Restarts and deterministic inference",
        ("deploy.md", "usage.md"),
        (
            _flag(
                "--restart-on-failure",
                type=int,
                default=_default("restart_on_failure"),
                help="when a rank or the detokenizer dies, restart the engine and replay the requests in "
                "flight, up to this many times within --restart-window (0: the server goes down)",
            ),
            _flag(
                "--enable-deterministic-inference",
                action="store_true",
                help="the same tokens for a request whatever its batch, its chunking and its prefix-cache hits: "
                "prefill runs each token with decode's arithmetic (on by itself with --restart-on-failure)",
            ),
            _flag(
                "--restart-window",
                type=float,
                default=_default("restart_window"),
                help="seconds over which --restart-on-failure counts restarts",
            ),
        ),
    ),
    FlagGroup(
        "Speculative decoding",
        ("usage.md",),
        (
            _flag(
                "--speculative-algorithm",
                default=None,
                help="the speculative algorithm (default: none, plain decoding). NGRAM: each decode step checks drafts taken from the request's own prompt and output "
                "where its last tokens occurred before; STANDALONE: drafts decoded by a small model with the same "
                "tokenizer (--speculative-draft-model-path). The tokens are those of plain decoding (SGLang's "
                "other algorithms are refused by name)",
            ),
            _flag(
                "--speculative-draft-model-path",
                default=None,
                help="the path of STANDALONE's draft model weights: a directory or GGUF file as --model-path "
                "takes, run whole on every rank (default: none; STANDALONE needs it)",
            ),
            _flag(
                "--speculative-draft-model-quantization",
                default=None,
                choices=("unquant", *QUANTIZATIONS),
                help="STANDALONE: the draft model's --quantization (default: the target's, as SGLang does; "
                "unquant: none)",
            ),
            _flag(
                "--speculative-num-steps",
                type=int,
                default=None,
                help="STANDALONE: drafts decoded per step at most (default: --speculative-num-draft-tokens - 1)",
            ),
            _flag(
                "--speculative-eagle-topk",
                type=int,
                default=None,
                help="draft tokens branched per step: 1 only, one chain per request (default: 1)",
            ),
            _flag(
                "--speculative-num-draft-tokens",
                type=int,
                default=None,
                help="rows a verify step feeds per request and in all: a request's last token and up to this many - 1 "
                "drafts (default: --speculative-num-steps + 1, else 4 on CPU, 12 on CUDA)",
            ),
            _flag(
                "--speculative-ngram-max-trie-depth",
                type=int,
                default=None,
                help="the max trie depth: the longest run of a request's last tokens matched against its earlier "
                "tokens (default: 18)",
            ),
            *(
                _flag(
                    "--" + name.replace("_", "-"),
                    type=type(default) if default is not None else str,
                    default=None,
                    help=f"SGLang's; accepted at its default ({default}) only: {why}",
                )
                for name, default, why in SPECULATIVE_FIXED
            ),
        ),
    ),
    FlagGroup(
        "LoRA adapters",
        ("usage.md",),
        (
            _flag(
                "--enable-lora",
                action="store_true",
                help="requests may name a LoRA adapter (lora_path, or OpenAI's model as base:adapter or the "
                "adapter's name); on by itself with --lora-paths. On CUDA every batch then runs the model's "
                "layers op by op (no CUDA graph), adapters or not",
            ),
            _flag(
                "--lora-paths",
                nargs="+",
                default=None,
                help="peft adapter folders (adapter_config.json and adapter_model.safetensors) as name=path, or a "
                "path named by its folder (default: none)",
            ),
            _flag(
                "--max-loras-per-batch",
                type=int,
                default=_default("max_loras_per_batch"),
                help="the most distinct adapters one batch holds (the base model not counted)",
            ),
            _flag(
                "--max-loaded-loras",
                type=int,
                default=None,
                help="the most adapters loaded at once: past it a load unloads the first to leave by "
                "--lora-eviction-policy, never a pinned one, once its requests finish (default: any number)",
            ),
            _flag(
                "--lora-eviction-policy",
                choices=["lru", "fifo"],
                default=_default("lora_eviction_policy"),
                help="which adapter leaves past --max-loaded-loras: lru, the least recently requested; fifo, "
                "the first loaded",
            ),
            _flag(
                "--max-lora-rank",
                type=int,
                default=None,
                help="an adapter of a higher rank is refused (default: any rank)",
            ),
            _flag(
                "--lora-target-modules",
                nargs="+",
                default=None,
                help="the modules adapters may target, e.g. q_proj v_proj, or all (default: any linear layer "
                "of the model; MoE experts are refused)",
            ),
        ),
    ),
    FlagGroup(
        "Prompt cache on disk",
        ("architecture.md",),
        (
            _flag(
                "--enable-hierarchical-cache",
                "--enable-hicache",
                action="store_true",
                help="keep the radix cache's prefixes on disk too, across restarts (SGLang's flag): needs "
                "--hicache-storage-backend file. Each rank writes its own KV shard of a prefix's whole blocks "
                "once the prompt is computed and when the request ends, and reads them back on a miss; a prefix is used only as far as every "
                "rank has it",
            ),
            _flag(
                "--hicache-storage-backend",
                default=None,
                help="where the hierarchical cache keeps prefixes: file (a directory) only; SGLang's other "
                "backends are refused by name (default: none, no hierarchical cache)",
            ),
            _flag(
                "--hicache-storage-dir",
                default=None,
                help=f"the file backend's directory (default: SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else "
                f"{DEFAULT_HICACHE_STORAGE_DIR})",
            ),
            _flag(
                "--hicache-storage-max-size",
                default=None,
                help="the most bytes the server's files in the directory take, e.g. 200G or 1Gi; the least "
                "recently used go first (default: SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE, else no bound)",
            ),
            *(
                _flag(
                    "--" + name.replace("_", "-"),
                    type=float if name == "hicache_ratio" else type(default) if default is not None else str,
                    default=None,
                    help=f"SGLang's; accepted at its default ({default}) only: {why}",
                )
                for name, default, why in HICACHE_FIXED
            ),
        ),
    ),
    FlagGroup(
        "Facing real traffic",
        ("deploy.md",),
        (
            _flag(
                "--api-key",
                default=None,
                help="every route but /health*, /ready* and /metrics needs 'Authorization: Bearer <key>' "
                "(default: none, no key; or SRT_API_KEY)",
            ),
            _flag(
                "--admin-api-key",
                default=None,
                help="admin routes (/flush_cache) need this key instead of --api-key (default: none, --api-key "
                "guards them too; or SRT_ADMIN_API_KEY)",
            ),
            _flag(
                "--max-queued-requests",
                type=int,
                default=None,
                help="the maximum number of queued requests: a request that finds this many waiting gets 503 with "
                "Retry-After at once (default: no limit)",
            ),
            _flag(
                "--max-request-bytes",
                type=int,
                default=_default("max_request_bytes"),
                help="a request body over this many bytes gets 413",
            ),
            _flag(
                "--responses-store-size",
                type=int,
                default=_default("responses_store_size"),
                help="how many /v1/responses responses the front end keeps in memory (store: true) for "
                "GET and previous_response_id, the oldest evicted first; lost on restart; 0 keeps none "
                "(previous_response_id is then a 404)",
            ),
            _flag(
                "--req-waiting-timeout",
                type=float,
                default=None,
                help="a request without its first token after this many seconds is aborted with 503 "
                "(default: SGLang's SGLANG_REQ_WAITING_TIMEOUT, else off)",
            ),
            _flag(
                "--req-running-timeout",
                type=float,
                default=None,
                help="a request still generating this many seconds after its first token is aborted with 503 "
                "(default: SGLang's SGLANG_REQ_RUNNING_TIMEOUT, else off)",
            ),
        ),
    ),
)

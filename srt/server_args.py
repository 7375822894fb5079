"""ServerArgs: every launch option in one frozen dataclass, parsed from SGLang-style flags and
validated once (errors name the flag). Derived values are properties."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from srt.default_model import DEFAULT_MODEL_NAME
from srt.lora_config import LoraRef, check_adapter, parse_lora_paths

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SCHEDULE_POLICIES = ("fcfs", "lpm")
DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32")
ATTENTION_BACKENDS = (
    "auto",
    "cpu_kernels",
    "torch_native",
    "flashinfer",
    "triton",
)  # model_executor/attention/registry.py
GRAMMAR_BACKENDS = ("xgrammar", "none")  # SGLang's choices srt has (model_executor/constrained)
REASONING_PARSERS = ("deepseek-r1", "qwen3", "qwen3-thinking")  # SGLang's names srt has (srt/reasoning.py)
TOOL_CALL_PARSERS = ("qwen25", "llama3", "generic")  # SGLang's two, and srt's own (srt/tool_calls.py)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")  # sglang-router's, for --dp-size
QUANTIZATIONS = ("w8a8_int8", "gguf")  # model_executor/cpu/weights.py
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")  # scheduler/speculative.py, model_executor/draft_model.py
# SGLang's other algorithms, refused by name
SGLANG_SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "DFLASH", "DSPARK", "UNO")
# rows a request verifies a step: SGLang's default for NGRAM on a GPU, where rows up to a tile are free;
# on a CPU a row past the first two or three costs arithmetic (docs/performance.md, speculative decoding)
NGRAM_NUM_DRAFT_TOKENS = {"cuda": 12, "cpu": 4}
# SGLang's speculative flags srt accepts at their defaults only: (field, default, why another value is refused)
SPECULATIVE_FIXED: tuple[tuple[str, Any, str], ...] = (
    ("speculative_ngram_min_bfs_breadth", 1, "srt drafts one chain per request"),
    ("speculative_ngram_max_bfs_breadth", 10, "srt drafts one chain per request"),
    ("speculative_ngram_match_type", "BFS", "srt drafts one chain per request"),
    ("speculative_ngram_capacity", 10_000_000, "srt's n-gram index is the request's own tokens"),
    ("speculative_accept_threshold_single", 1.0, "srt's verification never changes an output"),
    ("speculative_accept_threshold_acc", 1.0, "srt's verification never changes an output"),
)


DEFAULT_MEM_FRACTION_STATIC = 0.8
DEFAULT_CPU_KVCACHE_SPACE_GIB = 4.0  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE)

SECRET_ENV = {"api_key": "SRT_API_KEY", "admin_api_key": "SRT_ADMIN_API_KEY"}  # field -> environment variable
# field -> the environment variable its default comes from when its flag is not given
ENV_DEFAULTS = {
    "cpu_kvcache_space": "VLLM_CPU_KVCACHE_SPACE",
    "sync_token_ids_across_tp": "SYNC_TOKEN_IDS_ACROSS_TP",
    "enable_rank_consensus_checker": "SRT_ENABLE_RANK_CONSENSUS_CHECKER",
    **SECRET_ENV,
    "req_waiting_timeout": "SGLANG_REQ_WAITING_TIMEOUT",
    "req_running_timeout": "SGLANG_REQ_RUNNING_TIMEOUT",
    "hicache_storage_dir": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
    "hicache_storage_max_size": "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE",
}
# SGLang's --hicache-storage-backend choices; srt has the file backend alone (mem_cache/disk_tier.py)
SGLANG_HICACHE_STORAGE_BACKENDS = (
    "file",
    "sim",
    "mooncake",
    "npu_memcache",
    "hf3fs",
    "nixl",
    "aibrix",
    "dynamic",
    "eic",
    "simm",
    "mori",
    "shm",
    "tensorcast",
    "seaweedfs",
)
DEFAULT_HICACHE_STORAGE_DIR = "/tmp/hicache"  # SGLang's file backend's default
# SGLang's hierarchical-cache flags srt accepts at their defaults only: srt has no host-memory tier,
# its disk tier is written through from the radix cache and read synchronously on a miss
HICACHE_FIXED: tuple[tuple[str, Any, str], ...] = (
    ("hicache_ratio", None, "srt has no host-memory tier"),
    ("hicache_size", 0, "srt has no host-memory tier"),
    ("hicache_host_memory_fraction", 0.8, "srt has no host-memory tier"),
    ("hicache_host_memory_mode", "cache", "srt has no host-memory tier"),
    ("hicache_write_policy", "write_through", "srt writes every cached page through to the disk tier"),
    ("hicache_io_backend", "kernel", "srt reads and writes the disk tier from the host"),
    ("hicache_mem_layout", "page_first", "srt's page files hold one block's layers in order"),
    ("hicache_storage_prefetch_policy", "timeout", "srt reads a prefix before admitting its request"),
    (
        "hicache_storage_backend_extra_config",
        None,
        "the file backend takes its directory and size from flags",
    ),
)

# Fields that must be positive, checked in this order, and whether each may be None (off).
POSITIVE_FIELDS: tuple[tuple[str, bool], ...] = (
    ("tp_size", False),
    ("pp_size", False),
    ("dp_size", False),
    ("nnodes", False),
    ("max_running_requests", False),
    ("max_prefill_tokens", False),
    ("chunked_prefill_size", False),
    ("page_size", False),
    ("stream_interval", False),
    ("decode_log_interval", False),
    ("max_total_tokens", True),
    ("context_length", True),
    ("cpu_threads", True),
    ("soft_watchdog_timeout", True),
    ("pp_micro_batches", True),
    ("max_queued_requests", True),
    ("max_request_bytes", True),
    ("max_loras_per_batch", False),
    ("max_loaded_loras", True),
    ("max_lora_rank", True),
    ("constrained_json_max_whitespace_cnt", True),
    ("req_waiting_timeout", True),
    ("req_running_timeout", True),
    ("watchdog_timeout", False),
    ("dist_timeout", False),
    ("restart_window", False),
)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_gib(name: str) -> float | None:
    """vLLM's VLLM_CPU_KVCACHE_SPACE: GiB; unset or 0 means its default."""
    value = float(os.environ.get(name) or 0)
    return value if value > 0 else None


def _env_str(name: str) -> str | None:
    return os.environ.get(name) or None


_SIZE_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_size(value: str, flag: str) -> int:
    """Bytes of a size as SGLang's file backend reads it: an integer with an optional SI (K, M, G, T)
    or IEC (Ki, Mi, Gi, Ti) suffix, B allowed after it; 0: no bound. Raises ValueError naming `flag`."""
    text = value.strip().lower().removesuffix("b")
    digits = text.rstrip("kmgti")
    unit = text[len(digits) :]
    try:
        number = float(digits)
    except ValueError:
        number = -1.0
    if number < 0 or unit not in _SIZE_UNITS:
        raise ValueError(f"{flag} must be a size such as 200G, 1Gi or 1048576 (0: no bound); got {value!r}")
    return int(number * _SIZE_UNITS[unit])


def _env_timeout(name: str) -> float | None:
    """SGLang's request timeouts are environment variables (seconds; -1, its default, is off)."""
    value = float(os.environ.get(name) or -1)
    return value if value > 0 else None


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    quantization: str | None = (
        None  # QUANTIZATIONS: int8 weights and activations, or a GGUF's Q4_1 weights (CPU only)
    )
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = (
        1  # replicas of the TP x PP group on this node, behind SGLang's router (launcher/data_parallel.py)
    )
    router_policy: str = "cache_aware"  # with --dp-size > 1
    pp_micro_batches: int | None = None  # batches in flight with --pp-size > 1 (None: pp_size)
    # torch intra-op threads per rank (None: the usable CPUs / this node's ranks, or with
    # SGLANG_CPU_OMP_THREADS_BIND the size of each rank's range: srt/utils.py rank_cpus)
    cpu_threads: int | None = None
    # a rank runs on fewer threads while other processes keep some of its CPUs busy
    # (model_executor/cpu/thread_governor.py)
    disable_adaptive_cpu_threads: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 300.0
    mem_fraction_static: float | None = (
        None  # None: 0.8 on CUDA; on CPU the KV space applies (mem_cache/budget.py)
    )
    max_total_tokens: int | None = None
    # GiB of KV for this server's ranks on the host together (vLLM's CPU knob); None: 4, or as below
    cpu_kvcache_space: float | None = field(
        default_factory=lambda: _env_gib(ENV_DEFAULTS["cpu_kvcache_space"])
    )
    min_available_memory: float = (
        1.0  # GiB of host RAM available below which the front end sheds load; 0: off
    )
    max_running_requests: int = 128
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    # sliding-window layers' K/V in window pages, this many per full page (mem_cache/window_pages.py)
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    page_size: int = 1
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False  # requests' `priority` orders the waiting queue
    enable_return_routed_experts: bool = False  # requests may ask for their tokens' experts
    is_embedding: bool = False  # serve embeddings (/v1/embeddings, /encode) instead of generating
    schedule_low_priority_values_first: bool = False  # with it, smaller priority values go first
    disable_radix_cache: bool = False
    random_seed: int = 0
    context_length: int | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    stream_interval: int = 1
    incremental_streaming_output: bool = False  # /generate streams deltas, not cumulative output
    attention_backend: str = "auto"
    # CUDA graphs of decode steps (model_executor/cuda/): the largest batch captured (None: the
    # max running requests, at most 256) or the sizes themselves; --device cuda only
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    disable_cuda_graph: bool = False  # accepted on any device (SGLang users pass it everywhere)
    grammar_backend: str = "xgrammar"  # json_schema / regex / ebnf / structural_tag; "none" refuses them
    chat_template: str | None = None  # a Jinja chat template file for the chat APIs (None: the tokenizer's)
    tool_call_parser: str | None = None  # "qwen25" | "llama3" | "generic"; None: from the chat template
    reasoning_parser: str | None = None  # "deepseek-r1" | "qwen3" | "qwen3-thinking": chat splits off <think>
    constrained_json_disable_any_whitespace: bool = False  # JSON outputs compact (SGLang's flag)
    # at most this many whitespace characters in a row in a JSON-constrained output (None: unbounded, as
    # SGLang's default; bounded here so that a schema bounded in size always closes)
    constrained_json_max_whitespace_cnt: int | None = 12
    watchdog_timeout: float = 300.0
    soft_watchdog_timeout: float | None = None
    sync_token_ids_across_tp: bool = field(
        default_factory=lambda: _env_flag(ENV_DEFAULTS["sync_token_ids_across_tp"])
    )
    enable_rank_consensus_checker: bool = field(
        default_factory=lambda: _env_flag(ENV_DEFAULTS["enable_rank_consensus_checker"])
    )
    shutdown_timeout: float = 30.0
    enable_metrics: bool = False
    decode_log_interval: int = 40
    restart_on_failure: int = 0  # engine restarts allowed within restart_window (srt/recovery.py)
    # One arithmetic for prefill and decode, whatever the batch (model_executor/attention/torch_native.py);
    # on by itself with --restart-on-failure, whose replays rely on it (`deterministic`)
    enable_deterministic_inference: bool = False
    restart_window: float = 300.0
    # Secrets (srt/guard.py): never in to_dict (/server_info) nor to_cli; a --dp-size replica gets
    # them through its environment (SECRET_ENV), not its command line, which `ps` shows.
    api_key: str | None = field(
        default_factory=lambda: os.environ.get(SECRET_ENV["api_key"]) or None, repr=False
    )
    admin_api_key: str | None = field(
        default_factory=lambda: os.environ.get(SECRET_ENV["admin_api_key"]) or None, repr=False
    )
    max_queued_requests: int | None = None  # waiting requests beyond which new ones get 503 (SGLang's flag)
    max_request_bytes: int = 64 * 2**20  # a larger request body is a 413
    responses_store_size: int = 1000  # /v1/responses kept in the front end's memory; 0 keeps none
    # Deadlines, decided by the front end alone and sent to every rank as aborts (tokenizer_manager)
    req_waiting_timeout: float | None = field(
        default_factory=lambda: _env_timeout(ENV_DEFAULTS["req_waiting_timeout"])
    )
    req_running_timeout: float | None = field(
        default_factory=lambda: _env_timeout(ENV_DEFAULTS["req_running_timeout"])
    )

    # Speculative decoding (scheduler/speculative.py): SGLang's flags
    speculative_algorithm: str | None = None  # "NGRAM" (the request's own tokens) or "STANDALONE" (a model)
    speculative_num_draft_tokens: int | None = None  # rows verified per request a step; None: 4 on CPU, 12
    speculative_ngram_max_trie_depth: int = 18  # the longest suffix matched
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_capacity: int = 10_000_000
    speculative_draft_model_path: str | None = None  # STANDALONE's draft model
    # the draft's --quantization: None the target's (SGLang's default), "unquant" none
    speculative_draft_model_quantization: str | None = None
    speculative_num_steps: int | None = None  # STANDALONE: draft tokens per step (num_draft_tokens - 1)
    speculative_eagle_topk: int | None = None  # 1 only: one chain of drafts per request
    speculative_accept_threshold_single: float = 1.0
    speculative_accept_threshold_acc: float = 1.0

    # LoRA adapters (srt/lora_config.py, model_executor/lora/): SGLang's flags
    enable_lora: bool = False  # on by itself with --lora-paths (`lora_enabled`)
    lora_paths: tuple[str, ...] | None = None  # name=path, or a path named by its folder
    max_loras_per_batch: int = 8  # distinct adapters in one batch at most
    max_loaded_loras: int | None = None  # adapters loaded at once at most (srt/lora_residency.py); None: any
    lora_eviction_policy: str = "lru"  # which leaves past max_loaded_loras: lru or fifo
    max_lora_rank: int | None = None  # None: any rank
    lora_target_modules: tuple[str, ...] | None = None  # None: any of the model's linear layers

    # A prompt cache on disk (mem_cache/disk_tier.py): SGLang's hierarchical-cache flags
    enable_hierarchical_cache: bool = False  # with --hicache-storage-backend file
    hicache_storage_backend: str | None = None  # "file" only
    # the file backend's directory (None: /tmp/hicache, SGLang's) and bound on its bytes (None or 0: none)
    hicache_storage_dir: str | None = field(
        default_factory=lambda: _env_str(ENV_DEFAULTS["hicache_storage_dir"])
    )
    hicache_storage_max_size: str | None = field(
        default_factory=lambda: _env_str(ENV_DEFAULTS["hicache_storage_max_size"])
    )
    hicache_ratio: float | None = None
    hicache_size: int = 0
    hicache_host_memory_fraction: float = 0.8
    hicache_host_memory_mode: str = "cache"
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_mem_layout: str = "page_first"
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_backend_extra_config: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad flag; the checks run by topic, in this order."""
        self._check_positive()
        self._check_lifecycle()
        self._check_memory()
        self._check_placement()
        self._check_choices()
        self._check_cuda_graph()
        self._check_speculative()
        self._check_lora()
        self._check_hicache()

    def _check_positive(self) -> None:
        for name, optional in POSITIVE_FIELDS:
            value = getattr(self, name)
            if value is None and optional:
                continue
            if value is None or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")

    def _check_lifecycle(self) -> None:
        if self.restart_on_failure < 0:
            raise ValueError(f"--restart-on-failure must be >= 0, got {self.restart_on_failure}")
        if self.enable_deterministic_inference and self.quantization == "gguf":
            raise ValueError(
                "--enable-deterministic-inference cannot hold with --quantization gguf: its decode "
                "steps of up to 12 rows run on the file's 4-bit blocks, prefills on a bf16 copy"
            )
        if self.responses_store_size < 0:
            raise ValueError(
                f"--responses-store-size must be >= 0 (0 keeps none), got {self.responses_store_size}"
            )
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")

    def _check_memory(self) -> None:
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.cpu_kvcache_space is not None:
            if not self.cpu_kvcache_space > 0:
                raise ValueError(f"--cpu-kvcache-space must be positive (GiB), got {self.cpu_kvcache_space}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if not self.min_available_memory >= 0:
            raise ValueError(
                f"--min-available-memory must be >= 0 (GiB; 0 turns it off), got {self.min_available_memory}"
            )

    def _check_placement(self) -> None:
        """Nodes, replicas and the HTTP port."""
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside [0, --nnodes {self.nnodes})")
        if (self.tp_size * self.pp_size) % self.nnodes != 0:
            raise ValueError(
                f"--tp-size x --pp-size ({self.tp_size} x {self.pp_size}) is not divisible by "
                f"--nnodes {self.nnodes}"
            )
        if (
            self.dp_size > 1 and os.environ.get("SGLANG_CPU_OMP_THREADS_BIND", "").strip()
        ):  # srt.utils.CPU_BIND_ENV
            raise ValueError(
                "SGLANG_CPU_OMP_THREADS_BIND pins the ranks of one replica; with --dp-size > 1 the replicas "
                "already split the cores between them (unset it, or use --cpu-threads)"
            )
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError(
                "--dp-size runs its replicas on this node; across machines start launch_server on each "
                "host and sglang-router with --worker-urls (README, Data parallelism)"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--dist-init-addr HOST:PORT is required when --nnodes > 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(
                f"--chat-template takes a Jinja template file; {self.chat_template!r} is none "
                "(SGLang's built-in template names are not implemented)"
            )

    def _check_choices(self) -> None:
        for flag, value, allowed, optional in (
            ("dtype", self.dtype, DTYPES, False),
            ("device", self.device, DEVICES, False),
            ("schedule-policy", self.schedule_policy, SCHEDULE_POLICIES, False),
            ("log-level", self.log_level, LOG_LEVELS, False),
            ("attention-backend", self.attention_backend, ATTENTION_BACKENDS, False),
            ("grammar-backend", self.grammar_backend, GRAMMAR_BACKENDS, False),
            ("router-policy", self.router_policy, ROUTER_POLICIES, False),
            ("tool-call-parser", self.tool_call_parser, TOOL_CALL_PARSERS, True),
            ("reasoning-parser", self.reasoning_parser, REASONING_PARSERS, True),
            ("quantization", self.quantization, QUANTIZATIONS, True),
        ):
            if value not in allowed and not (optional and value is None):
                raise ValueError(f"--{flag} must be one of {', '.join(allowed)}; got {value!r}")
        if self.quantization is not None and (self.device != "cpu" or self.dtype not in ("auto", "bfloat16")):
            raise ValueError(
                f"--quantization {self.quantization} needs --device cpu and --dtype bfloat16 "
                f"(or auto); got --device {self.device} --dtype {self.dtype}"
            )

    def _check_cuda_graph(self) -> None:
        for flag, given in (
            ("--cuda-graph-max-bs", self.cuda_graph_max_bs is not None),
            ("--cuda-graph-bs", self.cuda_graph_bs is not None),
        ):
            if given and self.device != "cuda":
                raise ValueError(
                    f"{flag} sizes CUDA graphs, which run on --device cuda only; got --device {self.device}"
                )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be positive, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1):
            raise ValueError(
                f"--cuda-graph-bs must be one or more positive sizes, got {list(self.cuda_graph_bs)}"
            )

    def _check_speculative(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm in SGLANG_SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"--speculative-algorithm {algorithm} is not implemented in srt; it has "
                f"{', '.join(SPECULATIVE_ALGORITHMS)}"
            )
        if algorithm is not None and algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}; got {algorithm!r}"
            )
        for name, default, why in SPECULATIVE_FIXED:
            if getattr(self, name) != default:
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} is not supported ({why}); "
                    f"srt takes only its default, {default}"
                )
        for name in (
            "speculative_num_draft_tokens",
            "speculative_ngram_max_trie_depth",
            "speculative_num_steps",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        self._check_draft_model()
        if algorithm is not None and self.is_embedding:
            raise ValueError("--speculative-algorithm decodes; --is-embedding serves no decode step")

    @property
    def draft_quantization(self) -> str | None:
        """The draft model's --quantization: --speculative-draft-model-quantization, by default the
        target's (as SGLang resolves it); "unquant" is none."""
        value = self.speculative_draft_model_quantization
        return None if value == "unquant" else value or self.quantization

    def _check_draft_model(self) -> None:
        """STANDALONE's flags: a draft model, one chain of drafts, --speculative-num-steps as SGLang
        means it (drafts per step: --speculative-num-draft-tokens - 1), one pipeline stage."""
        algorithm = self.speculative_algorithm
        standalone = algorithm == "STANDALONE"
        if standalone and self.speculative_draft_model_path is None:
            raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path")
        draft_quantization = self.speculative_draft_model_quantization
        if draft_quantization not in (None, "unquant", *QUANTIZATIONS):
            raise ValueError(
                f"--speculative-draft-model-quantization must be one of unquant, {', '.join(QUANTIZATIONS)}; "
                f"got {draft_quantization!r}"
            )
        for name in (
            "speculative_draft_model_path",
            "speculative_num_steps",
            "speculative_draft_model_quantization",
        ):
            if getattr(self, name) is not None and not standalone:
                raise ValueError(
                    f"--{name.replace('_', '-')} steps a draft model: it needs --speculative-algorithm "
                    f"STANDALONE (got {algorithm})"
                )
        if self.speculative_eagle_topk not in (None, 1):
            raise ValueError(
                f"--speculative-eagle-topk {self.speculative_eagle_topk} is not supported (srt drafts one "
                "chain per request); srt takes only 1"
            )
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is not None and tokens is not None and tokens != steps + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens {tokens} must be --speculative-num-steps + 1 ({steps + 1}): "
                "srt verifies one chain of drafts"
            )
        if standalone and self.pp_size > 1:
            raise ValueError(
                "--speculative-algorithm STANDALONE runs with --pp-size 1 (the stages would each "
                "decode the draft model and could not agree on its drafts without a collective)"
            )

    def _check_lora(self) -> None:
        """The adapters of --lora-paths read and checked (srt/lora_config.py) before any rank starts,
        and what LoRA does not run with yet."""
        adapters = self.lora_adapters
        if not self.lora_enabled:
            for name in ("max_lora_rank", "lora_target_modules", "max_loaded_loras"):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name.replace('_', '-')} needs --enable-lora (or --lora-paths)")
            return
        for flag, on in (
            ("--speculative-algorithm", self.speculative_algorithm is not None),
            ("--is-embedding", self.is_embedding),
        ):
            if on:
                raise ValueError(f"--enable-lora does not run with {flag} in srt yet")
        for ref in adapters:
            check_adapter(ref, self.max_lora_rank, self.lora_target_modules)
        bound = self.max_loaded_loras
        if bound is not None and bound < max(self.max_loras_per_batch, len(adapters)):
            raise ValueError(
                f"--max-loaded-loras {bound} is below --max-loras-per-batch ({self.max_loras_per_batch}) "
                f"or the {len(adapters)} adapter(s) of --lora-paths"
            )

    def _check_hicache(self) -> None:
        """srt's hierarchical cache is the file backend's disk tier alone, under the radix cache."""
        backend = self.hicache_storage_backend
        if backend is not None and backend not in SGLANG_HICACHE_STORAGE_BACKENDS:
            raise ValueError(
                f"--hicache-storage-backend must be one of {', '.join(SGLANG_HICACHE_STORAGE_BACKENDS)}; got {backend!r}"
            )
        if backend not in (None, "file"):
            raise ValueError(f"--hicache-storage-backend {backend} is not implemented in srt; it has file")
        for name, default, why in HICACHE_FIXED:
            if getattr(self, name) != default:
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} is not supported ({why}); "
                    f"srt takes only its default, {default}"
                )
        if self.hicache_storage_max_size is not None:
            parse_size(self.hicache_storage_max_size, "--hicache-storage-max-size")
        if self.enable_hierarchical_cache != (backend is not None):
            raise ValueError(
                "--enable-hierarchical-cache needs --hicache-storage-backend file (srt has no host-memory tier)"
                if self.enable_hierarchical_cache
                else f"--hicache-storage-backend {backend} needs --enable-hierarchical-cache"
            )
        if self.enable_hierarchical_cache and (self.disable_radix_cache or self.is_embedding):
            flag = "--disable-radix-cache" if self.disable_radix_cache else "--is-embedding"
            raise ValueError(
                f"--enable-hierarchical-cache stores the radix cache's prefixes: not with {flag}"
            )
        if self.enable_hierarchical_cache and self.enable_return_routed_experts:
            raise ValueError(
                "--enable-hierarchical-cache keeps a prefix's KV, not its tokens' experts: "
                "not with --enable-return-routed-experts"
            )

    @property
    def disk_tier_on(self) -> bool:
        """Whether the radix cache has a tier on disk (mem_cache/disk_tier.py)."""
        return self.enable_hierarchical_cache and self.hicache_storage_backend == "file"

    @property
    def hicache_max_bytes(self) -> int:
        """The bound on the disk tier's bytes, the server's ranks together (0: none)."""
        size = self.hicache_storage_max_size
        return 0 if size is None else parse_size(size, "--hicache-storage-max-size")

    @property
    def lora_enabled(self) -> bool:
        """Whether requests may name adapters: --enable-lora, or adapters given (as SGLang)."""
        return self.enable_lora or bool(self.lora_paths)

    @property
    def lora_adapters(self) -> tuple[LoraRef, ...]:
        """--lora-paths' adapters in order: adapter id i + 1 is the i-th (srt/lora_config.py)."""
        return parse_lora_paths(self.lora_paths)

    @property
    def num_draft_tokens(self) -> int:
        """Rows a speculative step verifies per request (its last token and its drafts), and in all:
        the flag (or --speculative-num-steps + 1), else 4 on the CPU and SGLang's 12 on CUDA (the
        device flag, the same on every rank, never the rank's own hardware: ranks must draft alike)."""
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps + 1
        return NGRAM_NUM_DRAFT_TOKENS[self.device]

    # ---- derived ----
    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def deterministic(self) -> bool:
        """Whether the ranks run one arithmetic for prefill and decode: asked for, or needed by
        --restart-on-failure's replays (which re-prefill tokens first decoded); never with gguf."""
        return self.enable_deterministic_inference or (
            self.restart_on_failure > 0 and self.quantization != "gguf"
        )

    @property
    def model_name(self) -> str:
        """The name the API answers with (`model` of the OpenAI routes): --served-model-name, else
        --model-path as given (SGLang's default), else the bundled model's name."""
        return self.served_model_name or self.model_path or DEFAULT_MODEL_NAME

    @property
    def uses_cpu_kvcache_space(self) -> bool:
        """The KV space bounds the pool (mem_cache/budget.py): on CPU, unless --mem-fraction-static or
        --max-total-tokens is given without --cpu-kvcache-space."""
        explicit = self.mem_fraction_static is not None or self.max_total_tokens is not None
        return self.device == "cpu" and (self.cpu_kvcache_space is not None or not explicit)

    def replica_memory_share(self, replicas: int) -> dict[str, float]:
        """The memory flags of one of `replicas` servers on this host (--dp-size): each gets its
        share of the KV space, or of --mem-fraction-static (given, or CUDA's default)."""
        share: dict[str, float] = {}
        if self.uses_cpu_kvcache_space:
            share["cpu_kvcache_space"] = (self.cpu_kvcache_space or DEFAULT_CPU_KVCACHE_SPACE_GIB) / replicas
        if self.mem_fraction_static is not None or self.device != "cpu":
            share["mem_fraction_static"] = (
                self.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
            ) / replicas
        return share

    def to_dict(self) -> dict[str, Any]:
        """Every field, the secrets masked (this is what /server_info shows)."""
        values = dataclasses.asdict(self)
        for name in SECRET_ENV:
            if values[name] is not None:
                values[name] = "<set>"
        return values

    def secret_env(self) -> dict[str, str]:
        """The environment that gives the set secrets to another launch_server (to_cli leaves them out)."""
        return {env: getattr(self, name) for name, env in SECRET_ENV.items() if getattr(self, name)}

    def to_cli(self, **overrides: Any) -> list[str]:
        """The flags that give this configuration (with `overrides`) to another launch_server:
        every field that differs from its default."""
        values = {**dataclasses.asdict(self), **overrides}
        argv: list[str] = []
        for f in dataclasses.fields(self):
            if f.name in SECRET_ENV:
                continue
            value = values[f.name]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if value == default or value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, (list, tuple)):
                argv += [flag, *map(str, value)]
            elif isinstance(value, bool):
                if not value:
                    raise ValueError(f"{flag} cannot be turned off on the command line")
                argv.append(flag)
            else:
                argv += [flag, str(value)]
        return argv


@dataclass(frozen=True)
class PortArgs:
    """Where the processes of one node talk: ZMQ ipc endpoints and the torch.distributed rendezvous."""

    tokenizer_ipc: str  # TokenizerManager PUSH -> scheduler rank 0 PULL
    detokenizer_ipc: str  # output rank PUSH -> detokenizer PULL
    tokenizer_manager_ipc: str  # detokenizer PUSH -> TokenizerManager PULL
    dist_init_method: str  # tcp://host:port or env://

    @classmethod
    def create(cls, dist_init_method: str) -> PortArgs:
        root = tempfile.mkdtemp(prefix="srt-ipc-")
        return cls(
            tokenizer_ipc=f"ipc://{root}/tokenizer",
            detokenizer_ipc=f"ipc://{root}/detokenizer",
            tokenizer_manager_ipc=f"ipc://{root}/tokenizer_manager",
            dist_init_method=dist_init_method,
        )

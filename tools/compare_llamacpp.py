#!/usr/bin/env python3
"""Check llambda against llama.cpp on a real GGUF (needs llama-cpp-python).

    .venv/bin/python tools/compare_llamacpp.py MODEL.gguf
    .venv/bin/python tools/compare_llamacpp.py MODEL.gguf --prompt "Once upon a time" --steps 32

For each prompt (default: a few built-in ones): the token ids must equal
llama.cpp's; teacher-forced along llama.cpp's greedy path, llambda's argmax must
equal llama.cpp's token wherever llama.cpp's top-2 margin is at least --margin
logits (default 1.0); KL(llama.cpp || llambda) at the prompt end must be at most
--kl-max (default 0.05). Prints a table per prompt; exits 1 if any check fails,
2 on bad input or without llama-cpp-python.

    .venv/bin/python tools/compare_llamacpp.py MODEL.gguf --record tests/fixtures/NAME.json

also writes llama.cpp's side (ids, greedy path, top logits per step) for
llambda.bench.llamacpp_compare.check_recorded, so that make test checks the same file
without llama.cpp (tests/model/test_real_recorded.py).
"""
import argparse
import json
import sys

from llambda.errors import UserError
from llambda.bench.llamacpp_compare import (DEFAULT_KL_MAX, DEFAULT_MARGIN, DEFAULT_PROMPTS, DEFAULT_STEPS,
                                      Pair, compare_prompt, format_report, record_prompt)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; default: built-in ones)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="greedy steps (default %(default)s)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help="top-2 margin (logits) from which the argmax must agree (default %(default)s)")
    parser.add_argument("--kl-max", type=float, default=DEFAULT_KL_MAX,
                        help="largest KL at the prompt end, nats (default %(default)s)")
    parser.add_argument("--threads", type=int, help="threads on both sides (default: llambda's)")
    parser.add_argument("--record", metavar="OUT.json", help="also write llama.cpp's side for check_recorded")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    try:
        with Pair(args.model, prompts, steps=args.steps, threads=args.threads, progress=True) as pair:
            reports = [compare_prompt(pair, prompt, steps=args.steps, margin=args.margin,
                                      kl_max=args.kl_max) for prompt in prompts]
            for report in reports:
                print(format_report(report, pair.model.detokenize))
                print()
            if args.record:
                records = [record_prompt(pair, prompt, steps=args.steps) for prompt in prompts]
                with open(args.record, "w", encoding="utf-8") as f:
                    json.dump(dict(model=args.model.rsplit("/", 1)[-1], steps=args.steps, prompts=records), f)
                print(f"wrote {args.record}")
    except (UserError, ValueError, OSError) as error:
        print(f"compare_llamacpp: {error}", file=sys.stderr)
        return 2
    failed = sum(not r.ok for r in reports)
    print(f"{args.model}: {len(reports) - failed}/{len(reports)} prompts pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

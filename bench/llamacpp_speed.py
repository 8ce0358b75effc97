"""Does the server path keep what llama.cpp's quantization buys? Decode speed of GGUF types
against the same model's F16 file, through `llama-server` (quantbench's streaming client, as
`bench` measures) and through `llama-bench` (llama.cpp's own kernel-level benchmark), in one run.

The default model's F16 GGUF (made as `bench` makes it) is quantized to each `--types` with
llama-quantize; one llama-server per file (`--parallel 4`, every core) runs for the whole
measurement, and each round measures every file in turn (the order alternates between rounds):
decode tok/s at concurrency 1 (median over `--requests` streamed completions of
`--output-tokens`), output throughput at concurrency 4, and `llama-bench -p 0 -n OUTPUT_TOKENS -d
PROMPT_TOKENS -r 2` (decode at the depth the server decodes at, the servers idle). Prints per type:
the server's decode ratio candidate / F16 and llama-bench's, each with its 95 % interval over
rounds, and the fidelity, the server's ratio / llama-bench's in the same round (goal: >= 0.90, the
server must not eat the gain), with its interval; throughput at concurrency 4 too. llama-bench
is measured in every round, not once: on these shared cores one llama-bench run of a file moves
by up to a quarter between runs, which alone made a fidelity of 0.78 out of a faithful server.
Its last line is a JSON object. Says the CPU class: the ratios depend on it.

    python bench/llamacpp_speed.py [--types Q8_0,Q4_K_M,Q4_0] [--rounds 5] [--requests 5]
        [--output-tokens 64] [--prompt-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="a model source (default: the default model)")
    parser.add_argument("--types", default="Q8_0,Q4_K_M,Q4_0", help="llama-quantize types, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=5, help="streamed completions per file and round at concurrency 1")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from quantbench.core import hardware
    from quantbench.core.intervals import ratio_interval
    from quantbench.core.logs import configure_console
    from quantbench.engines import ServerSettings, get, llamacpp
    from quantbench.engines import llamacpp_build as build
    from quantbench.engines.server import http_client, model_server, stream_one
    from quantbench.sources import data, models
    from quantbench.speed.measure import prompts
    from quantbench.speed.serving import load_level

    configure_console()
    model = models.resolve(args.model, field="--model")
    tools = build.ensure("bench/llamacpp_speed.py")
    engine = get("llamacpp")
    engine.ensure("bench/llamacpp_speed.py")
    work = Path(tempfile.mkdtemp(prefix="qb-llamacpp-speed-"))
    log = work / "tools.log"
    files = {"F16": llamacpp.base_gguf(model.path, tools, log)}
    for kind in args.types.split(","):
        out = work / kind / "model.gguf"
        out.parent.mkdir()
        llamacpp.run_tool([tools.tool("llama-quantize"), str(files["F16"]), str(out), kind, str(llamacpp.threads())], log,
                          f"llama-quantize {kind}")
        files[kind] = out
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    texts = [tokenizer.decode(p) for p in prompts(ids, args.prompt_tokens, 4 * args.requests, seed=0)]
    cpu = hardware.cpu()
    print(f"{model.name}: F16 vs {args.types} through {engine.describe()} and llama-bench; {args.rounds} rounds, "
          f"{args.requests} requests of {args.output_tokens} tokens; CPU class {cpu.klass}, {llamacpp.threads()} threads",
          flush=True)

    def body(text: str) -> dict:
        return engine.request_body("m", text, args.output_tokens)

    settings = ServerSettings(args.prompt_tokens + args.output_tokens + 64, slots=4)
    decode: dict[str, list[float]] = {k: [] for k in files}
    throughput: dict[str, list[float]] = {k: [] for k in files}
    bench_tg: dict[str, list[float]] = {k: [] for k in files}

    def llama_bench(path: Path) -> float:
        out = subprocess.run([tools.tool("llama-bench"), "-m", str(path), "-p", "0", "-n", str(args.output_tokens),
                              "-d", str(args.prompt_tokens), "-t", str(llamacpp.threads()), "-r", "2", "-o", "json"],
                             capture_output=True, text=True, check=True)
        return next(row["avg_ts"] for row in json.loads(out.stdout) if row.get("n_gen"))

    with ExitStack() as stack:
        urls = {}
        for kind, path in files.items():
            url, _, _ = stack.enter_context(model_server(path, work / f"{kind}.log", engine, settings))
            urls[kind] = url
        client = stack.enter_context(http_client())
        order = list(files)
        for r in range(args.rounds):
            for kind in order if r % 2 == 0 else order[::-1]:
                rates = [stream_one(urls[kind], body(t), client).decode_tok_s for t in texts[: args.requests]]
                decode[kind].append(statistics.median(x for x in rates if x))
                level = load_level(urls[kind], [body(t) for t in texts[: 4 * 2]], concurrency=4, client=client)
                throughput[kind].append(level["throughput_tok_s"])
                bench_tg[kind].append(llama_bench(files[kind]))
            print(f"round {r + 1}: decode tok/s " + ", ".join(f"{k} {decode[k][-1]:.1f}" for k in files)
                  + "; llama-bench " + ", ".join(f"{k} {bench_tg[k][-1]:.1f}" for k in files), flush=True)

    def shown(interval) -> str:
        return f"[{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "[too few rounds for an interval]"

    result: dict = {"cpu_class": cpu.klass, "threads": llamacpp.threads(), "build": tools.describe(),
                    "f16_decode_tok_s": statistics.median(decode["F16"]),
                    "f16_llama_bench_tok_s": statistics.median(bench_tg["F16"])}
    for kind in files:
        if kind == "F16":
            continue
        ratios = [c / b for c, b in zip(decode[kind], decode["F16"])]
        references = [c / b for c, b in zip(bench_tg[kind], bench_tg["F16"])]
        fidelities = [s / b for s, b in zip(ratios, references)]  # round by round
        t_ratios = [c / b for c, b in zip(throughput[kind], throughput["F16"])]
        server, reference, fidelity = (statistics.geometric_mean(x) for x in (ratios, references, fidelities))
        # None with fewer rounds than an interval needs
        intervals = [ratio_interval(x) for x in (ratios, references, fidelities)]
        print(f"{kind}: server decode x{server:.2f} {shown(intervals[0])} ({statistics.median(decode[kind]):.1f} tok/s), "
              f"llama-bench x{reference:.2f} {shown(intervals[1])} ({statistics.median(bench_tg[kind]):.1f} tok/s), "
              f"server / llama-bench {fidelity:.2f} {shown(intervals[2])} (goal >= 0.90); throughput at "
              f"concurrency 4 x{statistics.geometric_mean(t_ratios):.2f}")
        result[kind] = {"server_decode_ratio": server, "server_decode_ratio_ci": intervals[0],
                        "llama_bench_ratio": reference, "llama_bench_ratio_ci": intervals[1],
                        "fidelity": fidelity, "fidelity_ci": intervals[2],
                        "c4_throughput_ratio": statistics.geometric_mean(t_ratios),
                        "decode_tok_s": statistics.median(decode[kind]),
                        "llama_bench_tok_s": statistics.median(bench_tg[kind])}
    print(json.dumps(result, default=list))


if __name__ == "__main__":
    main()

"""Fidelity of quantbench's serving client against vLLM's own (`vllm bench serve`).

One vLLM server (the managed environment, created if missing) for one model; the same prompts and
output lengths are measured by quantbench's client (the load level `bench` uses: N requests in
flight) and by `vllm bench serve` (`--dataset-name custom`, the same prompt texts, `--ignore-eos`,
greedy), interleaved round by round (the order alternates). Prints, per round and overall
(median over rounds), quantbench / vLLM for median TTFT, median ITL and output throughput, and as
its last line a JSON object {"ttft_ratio", "itl_ratio", "throughput_ratio", ...}. Goal: each
within 0.95-1.05.

    python bench/serving_fidelity.py [--model DIR] [--prompts 16] [--prompt-tokens 128]
        [--output-tokens 64] [--concurrency 1] [--rounds 3] [--compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="a model source (default: the default model)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="start vLLM compiled (default: eager; start-up only)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from quantbench import engines
    from quantbench.core import environment
    from quantbench.core.logs import configure_console
    from quantbench.engines import ServerSettings
    from quantbench.engines import vllm_env as vllm_engine
    from quantbench.engines.server import http_client, model_server, stream_one
    from quantbench.sources import data, models
    from quantbench.speed.measure import prompts
    from quantbench.speed.serving import load_level

    configure_console()
    model = models.resolve(args.model, field="--model")
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    texts = [tokenizer.decode(p) for p in prompts(ids, args.prompt_tokens, args.prompts, seed=0)]
    engine = vllm_engine.ensure("bench/serving_fidelity.py")
    work = Path(tempfile.mkdtemp(prefix="qb-fidelity-"))
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": t, "output_tokens": args.output_tokens}) + "\n" for t in texts))
    max_len = args.prompt_tokens + args.output_tokens + 64
    print(f"{model.name} through {engine.describe()} ({'compiled' if args.compile else 'eager'}); {args.prompts} prompts of "
          f"{args.prompt_tokens} tokens, {args.output_tokens} output tokens, concurrency {args.concurrency}, "
          f"{args.rounds} rounds; {environment.describe()['cpu']}, {environment.describe()['cpu_count']} cores", flush=True)

    ours: list[dict] = []
    theirs: list[dict] = []
    vllm = engines.get("vllm")
    settings = ServerSettings(max_len, compiled=args.compile, slots=args.concurrency)
    with model_server(model.path, work / "server.log", vllm, settings) as (url, name, _):
        bodies = [vllm.request_body(name, t, args.output_tokens) for t in texts]

        def quantbench_client() -> dict:
            with http_client() as client:  # one pool per run, as bench keeps one per repetition
                stream_one(url, bodies[0], client)  # one warm-up request, as vllm bench serve sends one first
                level = load_level(url, bodies, concurrency=args.concurrency, client=client)
            return {"ttft": level["ttft_ms_p50"], "itl": level["itl_ms_p50"], "throughput": level["throughput_tok_s"]}

        def vllm_client(round_: int) -> dict:
            result = work / f"vllm-{round_}.json"
            cmd = vllm_engine.bench_serve_command(
                engine, "--backend", "vllm", "--base-url", url.removesuffix("/v1"), "--model", name, "--tokenizer",
                str(model.path), "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
                "--skip-chat-template", "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
                "--ignore-eos", "--temperature", "0", "--seed", "0", "--save-result", "--result-dir", str(work),
                "--result-filename", result.name, "--disable-tqdm")
            done = subprocess.run(cmd, capture_output=True, text=True, env=vllm_engine.server_env(work))
            if done.returncode != 0:
                raise SystemExit(f"vllm bench serve failed (exit {done.returncode}): {done.stderr[-2000:]}")
            r = json.loads(result.read_text())
            if r["completed"] != args.prompts or r["total_output_tokens"] != args.prompts * args.output_tokens:
                raise SystemExit(f"vllm bench serve completed {r['completed']} requests, {r['total_output_tokens']} tokens")
            return {"ttft": r["median_ttft_ms"], "itl": r["median_itl_ms"], "throughput": r["output_throughput"]}

        for round_ in range(args.rounds):
            order = ("quantbench", "vllm") if round_ % 2 == 0 else ("vllm", "quantbench")
            for who in order:
                if who == "quantbench":
                    ours.append(quantbench_client())
                else:
                    theirs.append(vllm_client(round_))
            a, b = ours[-1], theirs[-1]
            print(f"round {round_ + 1} ({' then '.join(order)}): TTFT {a['ttft']:.1f} / {b['ttft']:.1f} ms, ITL "
                  f"{a['itl']:.2f} / {b['itl']:.2f} ms, throughput {a['throughput']:.1f} / {b['throughput']:.1f} tok/s", flush=True)
    ratios = {}
    print(f"{'median over rounds':22s} {'quantbench':>11s} {'vllm bench':>11s} {'ratio':>7s}")
    for key, label in (("ttft", "TTFT p50 ms"), ("itl", "ITL p50 ms"), ("throughput", "output tok/s")):
        q, v = statistics.median(r[key] for r in ours), statistics.median(r[key] for r in theirs)
        ratios[f"{key}_ratio"] = q / v
        print(f"{label:22s} {q:11.2f} {v:11.2f} {q / v:7.3f}")
    print(json.dumps({**{k: round(v, 4) for k, v in ratios.items()}, "rounds": args.rounds, "prompts": args.prompts,
                      "concurrency": args.concurrency, "engine": engine.describe(), "model": model.name,
                      "at": time.strftime("%Y-%m-%d %H:%M")}))


if __name__ == "__main__":
    main()

"""Fidelity of quantbench's goodput under SLOs against `vllm bench serve --goodput`.

One server (llama.cpp's by default, on the default model's F16 GGUF; `--engine vllm` for vLLM's);
the same prompts (`--dataset-name custom`, the same texts, `--ignore-eos`, greedy), the same
Poisson request rates and the same SLOs on each request's TTFT and end-to-end latency, measured by
quantbench's load level (`load_level(rate=R, slo=...)`, what a `sweep:` profile runs) and by
`vllm bench serve`, interleaved round by round (the order alternates). Arrivals are evenly spaced by
default (`--arrivals constant`; vLLM's client with `--burstiness 10000`): with a few dozen requests,
two independent Poisson draws are two different loads (measured: quantbench's seeded draw at 1/s
sent its 24 requests in 16 s, a burstier load than vLLM's draw, and saw 25 % meet the SLOs). Prints, per rate, the
goodput (requests/s meeting every SLO) and request throughput of each with their ratio, the highest
rate at which at least 95 % of requests met the SLOs (each client's "SLO rate"), and as its last
line a JSON object {"goodput_ratio", "throughput_ratio", "slo_rate_ratio", ...}. Goal: each within
0.95-1.05.

    python bench/goodput_fidelity.py [--engine llamacpp|vllm] [--rates 1,2,3,4] [--prompts 24]
        [--prompt-tokens 128] [--output-tokens 32] [--ttft-ms 250] [--e2e-ms 2000] [--rounds 2]
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
    parser.add_argument("--engine", default="llamacpp", choices=["llamacpp", "vllm"])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="a model source (default: the default model)")
    parser.add_argument("--rates", default="1,2,3,4", help="request rates (requests/s), comma-separated")
    parser.add_argument("--prompts", type=int, default=24, help="requests per rate")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--ttft-ms", type=float, default=250.0, help="SLO on each request's time to first token")
    parser.add_argument("--e2e-ms", type=float, default=2000.0, help="SLO on each request's end-to-end latency")
    parser.add_argument("--slots", type=int, default=4, help="requests the server serves at once")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arrivals", default="constant", choices=["constant", "poisson"],
                        help="constant (default): both clients send at the same evenly spaced times (vllm bench serve "
                        "with --burstiness 10000: gamma intervals of negligible spread); poisson: each client draws its "
                        "own arrival times, so with a few dozen requests the two loads differ")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    from transformers import AutoTokenizer

    from quantbench import engines
    from quantbench.core import environment
    from quantbench.core.logs import configure_console
    from quantbench.engines import ServerSettings, vllm_env
    from quantbench.engines.server import http_client, model_server, stream_one
    from quantbench.sources import data, models
    from quantbench.speed.measure import prompts
    from quantbench.speed.serving import load_level

    configure_console()
    model = models.resolve(args.model, field="--model")
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    texts = [tokenizer.decode(p) for p in prompts(ids, args.prompt_tokens, args.prompts, seed=0)]
    engine = engines.get(args.engine)
    engine.ensure("bench/goodput_fidelity.py")
    client_env = vllm_env.ensure("bench/goodput_fidelity.py: vllm bench serve")
    work = Path(tempfile.mkdtemp(prefix="qb-goodput-"))
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": t, "output_tokens": args.output_tokens}) + "\n" for t in texts))
    slo = {"ttft_ms_p95": args.ttft_ms, "e2e_ms_p95": args.e2e_ms}  # per request: its TTFT and e2e within each
    settings = ServerSettings(args.prompt_tokens + args.output_tokens + 64, compiled=False, slots=args.slots)
    cpu = environment.describe()
    print(f"{model.name} through {engine.describe()}; {args.prompts} prompts of {args.prompt_tokens} tokens, "
          f"{args.output_tokens} output tokens, {args.arrivals} arrivals at {rates}/s, SLOs TTFT <= {args.ttft_ms:g} ms and "
          f"e2e <= {args.e2e_ms:g} ms, {args.rounds} rounds; {cpu['cpu']}, {cpu['cpu_count']} cores", flush=True)

    ours: dict[float, list[dict]] = {r: [] for r in rates}
    theirs: dict[float, list[dict]] = {r: [] for r in rates}
    with model_server(model.path, work / "server.log", engine, settings) as (url, name, _):
        bodies = [engine.request_body(name, t, args.output_tokens) for t in texts]  # ignore_eos, as vllm bench serve's

        def quantbench_client(rate: float, round_: int) -> dict:
            with http_client() as client:
                stream_one(url, bodies[0], client)  # one warm-up request, as vllm bench serve sends one first
                level = load_level(url, bodies, rate=rate, seed=round_, client=client, slo=slo, arrivals=args.arrivals)
            return {"goodput": level["goodput_rps"], "throughput": level["requests_s"], "met": level["slo_pct"] / 100,
                    "saturated": bool(level.get("saturated"))}

        def vllm_client(rate: float, round_: int) -> dict:
            result = work / f"vllm-{rate:g}-{round_}.json"
            cmd = vllm_env.bench_serve_command(
                client_env, "--backend", "vllm" if args.engine == "vllm" else "openai", "--base-url",
                url.removesuffix("/v1"), "--model", name, "--tokenizer", str(model.path), "--dataset-name", "custom",
                "--dataset-path", str(dataset), "--custom-output-len", "-1", "--skip-chat-template", "--num-prompts",
                str(args.prompts), "--request-rate", f"{rate:g}", "--ignore-eos", "--temperature", "0", "--seed",
                str(round_), "--burstiness", "10000" if args.arrivals == "constant" else "1",
                "--goodput", f"ttft:{args.ttft_ms:g}", f"e2el:{args.e2e_ms:g}", "--save-result",
                "--result-dir", str(work), "--result-filename", result.name, "--disable-tqdm")
            done = subprocess.run(cmd, capture_output=True, text=True, env=vllm_env.server_env(work))
            if done.returncode != 0:
                raise SystemExit(f"vllm bench serve failed (exit {done.returncode}): {done.stderr[-2000:]}")
            r = json.loads(result.read_text())
            if r["completed"] != args.prompts:
                raise SystemExit(f"vllm bench serve completed {r['completed']} of {args.prompts} requests")
            return {"goodput": r["request_goodput"], "throughput": r["request_throughput"],
                    "met": r["request_goodput"] / r["request_throughput"], "saturated": False}

        for round_ in range(args.rounds):
            order = ("quantbench", "vllm") if round_ % 2 == 0 else ("vllm", "quantbench")
            for rate in rates:
                for who in order:
                    if who == "quantbench":
                        ours[rate].append(quantbench_client(rate, round_))
                    else:
                        theirs[rate].append(vllm_client(rate, round_))
                a, b = ours[rate][-1], theirs[rate][-1]
                print(f"round {round_ + 1}, {rate:g}/s ({' then '.join(order)}): goodput {a['goodput']:.2f} / "
                      f"{b['goodput']:.2f} req/s, throughput {a['throughput']:.2f} / {b['throughput']:.2f} req/s, "
                      f"met {a['met']:.0%} / {b['met']:.0%}" + (" (quantbench: saturated)" if a["saturated"] else ""),
                      flush=True)

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def slo_rate(rows: dict[float, list[dict]]) -> float:
        best = 0.0
        for rate in sorted(rows):
            if med(rows[rate], "met") < 0.95:
                break
            best = rate
        return best

    print(f"{'rate':>6s} {'goodput qb':>11s} {'goodput vllm':>13s} {'ratio':>6s} {'req/s qb':>9s} {'req/s vllm':>11s} {'ratio':>6s}")
    goodput_ratios, throughput_ratios = [], []
    for rate in rates:
        gq, gv = med(ours[rate], "goodput"), med(theirs[rate], "goodput")
        tq, tv = med(ours[rate], "throughput"), med(theirs[rate], "throughput")
        if gv > 0:
            goodput_ratios.append(gq / gv)
        throughput_ratios.append(tq / tv)
        print(f"{rate:6g} {gq:11.3f} {gv:13.3f} {gq / gv if gv else float('nan'):6.3f} {tq:9.3f} {tv:11.3f} {tq / tv:6.3f}")
    sq, sv = slo_rate(ours), slo_rate(theirs)
    print(f"SLO rate (highest rate with >= 95 % of requests meeting the SLOs): quantbench {sq:g}/s, vllm bench {sv:g}/s")
    print(json.dumps({
        "goodput_ratio": round(statistics.median(goodput_ratios), 4) if goodput_ratios else None,
        "throughput_ratio": round(statistics.median(throughput_ratios), 4),
        "slo_rate_ratio": round(sq / sv, 4) if sv else None,
        "slo_rate_quantbench": sq, "slo_rate_vllm": sv, "rates": rates, "rounds": args.rounds,
        "prompts": args.prompts, "engine": engine.describe(), "model": model.name, "cpu": cpu["cpu"],
        "at": time.strftime("%Y-%m-%d %H:%M")}))


if __name__ == "__main__":
    main()

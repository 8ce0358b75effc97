"""Which engine a speed was measured through, where it matters: the gate's `speed_engine`
(default `serving`: a speed check passes only on numbers from a serving engine) and compare's
"speed via" column, on the session's real runs (benched in-process, `hf`) and hand-made ones."""

import json

import yaml

from quantbench.cli import main
from quantbench.tracking import Tracker
from tests.helpers import last_json


def gate(workdir, run_id: str, policy: dict, capsys) -> tuple[int, dict]:
    (workdir / "policies").mkdir(exist_ok=True)
    (workdir / "policies" / "p.yaml").write_text(yaml.safe_dump(policy))
    code = main(["gate", run_id, "--policy", "p", "--json"])
    return code, last_json(capsys.readouterr().out)


def test_a_speed_measured_in_process_does_not_pass_a_serving_policy(workdir, scored_runs, capsys):
    run_id = scored_runs["gptq"]  # benched with engine hf
    policy = {"stages": ["quantize", "bench"], "min": {"speedup/decode_tok_s": 0.0}, "registry": {"model": "tiny-engine"}}
    code, report = gate(workdir, run_id, policy, capsys)
    check = next(c for c in report["checks"] if c["check"] == "speedup/decode_tok_s")
    assert code == 1 and not report["passed"] and not check["passed"] and check["value"] > 0
    assert check["note"].startswith("measured through hf: not a serving engine (policy speed_engine: serving)")
    assert report["registered"] is None
    code, report = gate(workdir, run_id, {**policy, "speed_engine": "any"}, capsys)
    assert code == 0 and report["passed"]
    # the release policy uses the default
    from quantbench.release.gate import load_policy
    from tests.speed.test_bench import REPO

    assert load_policy(str(REPO / "policies" / "release.yaml")).policy.speed_engine == "serving"


def test_compare_says_which_engine_measured_each_speed(workdir, scored_runs, capsys):
    tracker = Tracker()
    with tracker.start_run("served", {"quantbench.role": "candidate", "quantbench.recipe": "served",
                                      "quantbench.bench_backend": "serve", "quantbench.bench_server": "vllm"}) as run:
        run.log_metrics({"quality/kld_mean": 0.1, "speedup/decode_tok_s": 1.4})
    served = run.run_id
    assert main(["compare", "--runs", served, scored_runs["gptq"], scored_runs["fp8"], "--json"]) == 0
    out = capsys.readouterr().out
    result = {c["recipe"]: c for c in last_json(out)["candidates"]}
    assert result["served"]["speed_engine"] == "vllm" and result["served"]["serving_engine"] is True
    assert result["gptq"]["speed_engine"] == "hf: not a serving engine" and result["gptq"]["serving_engine"] is False
    assert result["fp8"]["speed_engine"] is None and result["fp8"]["serving_engine"] is None  # not benched
    table = out.split("\n★ Pareto")[0]
    row = next(line for line in table.splitlines() if " gptq " in line)
    assert "hf: not a serving engine" in row
    assert json.loads(out.strip().splitlines()[-1])["speed"] == "speedup/decode_tok_s"

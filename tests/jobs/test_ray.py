"""`quantbench sweep NAME --ray ADDRESS` on a real multi-node Ray cluster on this machine (a head
with no CPUs and two worker nodes with different resources, ray.cluster_utils.Cluster), the tiny
model and a real MLflow store: jobs land on the node their resources name, a node that dies
mid-job costs one attempt and no second FINISHED run, a timeout kills the attempt on its node, a
driver killed with SIGKILL leaves nothing running and the sweep resumes, and bad input fails at
once. The team path (PostgreSQL + S3, the checkpoint downloaded elsewhere) is in
test_team_tracking.py."""

import importlib.util
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from quantbench.cli import main
from tests.helpers import last_json, runs, tiny_recipe, write_recipe
from tests.jobs.test_sweep import state, sweep_children, write_sweep

STORE = 80 * 2**20  # object store per node: the sweep moves only logs and small results
if importlib.util.find_spec("ray") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI needs Ray for these tests: pip install -e '.[test]' brings it")
    pytest.skip("Ray is not installed here (pip install -e '.[ray]')", allow_module_level=True)


def candidates() -> list:
    return [r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def held(address: str) -> dict:
    """CPUs and GPUs of the cluster that some actor holds (Ray's view, from a short connection)."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    try:
        deadline = time.monotonic() + 10  # the view of what is free follows the nodes by a moment
        while True:
            total, free = ray.cluster_resources(), ray.available_resources()
            busy = {k: total[k] - free.get(k, 0) for k in ("CPU", "GPU") if total.get(k, 0) - free.get(k, 0) > 0}
            if not busy or time.monotonic() > deadline:
                return busy
            time.sleep(0.5)
    finally:
        ray.shutdown()


def sweep_driver(workdir, cluster, name: str) -> subprocess.Popen:
    """`quantbench sweep NAME --ray ADDRESS` as a process of its own (the test can kill it);
    its stderr goes to workdir/driver.err."""
    return subprocess.Popen([sys.executable, "-m", "quantbench", "sweep", name, "--ray", cluster["address"]], cwd=workdir,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=open(workdir / "driver.err", "w"))


def first_running(driver: subprocess.Popen, workdir, cluster, recipe: str = "any"):
    """The run of `recipe` once seen RUNNING while the driver runs; if not within 120 s, the test
    fails with what the driver said and what Ray holds."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.3)
        found = next((r for r in candidates() if r.info.status == "RUNNING" and r.data.tags["quantbench.recipe"] == recipe
                      and "quantbench.ray_node" in r.data.tags), None)
        if found is not None:
            return found
    driver.kill()
    driver.wait()
    pytest.fail(f"no job started (the driver: exit {driver.returncode}; held on the cluster: {held(cluster['address'])}); "
                f"the driver's stderr:\n{(workdir / 'driver.err').read_text()[-3000:]}")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    # a dead node is noticed in ~3 s instead of Ray's default ~15 s
    health = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": STORE, "include_dashboard": False, "_system_config": health})
    nodes = {"gpu": c.add_node(num_cpus=1, num_gpus=1, object_store_memory=STORE),  # Ray counts the GPU; none is used
             "cpu": c.add_node(num_cpus=2, object_store_memory=STORE)}
    c.wait_for_nodes()
    try:
        yield {"cluster": c, "address": c.address, "nodes": nodes}
    finally:
        c.shutdown()


@pytest.fixture
def recipes(cluster, workdir, tiny_model_dir):
    from tests.conftest import TINY_SUITE

    # fp8 asks the node with the GPU, gptq two CPUs (only the other node has two); "any" fits both.
    # fp8 and gptq are RUNNING for a fraction of a second; "any" evaluates as well, for seconds, so
    # that a test can catch it mid-run (and stop it before its end: on a fast CPU a 6-item suite
    # once ended the run between the test seeing it RUNNING and stopping it, hence 48 items)
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE.replace("task_limit: 6", "task_limit: 48")
                                                  .replace("tokens: 640", "tokens: 4096"))
    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n") + "resources:\n  num_gpus: 1\n")
    write_recipe(workdir, "gptq", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n") +
                 "resources:\n  num_cpus: 2\n  num_gpus: 0\n")
    write_recipe(workdir, "any", tiny_recipe(tiny_model_dir, "method: fp8\n") +
                 "evaluate:\n  suite: tiny\nresources:\n  num_gpus: 0\n")
    runs()  # the store exists before a driver process and this one open it at once
    yield
    deadline = time.monotonic() + 30
    while sweep_children() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sweep_children() == [], "a job process was left behind"
    assert held(cluster["address"]) == {}, "an actor of the test still holds resources on the cluster"


@pytest.mark.slow
def test_jobs_land_on_the_nodes_their_resources_name(cluster, workdir, recipes, capsys):
    name = write_sweep(workdir, "both", {"recipes": ["fp8", "gptq"], "concurrency": 2, "retries": 0})
    assert main(["sweep", name, "--ray", cluster["address"], "--json"]) == 0
    out = capsys.readouterr()
    summary = last_json(out.out)
    assert summary["counts"] == {"finished": 2, "skipped": 0, "failed": 0}
    assert summary["executor"]["name"] == "ray" and summary["executor"]["started_local"] is False
    assert len(summary["executor"]["nodes"]) == 3
    nodes = {kind: node.node_id for kind, node in cluster["nodes"].items()}
    jobs = {j["id"]: j for j in summary["jobs"]}
    assert jobs["fp8"]["attempts"][0]["node"] == nodes["gpu"] and jobs["gptq"]["attempts"][0]["node"] == nodes["cpu"]
    by_recipe = {r.data.tags["quantbench.recipe"]: r for r in candidates()}
    assert {k: r.data.tags["quantbench.ray_node"] for k, r in by_recipe.items()} == {"fp8": nodes["gpu"], "gptq": nodes["cpu"]}
    assert all(r.info.status == "FINISHED" for r in by_recipe.values())
    for job in jobs.values():  # each attempt's log came back from its node, whole
        text = open(job["attempts"][0]["log"]).read()
        assert last_json(text)["run_id"] == job["run_id"] and "[2/2] reload check" in text
        assert by_recipe[job["id"]].data.tags["quantbench.attempt"] == job["attempts"][0]["attempt"]


@pytest.mark.slow
def test_a_node_lost_mid_job_costs_one_attempt_and_no_second_run(cluster, workdir, recipes, capsys):
    name = write_sweep(workdir, "lost", {"recipes": ["any"], "retries": 1, "backoff_s": 0})
    sweep = subprocess.Popen([sys.executable, "-m", "quantbench", "sweep", name, "--ray", cluster["address"], "--json"],
                             cwd=workdir, stdout=subprocess.PIPE, stderr=open(workdir / "driver.err", "w"), text=True)
    victim = first_running(sweep, workdir, cluster)
    # the machine goes away: the job cannot react (stopped), its actor and its raylet die, then the job
    job_pid = int(victim.data.tags["quantbench.owner"].split()[1])
    os.killpg(job_pid, signal.SIGSTOP)
    os.kill(psutil.Process(job_pid).ppid(), signal.SIGKILL)
    kind = next(k for k, n in cluster["nodes"].items() if n.node_id == victim.data.tags["quantbench.ray_node"])
    cluster["cluster"].remove_node(cluster["nodes"][kind], allow_graceful=False)
    os.killpg(job_pid, signal.SIGKILL)
    out, _ = sweep.communicate(timeout=240)
    try:
        assert sweep.returncode == 0, (workdir / "driver.err").read_text()[-3000:]
        [job] = last_json(out)["jobs"]
        first, second = job["attempts"]
        assert first["node"] == victim.data.tags["quantbench.ray_node"] and second["node"] != first["node"]
        assert first["reason"].startswith("lost with Ray node") and first["run_id"] == victim.info.run_id
        assert job["status"] == "finished" and job["run_id"] == second["run_id"]
        stale = next(r for r in candidates() if r.info.run_id == victim.info.run_id)
        assert stale.info.status == "FAILED" and "lost with Ray node" in stale.data.tags["quantbench.error"]
        assert [r.info.status for r in candidates() if r.info.status != "FAILED"] == ["FINISHED"]  # exactly one
        assert not alive(job_pid)
    finally:  # the cluster gets its node back for the next tests
        spec = {"gpu": {"num_cpus": 1, "num_gpus": 1}, "cpu": {"num_cpus": 2}}[kind]
        cluster["nodes"][kind] = cluster["cluster"].add_node(**spec, object_store_memory=STORE)
        cluster["cluster"].wait_for_nodes()


@pytest.mark.slow
def test_a_timeout_kills_the_attempt_on_its_node(cluster, workdir, recipes, capsys):
    # 2 s: the job is still importing llm-compressor then (about 5 s on an idle machine here)
    name = write_sweep(workdir, "slow", {"recipes": ["any"], "timeout_s": 2, "retries": 0})
    started = time.monotonic()
    assert main(["sweep", name, "--ray", cluster["address"], "--json"]) == 1
    [job] = last_json(capsys.readouterr().out)["jobs"]
    [attempt] = job["attempts"]
    assert job["status"] == "failed" and attempt["reason"] == "timeout after 2 s"
    assert attempt["pid"] and not alive(attempt["pid"])  # killed on its node, not merely given up on
    assert attempt["node"] in {n.node_id for n in cluster["nodes"].values()}
    assert time.monotonic() - started < 60
    assert all(r.info.status != "RUNNING" for r in runs())


@pytest.mark.slow
def test_the_driver_killed_then_resumed(cluster, workdir, recipes, capsys):
    name = write_sweep(workdir, "killed", {"recipes": ["fp8", "any"], "concurrency": 2, "retries": 0})
    driver = sweep_driver(workdir, cluster, name)
    for recipe in ("any", "fp8"):  # a tiny model's run can end between a look and the stop: then the other
        victim = first_running(driver, workdir, cluster, recipe)
        job_pid = int(victim.data.tags["quantbench.owner"].split()[1])
        actor_pid = psutil.Process(job_pid).ppid()
        os.killpg(job_pid, signal.SIGSTOP)  # the job cannot finish while Ray notices that its driver is gone
        try:
            if next(r for r in candidates() if r.info.run_id == victim.info.run_id).info.status == "RUNNING":
                break
        except Exception as exc:  # stopped holding the store's write lock: the other job then
            assert "database is locked" in str(exc), exc
        os.killpg(job_pid, signal.SIGCONT)
    else:
        pytest.fail("no job's run held while RUNNING")
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 60
    while alive(actor_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(actor_pid), "Ray did not end the actor of a dead driver"
    os.killpg(job_pid, signal.SIGCONT)  # the SIGTERM its actor's death sent is delivered now
    deadline = time.monotonic() + 60
    while sweep_children() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sweep_children() == []
    assert state(workdir, name)["jobs"][victim.data.tags["quantbench.recipe_sha"]]["status"] == "running"
    ended = next(r for r in candidates() if r.info.run_id == victim.info.run_id)
    assert ended.info.status == "KILLED", ended.data.tags.get("quantbench.error")  # the job ended its own run
    assert not list((workdir / "outputs" / victim.data.tags["quantbench.recipe"]).glob("*.partial"))

    assert main(["sweep", name, "--ray", cluster["address"], "--json"]) == 0
    summary = last_json(capsys.readouterr().out)
    statuses = {j["id"]: j["status"] for j in summary["jobs"]}
    assert statuses[victim.data.tags["quantbench.recipe"]] == "finished"  # the killed job ran again
    # the other one may have FINISHED before the driver was killed (then it is skipped now)
    assert set(statuses) == {"fp8", "any"} and set(statuses.values()) <= {"finished", "skipped"}
    assert all(r.info.status != "RUNNING" for r in runs())
    finished = [r.data.tags["quantbench.recipe_sha"] for r in candidates() if r.info.status == "FINISHED"]
    assert len(finished) == len(set(finished)) == 2


@pytest.mark.slow
def test_the_driver_interrupted_stops_its_jobs_on_their_nodes(cluster, workdir, recipes):
    name = write_sweep(workdir, "stopped", {"recipes": ["any"], "retries": 0})
    driver = sweep_driver(workdir, cluster, name)
    victim = first_running(driver, workdir, cluster)
    driver.send_signal(signal.SIGTERM)  # as Ctrl-C
    assert driver.wait(60) == 130, (workdir / "driver.err").read_text()[-3000:]
    [job] = state(workdir, name)["jobs"].values()
    assert job["status"] == "pending" and job["attempts"][0]["reason"] == "the sweep was interrupted"
    assert job["attempts"][0]["pid"] == int(victim.data.tags["quantbench.owner"].split()[1])
    assert not alive(job["attempts"][0]["pid"])
    stopped = next(r for r in candidates() if r.info.run_id == victim.info.run_id)
    assert stopped.info.status == "KILLED"  # the job was told, and said so itself (its log came back to the end);
    # or, busy in native code past the grace (once in CI, beside vLLM's tests), it was killed and the driver said so
    said = open(job["attempts"][0]["log"]).read().strip().endswith("interrupted")
    assert said or "did not end the run within the grace and was killed" in stopped.data.tags["quantbench.error"]


@pytest.mark.slow
def test_resources_no_node_has_fail_after_the_placement_timeout(cluster, workdir, recipes, capsys):
    name = write_sweep(workdir, "huge", {"recipes": ["any"], "set": ["resources.num_gpus=4"], "placement_timeout_s": 2,
                                         "retries": 2, "backoff_s": 0})
    started = time.monotonic()
    assert main(["sweep", name, "--ray", cluster["address"], "--json"]) == 1
    [job] = last_json(capsys.readouterr().out)["jobs"]
    assert job["status"] == "failed" and len(job["attempts"]) == 1  # retrying cannot help
    assert job["reason"].startswith("Ray cannot place it: it requires {CPU: 1, GPU: 4} for placement, and no node of the "
                                    "cluster has that (nodes: ")
    assert "{CPU: 1, GPU: 1" in job["reason"] and "gave up after 2 s" in job["reason"]
    assert time.monotonic() - started < 30
    assert candidates() == []


def test_an_unreachable_address_fails_at_once(workdir, tiny_model_dir, capsys):
    from quantbench.core.processes import free_port

    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n"))
    name = write_sweep(workdir, "one", {"recipes": ["fp8"]})
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main(["sweep", name, "--ray", address]) == 2
    err = capsys.readouterr().err
    assert f"error: --ray {address}: no Ray cluster answers at {address}" in err
    assert time.monotonic() - started < 15
    assert not (workdir / "outputs").exists() and runs() == []


def test_without_ray_installed_the_message_says_how(workdir, tiny_model_dir, monkeypatch, capsys):
    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n"))
    name = write_sweep(workdir, "one", {"recipes": ["fp8"]})
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does where the extra is missing
    assert main(["sweep", name, "--ray"]) == 2
    assert "--ray needs Ray, which is not installed in this environment: pip install -e '.[ray]'" in capsys.readouterr().err
    assert not (workdir / "outputs").exists()


def test_a_local_tracking_store_is_refused_when_nodes_are_elsewhere(workdir):
    from quantbench.core.errors import UserError
    from quantbench.jobs.ray_executor import RayExecutor, _is_here
    from quantbench.tracking import Tracker

    assert _is_here({"NodeManagerAddress": "127.0.0.1"})
    assert not _is_here({"NodeManagerAddress": "203.0.113.7"})  # TEST-NET-3: never this machine
    executor = RayExecutor.__new__(RayExecutor)  # the check alone, on a cluster that has a node elsewhere
    executor.foreign = ["gpu-box (203.0.113.7)"]
    with pytest.raises(UserError) as caught:
        executor.check_store(Tracker())
    message = caught.value.problems[0]
    assert "the tracking store is on this machine's disk (sqlite:///" in message and "gpu-box (203.0.113.7)" in message
    assert "mlflow server --backend-store-uri" in message and "MLFLOW_TRACKING_URI=http://" in message
    executor.foreign = []
    executor.check_store(Tracker())  # every node is this machine: a local store will do


def test_resources_come_from_the_recipe_then_the_sweep_then_the_method(workdir, tiny_model_dir):
    from quantbench.jobs.sweep import load_sweep
    from quantbench.recipe import load_recipe

    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n") + "resources:\n  num_gpus: 1\n")
    write_recipe(workdir, "gptq", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n"))
    write_sweep(workdir, "r", {"recipes": ["fp8", "gptq"], "resources": {"num_cpus": 4, "num_gpus": 0}})
    _, _, jobs = load_sweep("r")
    assert {j.id: j.resources for j in jobs} == {"fp8": {"num_cpus": 4, "num_gpus": 1, "memory_gb": None},
                                                 "gptq": {"num_cpus": 4, "num_gpus": 0, "memory_gb": None}}
    gptq = load_recipe(workdir / "recipes" / "gptq.yaml")
    assert gptq.resources() == {"num_cpus": 1, "num_gpus": None, "memory_gb": None}  # the method's; GPU if the cluster has one
    moved = load_recipe(workdir / "recipes" / "gptq.yaml", ["resources.memory_gb=32"])
    assert moved.resources()["memory_gb"] == 32 and moved.sha == gptq.sha  # where it runs is not what it computes


def write_tiny_tune(workdir, model_dir, resources: str) -> None:
    """The tiny suite, an RTN template `tiny-rtn` asking the cluster for `resources`, and a `loose` policy."""
    import yaml

    from tests.conftest import TINY_SUITE

    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    write_recipe(workdir, "tiny-rtn", tiny_recipe(model_dir, "method: rtn\ngroup_size: 64\n")
                 + "evaluate:\n  suite: tiny\n" + resources)
    (workdir / "policies").mkdir()
    (workdir / "policies" / "loose.yaml").write_text(yaml.safe_dump({
        "stages": ["quantize", "evaluate"], "max": {"quality/kld_mean": 1.0}, "registry": {"model": "tiny-{recipe}"}}))


@pytest.mark.slow
def test_tune_quantizes_its_candidates_on_the_cluster(cluster, workdir, tiny128_model_dir, capsys):
    """`tune --ray`: the search stays here, each candidate runs through the sweep's attempt loop on a
    Ray node, tagged with that node, as a child of the tune run."""
    write_tiny_tune(workdir, tiny128_model_dir, "resources:\n  num_gpus: 0\n")
    args = ["tune", "--policy", "loose", "--from", "tiny-rtn", "--sensitivity-windows", "2", "--bits", "6",
            "--budget-runs", "1", "--ray", cluster["address"], "--json"]
    assert main(args) == 0
    summary = last_json(capsys.readouterr().out)
    [cand] = [r for r in candidates() if r.data.tags.get("quantbench.tune") == summary["tune"]]
    assert cand.info.run_id == summary["best_run"] and cand.info.status == "FINISHED"
    assert cand.data.tags["quantbench.ray_node"] in {n.node_id for n in cluster["nodes"].values()}
    assert cand.data.tags["mlflow.parentRunId"] == summary["parent_run"]
    assert summary["passed"] is True


@pytest.mark.slow
def test_tune_parallel_measures_a_round_of_candidates_at_once(cluster, workdir, tiny128_model_dir, capsys):
    """`tune --ray --parallel 2`: a round of the budget search hands two candidates to the cluster
    at once (both started before either ends), each a child run on a node; --budget-runs counts
    candidates, and the answer is the smallest that passes."""
    write_tiny_tune(workdir, tiny128_model_dir, "resources:\n  num_cpus: 1\n  num_gpus: 0\n")
    args = ["tune", "--policy", "loose", "--from", "tiny-rtn", "--sensitivity-windows", "2", "--budget-runs", "2",
            "--parallel", "2", "--ray", cluster["address"], "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    summary = last_json(out)
    events = [line.split()[1] for line in err.splitlines() if line[8:15] in (" start ", " done  ")]
    assert events == ["start", "start", "done", "done"]  # the round's two candidates ran together
    mine = [r for r in candidates() if r.data.tags.get("quantbench.tune") == summary["tune"]]
    assert len(mine) == 2 and {r.info.status for r in mine} == {"FINISHED"}
    assert {r.data.tags["mlflow.parentRunId"] for r in mine} == {summary["parent_run"]}
    assert all(r.data.tags["quantbench.ray_node"] in {n.node_id for n in cluster["nodes"].values()} for r in mine)
    sizes = {r.info.run_id: r.data.metrics["model/size_mb"] for r in mine}
    assert summary["passed"] is True and sizes[summary["best_run"]] == min(sizes.values())

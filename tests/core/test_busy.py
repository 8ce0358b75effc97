"""core/busy.py: what else used the machine during a measurement, and when its figures cannot be trusted."""

import subprocess
import sys
import time

from quantbench.core.busy import OTHERS_LIMIT, SPREAD_LIMIT, Busy, BusyWatch


def test_judged_busy_by_other_processes_steal_or_a_wide_interval():
    quiet = Busy(others_share=0.05, steal_share=0.0, load_avg=1.0, cpus=2, seconds=30)
    assert not quiet.judge((0.95, 1.10)).busy and quiet.judge((0.95, 1.10)).spread == 1.10 / 0.95
    assert not quiet.judge(None).busy
    # the bench: 1.47 [0.035, 42.5] beside two other jobs
    wide = quiet.judge((0.035, 42.5))
    assert wide.busy and "the speedup's 95 % interval [0.035, 42.5] spans 1214.3x" in wide.why
    crowded = Busy(others_share=OTHERS_LIMIT, steal_share=0.0, load_avg=4.2, cpus=2, seconds=30).judge(None)
    assert crowded.busy and crowded.why == "other processes used 25% of its CPU time (load average 4.2 on 2 CPUs)"
    stolen = Busy(others_share=0.0, steal_share=0.2, load_avg=1.0, cpus=2, seconds=30).judge((1.0, SPREAD_LIMIT))
    assert stolen.why == "the hypervisor took 20% of its CPU time"  # exactly at the spread limit is not busy
    assert set(wide.metrics()) == {"bench/others_cpu_share", "bench/steal_share", "bench/load_avg",
                                   "bench/speedup_spread"}


def test_a_child_s_cpu_time_is_this_measurement_s_own():
    """The servers a bench starts are its own work, not other processes': a child that spins for a
    second inside the watch is counted as ours, also after it ended."""
    with BusyWatch(every_s=0.1) as watch:
        child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                                  "while time.process_time() - t < 1.0: pass"])
        child.wait()
        time.sleep(0.3)
    assert watch.result is not None
    assert watch.result.ours_s >= 0.9  # the child's second (and this process's own share)
    assert 0.0 <= watch.result.others_share <= 1.0 and watch.result.cpus >= 1

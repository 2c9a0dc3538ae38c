"""System test (CPU): the CPU smoke recipe through a real single-node Slurm. The test starts slurmctld
and slurmd on localhost (Debian's slurm-wlm; `.ci/run` installs it), submits
launch/slurm/cpu_smoke.sbatch with `sbatch --wait`, and checks the training log. Skipped, saying so,
where slurm-wlm is not installed or the test is not root (slurmd needs root)."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import free_port

REPO = Path(__file__).resolve().parent.parent
DAEMONS = ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")

pytestmark = [
    pytest.mark.skipif(any(shutil.which(d) is None for d in DAEMONS),
                       reason="slurm-wlm is not installed (.ci/run installs it with apt-get)"),
    pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() != 0, reason="slurmd must run as root"),
]


@pytest.fixture
def slurm(tmp_path):
    host = socket.gethostname()
    conf = tmp_path / "slurm.conf"
    for d in ("state", "spool", "log"):
        (tmp_path / d).mkdir()
    conf.write_text("\n".join([
        "ClusterName=topoepci", f"SlurmctldHost={host}", f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}", "AuthType=auth/none", "CredType=cred/none", "SlurmUser=root",
        "SlurmdUser=root", f"StateSaveLocation={tmp_path}/state", f"SlurmdSpoolDir={tmp_path}/spool",
        f"SlurmctldPidFile={tmp_path}/slurmctld.pid", f"SlurmdPidFile={tmp_path}/slurmd.pid",
        f"SlurmctldLogFile={tmp_path}/log/slurmctld.log", f"SlurmdLogFile={tmp_path}/log/slurmd.log",
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True)
    subprocess.run(["slurmd", "-f", str(conf)], env=env, check=True)
    try:
        for _ in range(60):  # wait for the node to register (not a performance limit: a readiness poll)
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            if out.strip() == "idle":
                break
            time.sleep(1)
        else:
            pytest.fail(f"the Slurm node never became idle: {out!r}; see {tmp_path}/log")
        yield env
    finally:
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True)
        for pid_file in ("slurmd.pid", "slurmctld.pid"):
            p = tmp_path / pid_file
            if p.exists():
                subprocess.run(["kill", p.read_text().strip()], capture_output=True)


def test_cpu_smoke_through_slurm(slurm, tmp_path):
    log = tmp_path / "job.out"
    env = {**slurm, "TOPOEP_PYTHON": sys.executable, "TOPOEP_ROOT": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["sbatch", "--wait", f"--output={log}", "launch/slurm/cpu_smoke.sbatch",
                           f"trainer.run_dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True)
    text = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, f"sbatch failed: {proc.stdout}{proc.stderr}\n--- job output ---\n{text[-5000:]}"
    assert "Topology(num_domains=2, ranks_per_domain=2" in text
    assert "step    3/3 (100 %, ETA 0:00) | loss" in text and "imbalance" in text
